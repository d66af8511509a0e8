"""Mesh planning, batch splitting and the memory-fit check.

The same code runs at the first launch and after every resize: from the number
of hosts, devices per host and hosts per slice, and the parallelism knobs
(``ici_*`` inside a slice, ``dcn_*`` across slices, as in MaxText; with one
host per slice, the local default, that is inside a host and across hosts), it
derives the mesh shape; it
then checks that the constant global batch splits over it, and (before
anything is provisioned) that the model fits at the *minimum* topology.

Planning is plain arithmetic so the Airflow side can call it without
importing JAX; ``build_mesh`` is the one function that touches devices.  The
memory formula knows only the built-in Llama model; the compiled step's own
figures (:mod:`training.memfit`, which needs JAX) are passed in as ``measure``, and
``remat: auto``'s choice from them (:mod:`training.rematfit`) as ``choose``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, NotRequired, Protocol, TypedDict

from training.config import Config
from training.sections import CheckpointSection, ModelSection, OptimizerSection, PlacementSection

AXES = ("data", "fsdp", "tensor")
# Logical parameter/activation axes -> mesh axes.
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
    ("norm", None),
    ("layers", None),
    # Activations: batch rows over (data, fsdp); heads, MLP hidden and vocabulary over tensor.
    ("act_batch", ("data", "fsdp")),
    ("act_len", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)
BYTES = {"float32": 4, "bfloat16": 2}


class PlanError(ValueError):
    """A topology the job cannot run on, with the reason and the numbers."""


def _fill(knobs: list[int], total: int, where: str) -> list[int]:
    fixed = math.prod(k for k in knobs if k != -1)
    n_fill = knobs.count(-1)
    if n_fill > 1:
        raise PlanError(f"{where}: at most one axis may be -1, got {knobs}")
    if n_fill == 1:
        if total % fixed:
            raise PlanError(f"{where}: {total} devices cannot be split with fixed axes {knobs}")
        knobs = [total // fixed if k == -1 else k for k in knobs]
    if math.prod(knobs) != total:
        raise PlanError(
            f"{where}: axes {dict(zip(AXES, knobs, strict=True))} multiply to {math.prod(knobs)}, not {total}"
        )
    return knobs


class PlanEnd(TypedDict):
    """One end of the elastic range: its hosts, its devices and the mesh's axis sizes."""

    workers: int
    devices: int
    shape: dict[str, int]


class PlanReport(TypedDict):
    """``rtrain plan``'s answer: the feasible sizes, both ends' meshes, the per-device memory at the minimum.

    ``memory_gib`` is the formula's breakdown, or the compiled step's for a task the formula does not
    know (``memory_source`` says which); ``compiled_memory_gib`` is there whenever the step was compiled.
    """

    feasible_workers: list[int]
    min_plan: PlanEnd
    max_plan: PlanEnd
    memory_gib: NotRequired[dict[str, float]]
    memory_source: NotRequired[Literal["formula", "compiled"]]
    params: NotRequired[int]
    compiled_memory_gib: NotRequired[dict[str, float]]
    remat: NotRequired[dict[str, Any]]  # remat auto: the policy chosen and why (``policy`` auto: not chosen yet)


@dataclass(frozen=True)
class MeshPlan:
    workers: int
    devices_per_worker: int
    ici: tuple[int, int, int]
    dcn: tuple[int, int, int]
    hosts_per_slice: int = 1

    @property
    def slices(self) -> int:
        return self.workers // self.hosts_per_slice

    @property
    def shape(self) -> dict[str, int]:
        return {a: i * d for a, i, d in zip(AXES, self.ici, self.dcn, strict=True)}

    @property
    def devices(self) -> int:
        return self.workers * self.devices_per_worker

    @property
    def batch_shards(self) -> int:
        s = self.shape
        return s["data"] * s["fsdp"]

    @property
    def param_shards(self) -> int:
        s = self.shape
        return s["fsdp"] * s["tensor"]

    def describe(self) -> PlanEnd:
        return {"workers": self.workers, "devices": self.devices, "shape": self.shape}


def plan_mesh(placement: PlacementSection, workers: int) -> MeshPlan:
    """The mesh for ``workers`` hosts of ``devices_per_worker`` devices each, in slices of ``hosts_per_slice``."""
    h = placement.hosts_per_slice
    if workers % h:
        raise PlanError(f"{workers} hosts are not whole slices of hosts_per_slice={h}")
    d = placement.devices_per_worker * h
    where = f"{d} devices per host" if h == 1 else f"{d} devices per slice ({h} hosts)"
    ici = _fill([placement.ici_data, placement.ici_fsdp, placement.ici_tensor], d, f"ici axes over {where}")
    n = workers // h
    dcn = _fill([placement.dcn_data, placement.dcn_fsdp, 1], n, f"dcn axes over {n} {'hosts' if h == 1 else 'slices'}")
    return MeshPlan(workers, placement.devices_per_worker, tuple(ici), tuple(dcn), h)  # type: ignore[arg-type]


