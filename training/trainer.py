"""Train state, sharding and the train step of one task on one mesh.

The abstract state (shapes, dtypes and the current mesh's shardings, from an
abstract init that costs no FLOPs) is what a restore is given, so Orbax
reshards a checkpoint written on any other mesh (``training.checkpoint.manager``).
The model, its loss and its data come from the task (:mod:`training.tasks`);
the optimizer and schedule from the config (:mod:`training.optim`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from training.mesh import LOGICAL_RULES
from training.optim import make_optimizer, make_schedule
from training.sections import OptimizerSection
from training.tasks import Metrics, Task, on_mesh

State = dict[str, Any]
# The most elements a state may have for its initialisation to be compiled without optimisation on CPU:
# beyond about 500M, the slower run costs more than the faster compile saves.
UNOPTIMISED_INIT_MAX = 100_000_000
Batch = dict[str, jax.Array]
# A step's metrics by name (the task's own, loss, grad_norm, lr, notice): replicated scalars, on the device.
StepMetrics = dict[str, jax.Array]


def logical_rules(task: Task) -> tuple[tuple[str, Any], ...]:
    """The logical axis rules a task is sharded by: its own (an optional ``logical_rules()``) before the engine's."""
    own = getattr(task, "logical_rules", None)
    return (tuple(own()) if callable(own) else ()) + LOGICAL_RULES


class StateLayout(NamedTuple):
    """A task's parameters and optimizer state on one mesh: their abstract values and their shardings."""

    params: Any  # jax.ShapeDtypeStruct leaves
    param_shardings: Any
    opt_state: Any  # jax.ShapeDtypeStruct leaves
    opt_shardings: Any


def state_shardings(task: Task, tx: optax.GradientTransformation, mesh: Mesh) -> StateLayout:
    """The parameters' and optimizer state's abstract values and shardings, from one abstract init.

    Parameters are sharded by their logical axes; an optimizer-state leaf shaped
    like its parameter shares its sharding, and any other (counts, factored
    statistics) is replicated.
    """
    rules = logical_rules(task)
    with jax.set_mesh(mesh), on_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(task.init, jax.random.key(0))
    params_abs = nn.unbox(boxed)
    param_sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    replicated = NamedSharding(mesh, P())
    opt_abs = jax.eval_shape(tx.init, params_abs)
    opt_sh = optax.tree_utils.tree_map_params(
        tx,
        lambda leaf, param, sh: sh if leaf.shape == param.shape else replicated,
        opt_abs,
        params_abs,
        param_sh,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
    )
    return StateLayout(params_abs, param_sh, opt_abs, opt_sh)


