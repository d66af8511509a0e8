"""The memory-fit check read from the compiled train step: per-device bytes for any task.

The formula in :mod:`training.mesh` knows only the built-in Llama model; the
compiled program knows every task.  The step is lowered from shapes alone
(nothing is allocated) for the plan's mesh on fake CPU devices, in a child
process, since the device count is fixed when JAX starts and the real run may
have more devices than this machine.  The figures are XLA's buffer assignment
for the CPU backend: the same sharded program, but not an accelerator
compiler's fusion and scheduling decisions, so treat them as an estimate.
Where this machine has an accelerator with the plan's devices, the step is
compiled for it as well and its figures are the ones used; the CPU estimate's
error against them is reported (``cpu_error``).

Importing this module costs nothing: JAX is imported only in the child.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.config import Config, config_from_json
from training.mesh import PlanError, plan_mesh

if TYPE_CHECKING:
    from training.mesh import MeshPlan
    from training.trainer import Trainer

GIB = 2**30
TIMEOUT_S = 900.0


@dataclass(frozen=True)
class CompiledMemory:
    """Per-device bytes of one compiled train step, from XLA's buffer assignment (CPU backend)."""

    argument_bytes: int  # train state + batch + step inputs, this device's shards
    output_bytes: int
    temp_bytes: int  # gradients, activations, optimizer temporaries
    code_bytes: int
    alias_bytes: int  # outputs written in place of (donated) arguments
    peak_bytes: int  # XLA's own peak, when it reports one (0 otherwise)
    state_bytes: int  # the abstract train state's shard on one device (the expected share of the arguments)
    params: int  # parameter count, from the abstract parameters
    devices: int
    mesh_shape: dict[str, int]
    compile_s: float  # lowering plus compilation
    backend: str = "cpu"  # the platform compiled for
    device_kind: str = ""
    device_bytes: int = 0  # the device's own memory limit (0: the backend does not say)
    cpu_total_bytes: int = 0  # on an accelerator: the CPU backend's estimate of the same step (0: not made)

    @property
    def cpu_error(self) -> float | None:
        """The CPU estimate's relative error against the accelerator's compiled figure (None: not compared)."""
        if self.backend == "cpu" or not self.cpu_total_bytes or not self.total_bytes:
            return None
        return self.cpu_total_bytes / self.total_bytes - 1.0

    @property
    def total_bytes(self) -> int:
        """The peak estimate, plus code: on an accelerator XLA's own peak when it reports one; else the larger of
        that and the live arguments, outputs and temporaries.

        On a TPU v5e the sum overstated the chip's own peak (buffers in use plus the program's reserved
        temporaries) by 6 to 20%; XLA's peak was within 1% of it.
        """
        live = self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
        if self.backend != "cpu" and self.peak_bytes:
            return self.peak_bytes + self.code_bytes
        return max(self.peak_bytes, live) + self.code_bytes

    def gib(self) -> dict[str, float]:
        """The figures in GiB, for reports."""
        return {
            "arguments": self.argument_bytes / GIB,
            "outputs": self.output_bytes / GIB,
            "temporaries": self.temp_bytes / GIB,
            "code": self.code_bytes / GIB,
            "alias": self.alias_bytes / GIB,
            "total": self.total_bytes / GIB,
            **({"cpu_estimate": self.cpu_total_bytes / GIB} if self.cpu_total_bytes else {}),
        }

    def table(self) -> str:
        rows = [
            ("arguments (state + batch)", self.argument_bytes),
            ("outputs", self.output_bytes),
            ("aliased (donated state)", -self.alias_bytes),
            ("temporaries", self.temp_bytes),
            ("generated code", self.code_bytes),
            ("total", self.total_bytes),
        ]
        return "\n".join(f"  {name:<28} {val / GIB:10.2f} GiB" for name, val in rows)