def check_batch(optimizer: OptimizerSection, checkpoint: CheckpointSection, plan: MeshPlan) -> int:
    """Per-device batch for a plan; refuses a global batch (or, validated on the slice, a val_batch) that does not
    split."""
    shards = plan.batch_shards
    if optimizer.global_batch % shards or optimizer.global_batch % plan.workers:
        raise PlanError(
            f"global_batch={optimizer.global_batch} cannot be split over {plan.workers} workers x "
            f"{plan.devices_per_worker} devices (batch shards: {shards}); choose a global batch divisible by "
            f"{math.lcm(shards, plan.workers)} or another worker range"
        )
    if checkpoint.validate_on == "slice" and (checkpoint.val_batch % shards or checkpoint.val_batch % plan.workers):
        raise PlanError(
            f"val_batch={checkpoint.val_batch} cannot be split over {plan.workers} workers x {plan.devices_per_worker} "
            f"devices (validate_on: slice evaluates on the job's mesh); choose a val_batch divisible by "
            f"{math.lcm(shards, plan.workers)}"
        )
    return optimizer.global_batch // shards


def feasible_sizes(cfg: Config) -> list[int]:
    """Worker counts in min..max, whole slices, on which the job can run (mesh and batch both split)."""
    out = []
    for n in range(cfg.elastic.min_workers, cfg.elastic.max_workers + 1, cfg.placement.hosts_per_slice):
        try:
            check_batch(cfg.optimizer, cfg.checkpoint, plan_mesh(cfg.placement, n))
        except PlanError:
            continue
        out.append(n)
    return out


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    bytes_params: float
    bytes_grads: float
    bytes_optimizer: float
    bytes_activations: float
    bytes_logits: float
    device_bytes: float

    @property
    def total(self) -> float:
        return self.bytes_params + self.bytes_grads + self.bytes_optimizer + self.bytes_activations + self.bytes_logits

    def table(self) -> str:
        gib = 2**30
        rows = [
            ("parameters", self.bytes_params),
            ("gradients", self.bytes_grads),
            ("optimizer (AdamW mu, nu)", self.bytes_optimizer),
            ("activations", self.bytes_activations),
            ("logits", self.bytes_logits),
            ("total", self.total),
            ("device memory (90% usable)", self.device_bytes * 0.9),
        ]
        return "\n".join(f"  {name:<28} {val / gib:10.2f} GiB" for name, val in rows)


def param_count(model: ModelSection) -> int:
    """Parameters of the built-in Llama model, from its shapes alone (used for planning large presets)."""
    h, f, v, hd = model.d_model, model.d_ff, model.vocab_size, model.head_dim
    attn = h * model.n_heads * hd * 2 + h * model.kv_heads * hd * 2
    mlp = 3 * h * f
    per_layer = attn + mlp + 2 * h
    return v * h + model.n_layers * per_layer + h + (0 if model.tie_embeddings else h * v)


def estimate_memory(
    model: ModelSection, optimizer: OptimizerSection, placement: PlacementSection, plan: MeshPlan
) -> MemoryEstimate:
    """Per-device bytes of training state and activations on ``plan``.

    Parameters, gradients and AdamW moments are sharded over fsdp x tensor.
    Activations: per token and layer a transformer block keeps ~6h + 2*kv + 3*ff
    values for the backward pass (attention probabilities not counted: they are
    recomputed by fused attention kernels on accelerators); with activation
    checkpointing only each block's input is kept, plus one block at a time.
    """
    n = param_count(model)
    shards = plan.param_shards
    pbytes = BYTES[model.param_dtype]
    abytes = BYTES[model.dtype]
    b_dev = optimizer.global_batch / plan.batch_shards
    tokens = b_dev * model.seq_len
    t = plan.shape["tensor"]
    h, ff, kv = model.d_model, model.d_ff, model.kv_heads * model.head_dim
    per_layer_full = tokens * (6 * h + 2 * kv + 3 * ff) * abytes / t
    if model.activation_checkpointing:
        acts = model.n_layers * tokens * h * abytes + per_layer_full
    else:
        acts = model.n_layers * per_layer_full
    logits = tokens * model.vocab_size * 4 * 2 / t  # fp32 logits and their gradient
    return MemoryEstimate(
        params=n,
        bytes_params=n * pbytes / shards,
        bytes_grads=n * pbytes / shards,
        bytes_optimizer=2 * n * pbytes / shards,
        bytes_activations=acts,
        bytes_logits=logits,
        device_bytes=placement.device_memory_gib * 2**30,
    )


