"""Train state, sharding and the train step of one run on one mesh.

The abstract state (shapes, dtypes and the current mesh's shardings, from an
abstract init that costs no FLOPs) is what a restore is given, so Orbax
reshards a checkpoint written on any other mesh (``training.checkpoint.manager``).
"""

from __future__ import annotations

from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from training.config import Config
from training.mesh import LOGICAL_RULES
from training.model import Transformer, loss_fn

State = dict[str, Any]


def make_schedule(cfg: Config) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    schedule = make_schedule(cfg)
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    parts.append(optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
    return optax.chain(*parts)


class Trainer:
    """The model, optimizer and shardings of one run on one mesh."""

    def __init__(self, cfg: Config, mesh: Mesh) -> None:
        self.cfg = cfg
        self.mesh = mesh
        self.model = Transformer(cfg)
        self.tx = make_optimizer(cfg)
        self.schedule = make_schedule(cfg)
        self.batch_sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
        self.replicated = NamedSharding(mesh, P())
        # One flag per device, set by the process that owns it: the step all-reduces them, so every
        # process learns in the step's own output that one of them was told to stop (a preemption notice).
        self.flag_sharding = NamedSharding(mesh, P(mesh.axis_names))

        # Shapes and logical axes come from an abstract init (no FLOPs, no memory).
        boxed = jax.eval_shape(self._init_boxed, jax.random.key(0))
        specs = nn.get_partition_spec(boxed)
        self.shardings = nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_RULES)
        self.abstract = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), nn.unbox(boxed), self.shardings
        )
        self._init = jax.jit(lambda key: nn.unbox(self._init_boxed(key)), out_shardings=self.shardings)
        self._step = jax.jit(
            self._train_step,
            in_shardings=(
                self.shardings,
                self.batch_sharding,
                self.batch_sharding,
                self.replicated,
                self.flag_sharding,
            ),
            out_shardings=(self.shardings, self.replicated),
            donate_argnums=(0,),
        )
        self._compiled: Any = None
        self._scales: dict[float, jax.Array] = {}
        self._flags: dict[int, jax.Array] = {}

    # --- state -------------------------------------------------------------------
    def _init_boxed(self, key: jax.Array) -> State:
        tokens = jnp.zeros((1, self.cfg.seq_len), jnp.int32)
        params = self.model.init(key, tokens)["params"]
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": self.tx.init(params),
            # The RNG is state too: saved, restored, never re-derived from the clock.
            "rng": jax.random.key_data(jax.random.key(self.cfg.seed + 1)),
        }

    def init(self) -> State:
        return cast(State, self._init(jax.random.key(self.cfg.seed)))

    # --- the step ------------------------------------------------------------------
    def _train_step(
        self, state: State, inputs: jax.Array, targets: jax.Array, lr_scale: jax.Array, flags: jax.Array
    ) -> tuple[State, dict[str, Any]]:
        def compute_loss(params: Any) -> tuple[jax.Array, dict[str, Any]]:
            logits = cast(jax.Array, self.model.apply({"params": params}, inputs))
            return loss_fn(logits, targets)

        (loss, aux), grads = jax.value_and_grad(compute_loss, has_aux=True)(state["params"])
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        # lr_scale is 1.0 except when a rollback (or a chaos fault) changes the learning rate.
        updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
        params = optax.apply_updates(state["params"], updates)
        new = {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}
        metrics = {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),
            "lr": self.schedule(state["step"]) * lr_scale,  # the rate this step's update used
            "notice": jnp.max(flags),
            **aux,
        }
        return new, metrics

    def global_batch(self, local: dict[str, np.ndarray]) -> tuple[jax.Array, jax.Array]:
        """Assemble this process's rows into global arrays sharded over (data, fsdp)."""
        b = self.cfg.global_batch
        arrays = []
        for key in ("inputs", "targets"):
            x = local[key]
            arrays.append(jax.make_array_from_process_local_data(self.batch_sharding, x, (b, *x.shape[1:])))
        return arrays[0], arrays[1]

    def step(
        self, state: State, inputs: jax.Array, targets: jax.Array, lr_scale: float = 1.0, notice: bool = False
    ) -> tuple[State, dict[str, Any]]:
        """Dispatch one step (asynchronously: nothing here waits for the device).

        ``notice``: this process was told to stop (a preemption notice); the step's
        ``notice`` metric is 1 on every process when any of them was.
        """
        fn = self._compiled if self._compiled is not None else self._step
        if lr_scale not in self._scales:
            # (not device_put: its cross-process equality check fails on NaN, which chaos uses)
            self._scales[lr_scale] = jax.make_array_from_callback(
                (), self.replicated, lambda _: np.asarray(lr_scale, np.float32)
            )
        flag = int(notice)
        if flag not in self._flags:
            n = self.mesh.size
            self._flags[flag] = jax.make_array_from_callback(
                (n,), self.flag_sharding, lambda idx: np.full(len(range(*cast(Any, idx)[0].indices(n))), flag, np.int32)
            )
        return cast(tuple[State, dict[str, Any]], fn(state, inputs, targets, self._scales[lr_scale], self._flags[flag]))

    def corrupt(self, state: State) -> State:
        """Chaos: overwrite the parameters with noise (a regression validation must catch)."""
        noise = jax.jit(
            lambda p: jax.tree.map(lambda x: jax.random.normal(jax.random.key(7), x.shape, x.dtype) * 3.0, p),
            out_shardings=self.shardings["params"],
        )
        return {**state, "params": noise(state["params"])}

    def compile(self) -> None:
        """AOT-compile the step for the current mesh (a hit in the persistent cache on a resume)."""
        b, s = self.cfg.global_batch, self.cfg.seq_len
        batch = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=self.batch_sharding)
        scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.replicated)
        flags = jax.ShapeDtypeStruct((self.mesh.size,), jnp.int32, sharding=self.flag_sharding)
        self._compiled = self._step.lower(self.abstract, batch, batch, scalar, flags).compile()
