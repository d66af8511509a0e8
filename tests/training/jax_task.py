"""A user's task that uses JAX wherever a user might: at import, in its factory, its constructor and ``data()``.

A linear model fitted to a linear teacher; the tests train it through the engine
(``tests/training/test_user_task.py``).  ``task_args``: ``fail`` names a stage (factory, init, loss, data)
whose code raises in a job's workers (not in the launch's own check of the task), ``examples`` the
number of training examples.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from training.config import Config
from training.tasks import Batch, ExampleSpec, Metrics, TaskData

FEATURES = 8
TEACHER = jnp.linspace(-1.0, 1.0, FEATURES, dtype=jnp.float32)  # an array on a device, made at import


def fail_here(args: dict[str, Any], stage: str) -> None:
    """Raise if ``stage`` is the one ``args`` break, in a job's worker."""
    if args.get("fail") == stage and os.environ.get("RTRAIN_HOST"):
        raise RuntimeError(f"{stage} is broken on purpose\nand this second line is not in the job's reason")


class Examples:
    """Example ``i``: ``x`` ~ N(0, 1) and ``y = x . w`` (a pure function of ``i``)."""

    def __init__(self, w: np.ndarray, offset: int) -> None:
        self.w, self.offset = w, offset

    def __call__(self, i: int) -> dict[str, np.ndarray]:
        x = np.random.default_rng([7, self.offset + i]).normal(size=FEATURES).astype(np.float32)
        return {"x": x, "y": np.asarray(x @ self.w, np.float32)}


class Linear:
    """A linear model (plain arrays: replicated) and its mean squared error."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args
        self.devices = jax.devices()  # once the round has joined: every process's devices
        self.scale = jnp.float32(2.0)
        self.w = np.asarray(jax.jit(lambda t, s: t * s)(TEACHER, self.scale))  # jitted, and run, in __init__
        # What this process saw as it built the task (in the worker's log): every process of the round.
        print(f"jax_task: built in process {jax.process_index()} of {jax.process_count()}", file=sys.stderr)

    def init(self, rng: jax.Array) -> Any:
        fail_here(self.args, "init")
        return {"w": jnp.zeros((FEATURES,), jnp.float32), "b": jnp.zeros((), jnp.float32)}

    def _errors(self, params: Any, batch: Batch) -> jax.Array:
        return batch["x"] @ params["w"] + params["b"] - batch["y"]

    def loss(self, params: Any, batch: Batch, rng: jax.Array) -> tuple[jax.Array, Metrics]:
        fail_here(self.args, "loss")
        err = self._errors(params, batch)
        return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}

    def evaluate(self, params: Any, batch: Batch) -> Metrics:
        err = self._errors(params, batch)
        return {"loss": jnp.mean(err**2), "mae": jnp.mean(jnp.abs(err))}

    def example_spec(self) -> dict[str, ExampleSpec]:
        return {"x": ExampleSpec((FEATURES,), "float32"), "y": ExampleSpec((), "float32")}

    def data(self) -> TaskData:
        import grain

        fail_here(self.args, "data")
        n = int(jnp.sum(jnp.ones((int(self.args.get("examples", 512)),), jnp.int32)))  # JAX in data() too
        digest = hashlib.sha256(self.w.tobytes() + str(n).encode()).hexdigest()[:16]
        return TaskData(
            train=grain.MapDataset.range(n).map(Examples(self.w, 0)),
            validation=grain.MapDataset.range(64).map(Examples(self.w, 1 << 20)),
            fingerprint=f"linear-{digest}",
        )

    def tokens_per_example(self) -> int:
        return 1


def make_task(cfg: Config, task_args: dict[str, Any]) -> Linear:
    fail_here(dict(task_args), "factory")
    assert jax.device_count() >= 1  # jax.devices() in the factory
    return Linear(dict(task_args))