class CompiledFigures(Protocol):
    """A compiled step's per-device memory (``training.memfit.CompiledMemory``), as planning reads it."""

    @property
    def params(self) -> int: ...

    @property
    def total_bytes(self) -> int: ...

    def gib(self) -> dict[str, float]: ...

    def table(self) -> str: ...


class RematFigures(Protocol):
    """``remat: auto``'s choice (``training.rematfit.RematChoice``), as planning reads it."""

    @property
    def policy(self) -> str: ...

    @property
    def memory(self) -> CompiledFigures | None: ...

    def reason(self) -> str: ...

    def report(self) -> dict[str, Any]: ...


# Measures the compiled step at a worker count (``training.memfit.compiled_memory``): passed in, so
# this module stays plain arithmetic that the Airflow side can import without JAX.
Measure = Callable[[Config, int], CompiledFigures]
# Chooses remat auto's policy at a worker count from the compiled steps (``training.rematfit.choose_remat``).
Choose = Callable[[Config, int], RematFigures]
NOT_CHOSEN = (
    "remat auto: chosen from the compiled step when a job is launched (rtrain plan --compiled shows the choice); "
    "the formula counts full"
)


def formula_applies(cfg: Config) -> bool:
    """Whether :func:`estimate_memory` describes the config's model (only the built-in ``lm`` task's)."""
    return cfg.task == "lm"


def remat_auto(cfg: Config) -> bool:
    """Whether the config leaves its remat policy to the compiled step (``remat: auto``, the built-in Llama's)."""
    return cfg.model.remat == "auto" and formula_applies(cfg)


def fit_hints(model: ModelSection) -> str:
    """What a config that does not fit may change: the remat policy among them unless it is ``full`` already."""
    remat = {
        "none": "set remat (full keeps the least; dots, qkv_proj, attn, attn_mlp keep more)",
        "full": "",
        "auto": "",  # auto tried full
    }.get(model.remat, f"set remat: full (it keeps the least; {model.remat} keeps more)")
    changes = ["raise min_workers", "shard more (ici_fsdp / ici_tensor)", *([remat] if remat else [])]
    return ", ".join(changes) + ", or lower global_batch / seq_len"


def _fit(
    cfg: Config, compiled: bool, measure: Measure | None, choose: Choose | None = None
) -> tuple[MeshPlan, MemoryEstimate | None, CompiledFigures | None, RematFigures | None]:
    sizes = feasible_sizes(cfg)
    if not sizes:
        # Explain with the smallest size's own error.
        check_batch(cfg.optimizer, cfg.checkpoint, plan_mesh(cfg.placement, cfg.elastic.min_workers))
        raise PlanError(
            f"no worker count in {cfg.elastic.min_workers}..{cfg.elastic.max_workers} splits the global batch"
        )
    plan = plan_mesh(cfg.placement, sizes[0])
    where = f"the minimum topology ({plan.workers} workers x {plan.devices_per_worker} devices, mesh {plan.shape}"
    est = estimate_memory(cfg.model, cfg.optimizer, cfg.placement, plan) if formula_applies(cfg) else None
    if remat_auto(cfg) and compiled:  # the compiled steps decide, not the formula (it counts full for auto)
        if choose is None:
            raise PlanError("remat auto is chosen from the compiled steps (training.api.plan, rtrain plan --compiled)")
        choice = choose(cfg, plan.workers)
        return plan, est, choice.memory, choice
    if est is not None and est.total > 0.9 * est.device_bytes and not remat_auto(cfg):
        raise PlanError(
            f"the model does not fit at {where}, {est.params / 1e9:.2f}B parameters, per-device batch "
            f"{cfg.optimizer.global_batch // plan.batch_shards}):\n{est.table()}\n"
            f"{fit_hints(cfg.model)}"
        )
    if not (compiled or est is None):
        return plan, est, None, None
    if measure is None:
        raise PlanError(
            f"task {cfg.task!r}: the memory formula knows only the built-in 'lm' task, so its fit can only be "
            "estimated from the compiled step (training.api.plan / check_fit, or rtrain plan --compiled)"
        )
    got = measure(cfg, plan.workers)
    usable = 0.9 * cfg.placement.device_memory_gib * 2**30
    if got.total_bytes > usable:
        raise PlanError(
            f"the model does not fit at {where}, {got.params / 1e9:.2f}B parameters, per-device batch "
            f"{cfg.optimizer.global_batch // plan.batch_shards}) by the compiled step (CPU backend, XLA's buffer "
            f"assignment):\n{got.table()}\n  {'device memory (90% usable)':<28} {usable / 2**30:10.2f} GiB\n"
            f"{fit_hints(cfg.model)}"
        )
    return plan, est, got, None