class Trainer:
    """The task's model, the optimizer and the shardings of one run on one mesh."""

    def __init__(self, optimizer: OptimizerSection, mesh: Mesh, task: Task) -> None:
        self.opt = optimizer
        self.mesh = mesh
        self.task = task
        self.schedule = make_schedule(optimizer)
        self.tx = make_optimizer(optimizer, self.schedule)
        self.batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
        self.replicated = NamedSharding(mesh, P())
        # One flag per device, set by the process that owns it: the step all-reduces them, so every
        # process learns in the step's own output that one of them was told to stop (a preemption notice).
        self.flag_sharding = NamedSharding(mesh, P(mesh.axis_names))
        self.spec = task.example_spec()

        layout = state_shardings(task, self.tx, mesh)
        scalar = self.replicated
        self.shardings: State = {
            "step": scalar,
            "params": layout.param_shardings,
            "opt_state": layout.opt_shardings,
            "rng": scalar,
        }
        # The abstract state from the one abstract init above (the model is not traced again for it).
        abstract = {
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            "params": layout.params,
            "opt_state": layout.opt_state,
            "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
        }
        self.abstract = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, self.shardings
        )
        seed = optimizer.seed
        self._init = jax.jit(lambda: self._init_state(jax.random.key(seed)), out_shardings=self.shardings)
        self._init_compiled: Any = None
        batch_sh = {k: self.batch_sharding for k in self.spec}
        self._step = jax.jit(
            self._train_step,
            in_shardings=(self.shardings, batch_sh, self.replicated, self.flag_sharding),
            out_shardings=(self.shardings, self.replicated),
            donate_argnums=(0,),
        )
        self._compiled: Any = None
        self._eval: Any = None
        self._scales: dict[float, jax.Array] = {}
        self._flags: dict[int, jax.Array] = {}

    # --- state -------------------------------------------------------------------
    def _init_state(self, key: jax.Array) -> State:
        params = nn.unbox(self.task.init(key))
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": self.tx.init(params),
            # The RNG is state too: saved, restored, never re-derived from the clock.
            "rng": jax.random.key_data(jax.random.key(self.opt.seed + 1)),
        }

    def tracing(self) -> contextlib.ExitStack:
        """The context the task's code is traced in: this mesh and the logical axis rules (activation constraints)."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(on_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(logical_rules(self.task)))
        return stack

    def init(self) -> State:
        """A new model's state on this mesh (from the optimizer section's ``seed``)."""
        if self._init_compiled is None:
            self.compile_init()
        with self.tracing():
            return cast(State, self._init_compiled())

    def lower_init(self) -> Any:
        """The new model's initialisation lowered for this mesh."""
        with self.tracing():
            return self._init.lower()

    def init_compiler_options(self) -> dict[str, int] | None:
        """The XLA options the initialisation is compiled with (None: the defaults).

        It runs once.  On CPU, a state of up to ``UNOPTIMISED_INIT_MAX`` elements is compiled without
        optimisation: a small model's initialisation then compiles in half the time (3.4 s of CPU against
        1.5 s for the ``small`` preset) and runs in tens of milliseconds instead of ten.
        """
        if self.mesh.devices.flat[0].platform != "cpu":
            return None
        elements = sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract))
        return {"xla_backend_optimization_level": 0} if elements <= UNOPTIMISED_INIT_MAX else None

    def compile_init(self) -> Any:
        """AOT-compile the new model's initialisation for this mesh; ``init`` then runs it.  Returns it."""
        self._init_compiled = self.lower_init().compile(compiler_options=self.init_compiler_options())
        return self._init_compiled

    def load_init(self, compiled: Any) -> None:
        """Take an initialisation compiled for this mesh elsewhere (by the round's process 0)."""
        self._init_compiled = compiled

    # --- the step ------------------------------------------------------------------
    def _grads(self, params: Any, batch: Batch, rng: jax.Array) -> tuple[jax.Array, Any, Metrics]:
        """Loss, gradients and metrics of a batch, over ``grad_accum`` micro-batches when asked."""
        grad_fn = jax.value_and_grad(self.task.loss, has_aux=True)
        m = self.opt.grad_accum
        if m == 1:
            (loss, aux), grads = grad_fn(params, batch, rng)
            return loss, grads, aux
        # Micro-batch i is rows i, i+m, i+2m, ...: each device's rows stay on it (no resharding).
        micro = {k: jnp.swapaxes(v.reshape(v.shape[0] // m, m, *v.shape[1:]), 0, 1) for k, v in batch.items()}

        def body(carry: tuple[jax.Array, Any, Any], xs: tuple[Batch, jax.Array]) -> tuple[Any, None]:
            loss_sum, grad_sum, aux_sum = carry
            mb, key = xs
            (loss, aux), grads = grad_fn(params, mb, key)
            add = jax.tree.map(jnp.add, (loss_sum, grad_sum, aux_sum), (loss, grads, aux))
            return add, None

        shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda v: v[0], micro), rng)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (shapes[0][0], shapes[1], shapes[0][1]))
        (loss, grads, aux), _ = jax.lax.scan(body, zeros, (micro, jax.random.split(rng, m)))
        return jax.tree.map(lambda x: x / m, (loss, grads, aux))  # type: ignore[no-any-return]

    def _train_step(
        self, state: State, batch: Batch, lr_scale: jax.Array, flags: jax.Array
    ) -> tuple[State, StepMetrics]:
        rng, step_rng = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        loss, grads, aux = self._grads(state["params"], batch, step_rng)
        grad_norm = optax.tree.norm(grads)  # the metric, and the clip's (computed once: see optim.clip_by_global_norm)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"], grad_norm=grad_norm)
        # lr_scale is 1.0 except when a rollback (or a chaos fault) changes the learning rate.
        updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
        params = optax.apply_updates(state["params"], updates)
        new = {
            "step": state["step"] + 1,
            "params": params,
            "opt_state": opt_state,
            "rng": jax.random.key_data(rng),
        }
        metrics = {
            **aux,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": self.schedule(state["step"]) * lr_scale,  # the rate this step's update used
            "notice": jnp.sum(flags),  # a sum, not a max: its all-reduce joins the step's others
        }
        return new, metrics

    def global_batch(self, local: Mapping[str, np.ndarray], size: int | None = None) -> Batch:
        """Assemble this process's rows of each field into global arrays sharded over (data, fsdp)
        (``size`` rows in all; default: the training batch)."""
        b = size or self.opt.global_batch
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, local[k], (b, *local[k].shape[1:]))
            for k in self.spec
        }

    def step(
        self, state: State, batch: Batch, lr_scale: float = 1.0, notice: bool = False
    ) -> tuple[State, StepMetrics]:
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
                (n,),
                self.flag_sharding,
                lambda idx: np.full(len(range(*cast(Any, idx)[0].indices(n))), flag, np.float32),
            )
        if self._compiled is None:
            with self.tracing():
                return cast(tuple[State, StepMetrics], fn(state, batch, self._scales[lr_scale], self._flags[flag]))
        return cast(tuple[State, StepMetrics], fn(state, batch, self._scales[lr_scale], self._flags[flag]))

    def evaluate(self, params: Any, batch: Batch) -> dict[str, jax.Array]:
        """The task's evaluation metrics of one global batch on this mesh (replicated scalars)."""
        if self._eval is None:
            batch_sh = {k: self.batch_sharding for k in self.spec}
            self._eval = jax.jit(
                self.task.evaluate, in_shardings=(self.shardings["params"], batch_sh), out_shardings=self.replicated
            )
        with self.tracing():
            return cast(dict[str, jax.Array], self._eval(params, batch))

    def corrupt(self, state: State) -> State:
        """Chaos: overwrite the parameters with noise (a regression validation must catch)."""
        noise = jax.jit(
            lambda p: jax.tree.map(lambda x: jax.random.normal(jax.random.key(7), x.shape, x.dtype) * 3.0, p),
            out_shardings=self.shardings["params"],
        )
        return {**state, "params": noise(state["params"])}

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The global batch's shapes and shardings."""
        b = self.opt.global_batch
        return {
            k: jax.ShapeDtypeStruct((b, *s.shape), np.dtype(s.dtype), sharding=self.batch_sharding)
            for k, s in self.spec.items()
        }

    def lower(self) -> Any:
        """The step lowered for the current mesh, from shapes alone."""
        scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.replicated)
        flags = jax.ShapeDtypeStruct((self.mesh.size,), jnp.float32, sharding=self.flag_sharding)
        with self.tracing():
            return self._step.lower(self.abstract, self.abstract_batch(), scalar, flags)

    def compile(self) -> Any:
        """AOT-compile the step for the current mesh (a hit in the persistent cache on a resume); returns it."""
        self._compiled = self.lower().compile()
        return self._compiled

    def load(self, compiled: Any) -> None:
        """Take a step compiled for this mesh before (by this job): no tracing, no lowering, no compiling."""
        self._compiled = compiled

    @property
    def compiled(self) -> Any:
        """The compiled step (None before ``compile`` or ``load``)."""
        return self._compiled
