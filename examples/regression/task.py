"""A user task: a small MLP of its own, fitted to a synthetic regression problem.

This file is what a user writes to train their own model with the engine: a
factory ``make_task(cfg, task_args) -> Task`` and the six methods the engine
calls (see ``training/tasks/__init__.py``).  Nothing here knows about hosts,
checkpoints or resizes: the engine shards the parameters by their logical axis
names, batches :attr:`TaskData.train` example by example and keeps the data
position exact across restarts.

The data is a pure function of the example's index (and the seed): example
``i`` is drawn from its own generator, so any process can read any example in
any order, and no file has to be written or shipped to the hosts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from training.config import Config
from training.tasks import Batch, ExampleSpec, Metrics, TaskData

TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float)}  # an int is a float too


@dataclass(frozen=True)
class Args:
    """The task's arguments (config key ``task_args``), with their defaults."""

    seed: int = 0  # the data: the teacher function and every example
    features: int = 16  # inputs per example
    hidden: int = 64  # the MLP's hidden width
    train_examples: int = 4096
    validation_examples: int = 512
    noise: float = 0.1  # standard deviation of the noise added to the targets

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Args:
        """Validated arguments; a ValueError naming the key for an unknown key, a wrong type or a bad value."""
        known = {f.name: f.type for f in fields(cls)}
        for key, value in raw.items():
            if key not in known:
                raise ValueError(f"task_args: unknown key {key!r} (known: {', '.join(known)})")
            want = TYPES[str(known[key])]
            if isinstance(value, bool) or not isinstance(value, want):
                raise ValueError(f"task_args.{key}: expected {known[key]}, got {type(value).__name__} {value!r}")
        values: dict[str, Any] = {k: float(v) if known[k] == "float" else v for k, v in raw.items()}  # 1 -> 1.0
        args = cls(**values)
        for key in ("features", "hidden", "train_examples", "validation_examples"):
            if getattr(args, key) < 1:
                raise ValueError(f"task_args.{key}: must be >= 1, got {getattr(args, key)}")
        if args.noise < 0:
            raise ValueError(f"task_args.noise: must be >= 0, got {args.noise}")
        return args


class MLP(nn.Module):
    """Two dense layers; the kernels carry logical axis names, so the engine can shard them."""

    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = nn.initializers.lecun_normal()
        h = nn.Dense(
            self.hidden,
            kernel_init=nn.with_logical_partitioning(dense, ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
        )(x)
        h = nn.gelu(h)
        y = nn.Dense(
            1,
            kernel_init=nn.with_logical_partitioning(dense, ("mlp", None)),  # None: that axis is not sharded
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
        )(h)
        return y[..., 0]


class Examples:
    """Example ``i`` of a split: ``x`` ~ N(0, 1) and ``y`` = a fixed nonlinear function of ``x`` plus noise.

    A pure function of ``(seed, split, i)``: what random access and an exact data position need.
    """

    def __init__(self, args: Args, split: int) -> None:
        self.args, self.split = args, split
        teacher = np.random.default_rng([args.seed, 0])  # the function to learn, shared by both splits
        self.w = teacher.normal(size=args.features) / np.sqrt(args.features)
        self.v = teacher.normal(size=args.features) / np.sqrt(args.features)

    def __call__(self, i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.args.seed, self.split, i])
        x = rng.normal(size=self.args.features)
        y = x @ self.w + np.sin(2.0 * (x @ self.v)) + self.args.noise * rng.normal()
        return {"x": x.astype(np.float32), "y": np.asarray(y, np.float32)}


def source(args: Args, split: int, n: int) -> Any:
    """A grain MapDataset of ``n`` examples: element ``i`` is example ``i`` (random access, computed on read)."""
    import grain

    return grain.MapDataset.range(n).map(Examples(args, split))


class Regression:
    """Mean squared error of the MLP on the synthetic data."""

    def __init__(self, args: Args) -> None:
        self.args = args
        self.model = MLP(args.hidden)

    def init(self, rng: jax.Array) -> Any:
        return self.model.init(rng, jnp.zeros((1, self.args.features), jnp.float32))["params"]

    def _errors(self, params: Any, batch: Batch) -> jax.Array:
        return self.model.apply({"params": params}, batch["x"]) - batch["y"]

    def loss(self, params: Any, batch: Batch, rng: jax.Array) -> tuple[jax.Array, Metrics]:
        err = self._errors(params, batch)
        return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}

    def evaluate(self, params: Any, batch: Batch) -> Metrics:
        err = self._errors(params, batch)
        return {"loss": jnp.mean(err**2), "mae": jnp.mean(jnp.abs(err))}

    def example_spec(self) -> dict[str, ExampleSpec]:
        return {"x": ExampleSpec((self.args.features,), "float32"), "y": ExampleSpec((), "float32")}

    def data(self) -> TaskData:
        a = self.args
        # The fingerprint names the data: a checkpoint trained on other data is not resumed on this one.
        data_args = {k: v for k, v in asdict(a).items() if k != "hidden"}
        digest = hashlib.sha256(json.dumps(["regression-v1", data_args], sort_keys=True).encode()).hexdigest()
        return TaskData(
            train=source(a, 1, a.train_examples),
            validation=source(a, 2, a.validation_examples),
            fingerprint=f"regression-{digest[:16]}",
        )

    def tokens_per_example(self) -> int:
        return 1  # throughput is reported in examples/s


def make_task(cfg: Config, task_args: dict[str, Any]) -> Regression:
    """The factory the config names (``task: examples/regression/task.py:make_task``)."""
    return Regression(Args.parse(task_args))