def check_fit(
    cfg: Config, compiled: bool = False, measure: Measure | None = None, choose: Choose | None = None
) -> tuple[MeshPlan, MemoryEstimate | None]:
    """Refuse a config that cannot run at its minimum topology (before provisioning).

    The built-in task is checked with the formula (no JAX); with ``compiled``, and
    always for another task, also with the compiled step's memory from ``measure``
    (a task the formula does not know, without ``measure``, is refused: nothing
    can estimate it here).  The estimate is ``None`` for such a task.
    """
    plan, est, _, _ = _fit(cfg, compiled, measure, choose)
    return plan, est


def plan_report(
    cfg: Config, compiled: bool = False, measure: Measure | None = None, choose: Choose | None = None
) -> PlanReport:
    """Feasible sizes, both ends' meshes and the per-device memory at the minimum (see :func:`check_fit`); for
    ``remat: auto`` with ``compiled``, the policy ``choose`` picks (its compiled step's memory is the report's)."""
    plan, est, got, choice = _fit(cfg, compiled, measure, choose)
    report: PlanReport = {
        "feasible_workers": feasible_sizes(cfg),
        "min_plan": plan.describe(),
        "max_plan": plan_mesh(cfg.placement, max(feasible_sizes(cfg))).describe(),
    }
    if est is not None:
        report["memory_gib"] = {k: v / 2**30 for k, v in asdict(est).items() if k.startswith("bytes")} | {
            "total": est.total / 2**30
        }
        report["memory_source"] = "formula"
        report["params"] = est.params
    if got is not None:
        report["compiled_memory_gib"] = got.gib()
        if est is None:
            report["memory_gib"] = got.gib()
            report["memory_source"] = "compiled"
            report["params"] = got.params
    if choice is not None:
        report["remat"] = choice.report()
    elif remat_auto(cfg):
        report["remat"] = {"policy": "auto", "reason": NOT_CHOSEN}
    return report


def build_mesh(plan: MeshPlan, devices: list[Any] | None = None) -> Any:
    """A jax Mesh for the plan over all processes' devices (multi-controller), or over ``devices``."""
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    devices = jax.devices() if devices is None else devices
    if len(devices) != plan.devices:
        raise PlanError(f"the plan wants {plan.devices} devices, JAX sees {len(devices)}")
    if plan.workers == 1:
        arr = mesh_utils.create_device_mesh(
            tuple(i * d for i, d in zip(plan.ici, plan.dcn, strict=True)), devices, allow_split_physical_axes=True
        )
    elif plan.hosts_per_slice == 1:
        arr = mesh_utils.create_hybrid_device_mesh(plan.ici, plan.dcn, devices, process_is_granule=True)
    else:
        arr = _slice_mesh(plan, devices)
    return Mesh(arr, AXES)


def _slice_mesh(plan: MeshPlan, devices: list[Any]) -> Any:
    """A hybrid mesh whose granule is a slice of ``hosts_per_slice`` processes.

    On TPUs ``create_hybrid_device_mesh`` groups by ``device.slice_index``; CPU
    devices have none, so slices are formed from consecutive process indices
    (process id = slice * hosts_per_slice + host in slice, as the agents assign
    them): ICI axes inside a slice, DCN axes across slices.
    """
    import numpy as np

    by_slice: dict[int, list[Any]] = {}
    for dev in sorted(devices, key=lambda d: (d.process_index, d.id)):
        by_slice.setdefault(dev.process_index // plan.hosts_per_slice, []).append(dev)
    granules = [np.array(by_slice[s], dtype=object).reshape(plan.ici) for s in sorted(by_slice)]
    grid = np.empty(plan.dcn, dtype=object)
    for i, idx in enumerate(np.ndindex(*plan.dcn)):
        grid[idx] = granules[i]
    # Each mesh axis a is dcn[a] blocks of ici[a] devices.
    out = np.empty(tuple(i * d for i, d in zip(plan.ici, plan.dcn, strict=True)), dtype=object)
    for idx in np.ndindex(*plan.dcn):
        sl = tuple(slice(k * i, (k + 1) * i) for k, i in zip(idx, plan.ici, strict=True))
        out[sl] = grid[idx]
    return out