def accelerator_present() -> bool:
    """Whether this machine has an accelerator JAX would use, without starting JAX (which would hold the chip).

    ``JAX_PLATFORMS`` decides when set; else a TPU's or an NVIDIA GPU's device files.
    """
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0] not in ("cpu", "")
    return any(glob.glob(p) for p in ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*"))


def compiled_memory(cfg: Config, workers: int, *, timeout_s: float = TIMEOUT_S) -> CompiledMemory:
    """The compiled step's per-device memory on the plan for ``workers`` hosts, measured in a child process.

    With an accelerator on this machine the step is compiled for it too (when it has the plan's devices):
    those figures are returned, with the CPU estimate beside them.  Raises :class:`~training.mesh.PlanError`
    (or the task's ``TaskError``) with the child's one-line reason.
    """
    cpu = _child(cfg, workers, timeout_s, device=False)
    if not accelerator_present():
        return cpu
    try:
        dev = _child(cfg, workers, timeout_s, device=True)
    except PlanError as e:
        if out_of_memory(str(e)):  # the chip itself refused the step: that is the answer, not a missing figure
            raise PlanError(f"the step does not fit the device: {e}") from e
        return cpu  # the accelerator is busy, or has fewer devices than the plan: the CPU estimate stands
    return replace(dev, cpu_total_bytes=cpu.total_bytes)


# What XLA says when a program's buffers exceed the device's memory at compile time (TPU and GPU backends).
_OOM = re.compile(r"RESOURCE_EXHAUSTED|ran out of memory|out of memory", re.IGNORECASE)


def out_of_memory(error: str) -> bool:
    """Whether a failed compile's message is the device refusing the program for its memory."""
    return _OOM.search(error) is not None


def _child(cfg: Config, workers: int, timeout_s: float, device: bool) -> CompiledMemory:
    return CompiledMemory(**run_child("training.memfit", cfg, workers, timeout_s, device, "argument_bytes"))


def run_child(
    module: str,
    cfg: Config,
    workers: int,
    timeout_s: float,
    device: bool,
    key: str,
    failed: str = "the compiled memory analysis failed: ",
) -> dict[str, Any]:
    """Run ``python -m module --workers N [--device]`` on the config (as JSON on its stdin), on fake CPU devices for
    the plan unless ``device``, and return the one line of JSON it prints, which holds ``key``.  Its ``error``
    is raised as a PlanError after ``failed`` (or as the task's TaskError)."""
    plan = plan_mesh(cfg.placement, workers)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
    env = dict(os.environ)
    if not device:
        env["JAX_PLATFORMS"] = "cpu"
        # Buffer assignment is done before code generation: cheap code generation halves the compile time.
        env["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={plan.devices} "
            "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true".strip()
        )
    cmd = [sys.executable, "-m", module, "--workers", str(workers)] + ["--device"] * device
    try:
        proc = subprocess.run(
            cmd, input=cfg.to_json(), capture_output=True, text=True, env=env, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise PlanError(f"the compiled memory analysis took more than {timeout_s:.0f} s") from e
    lines = proc.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        out = {}
    if "error" in out:
        if out.get("kind") == "TaskError":
            from training.tasks import TaskError

            raise TaskError(out["error"])
        raise PlanError(f"{failed}{out['error']}")
    if proc.returncode or key not in out:
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise PlanError(f"the compiled memory analysis failed (exit {proc.returncode}): {tail}")
    return out


@dataclass
class LoweredStep:
    """A train step lowered for a plan's mesh from shapes alone: its trainer, the lowered program, when it began."""

    trainer: Trainer
    lowered: Any
    plan: MeshPlan
    started: float  # time.perf_counter() before the trainer was built

    def flops(self) -> float:
        """The lowered program's FLOPs (XLA's cost analysis before optimisation; rematerialised work included)."""
        cost = self.lowered.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return float((cost or {}).get("flops", 0.0))


def lower(cfg: Config, plan: MeshPlan, first: bool = False) -> LoweredStep:
    """Lower the train step for ``plan`` over this process's devices, from shapes alone.

    This process must see exactly ``plan.devices`` devices (:func:`compiled_memory` arranges that), or at
    least that many with ``first`` (an accelerator's: the first ones are used).
    """
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    from training.mesh import AXES
    from training.tasks import load_task
    from training.trainer import Trainer

    devices = jax.devices()
    if len(devices) != plan.devices and not (first and len(devices) > plan.devices):
        raise PlanError(f"the plan wants {plan.devices} devices, this process sees {len(devices)}")
    devices = devices[: plan.devices]
    shape = tuple(plan.shape[a] for a in AXES)
    mesh = Mesh(mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True), AXES)
    t0 = time.perf_counter()
    trainer = Trainer(cfg.optimizer, mesh, load_task(cfg))  # never opens the task's data
    return LoweredStep(trainer, trainer.lower(), plan, t0)


def analyse(cfg: Config, plan: MeshPlan, first: bool = False) -> CompiledMemory:
    """Lower and compile the train step for ``plan`` over this process's devices (shapes only) and read its memory
    (see :func:`lower` for the devices)."""
    step = lower(cfg, plan, first)
    return read_memory(step, step.lowered.compile())


def read_memory(step: LoweredStep, compiled: Any) -> CompiledMemory:
    """The per-device memory of ``compiled``, the lowered ``step`` compiled."""
    import jax

    stats = compiled.memory_analysis()
    seconds = time.perf_counter() - step.started
    if stats is None:
        raise PlanError("this JAX backend reports no memory analysis for compiled programs")
    trainer, plan = step.trainer, step.plan
    devices = list(trainer.mesh.devices.flat)
    leaves = jax.tree.leaves(trainer.abstract)
    state = sum(_shard_bytes(x) for x in leaves)
    params = sum(int(x.size) for x in jax.tree.leaves(trainer.abstract["params"]))
    return CompiledMemory(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        code_bytes=int(stats.generated_code_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        peak_bytes=int(getattr(stats, "peak_memory_in_bytes", 0) or 0),
        state_bytes=state,
        params=params,
        devices=plan.devices,
        mesh_shape=dict(plan.shape),
        compile_s=round(seconds, 3),
        backend=devices[0].platform,
        device_kind=devices[0].device_kind,
        device_bytes=int((devices[0].memory_stats() or {}).get("bytes_limit", 0))
        if devices[0].platform != "cpu"
        else 0,
    )


def _shard_bytes(x: Any) -> int:
    """Bytes of one device's shard of an abstract array with a sharding."""
    import math

    shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    return int(math.prod(shard)) * int(x.dtype.itemsize)


def main(argv: list[str] | None = None) -> int:
    """The child: a config as JSON on stdin, one line of JSON out (the figures, or ``error`` and ``kind``)."""
    ap = argparse.ArgumentParser(prog="python -m training.memfit", description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--config-json", default=None, help="config file (default: the config as JSON on stdin)")
    ap.add_argument("--device", action="store_true", help="compile for this machine's accelerator (refused on CPU)")
    args = ap.parse_args(argv)
    from training.tasks import TaskError

    try:
        text = Path(args.config_json).read_text() if args.config_json else sys.stdin.read()
        cfg = config_from_json(text)
        if args.device:
            import jax

            if jax.default_backend() == "cpu":
                raise PlanError("no accelerator: JAX found only the CPU")
        result: dict[str, Any] = asdict(analyse(cfg, plan_mesh(cfg.placement, args.workers), first=args.device))
    except (PlanError, TaskError) as e:
        result = {"error": str(e), "kind": "TaskError" if isinstance(e, TaskError) else type(e).__name__}
    except Exception as e:  # noqa: BLE001 - a user's model may fail to trace in any way: one line back
        first = (str(e).strip().splitlines() or [""])[0]
        result = {"error": f"{type(e).__name__}: {first}", "kind": type(e).__name__}
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
