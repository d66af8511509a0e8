"""``remat: auto``: the remat policy whose compiled train step is fastest among those that fit the device.

Each policy's step is lowered from shapes alone (cheap) and ranked by its FLOPs, which count the work
it recomputes in the backward pass (fewest first; between equal FLOPs, the policy that keeps less).
Then the steps are compiled in that order, and the first whose compiled memory fits 90% of
``device_memory_gib`` (the margin the fit check keeps) is the choice: so a policy is compiled only
when every faster one did not fit.  As for :mod:`training.memfit`, it runs in a child process on fake
CPU devices for the plan's mesh (XLA's CPU buffer assignment: an estimate), or on this machine's
accelerator when it has the plan's devices (a compile the device refuses for its memory is a policy
that does not fit).  The choice is made at the minimum topology, where each device holds the
largest share of the constant global batch: a larger mesh needs less.

Importing this module costs nothing: JAX is imported only in the child.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.config import Config, config_from_json
from training.memfit import GIB, TIMEOUT_S, CompiledMemory, accelerator_present, out_of_memory, run_child
from training.mesh import PlanError, fit_hints, plan_mesh

# The policies auto chooses among, from the one that keeps least for the backward pass to the one that keeps
# most (training.models.llama.REMAT_POLICIES): the order breaks ties between equal FLOPs.
CANDIDATES = ("full", "qkv_proj", "attn", "attn_mlp", "dots", "none")
USABLE = 0.9  # the share of device_memory_gib a step may take (the fit check's margin)
TIE = 1e-3  # FLOPs within this fraction of each other are equal


@dataclass(frozen=True)
class Tried:
    """One policy as auto saw it: its step's FLOPs, and its compiled memory where it was compiled."""

    policy: str
    flops: float
    total_bytes: int | None = None  # None: not compiled (a faster one fitted), or the device refused it
    error: str = ""  # the device's refusal at compile (out of memory)

    def says(self) -> str:
        """Its figures in words: ``dots 24.00 GiB (2.75 TFLOP)``."""
        mem = f"{self.total_bytes / GIB:.2f} GiB" if self.total_bytes is not None else self.error or "not compiled"
        return f"{self.policy} {mem}" + (f" ({_flops(self.flops)})" if self.flops else "")


@dataclass(frozen=True)
class RematChoice:
    """The policy auto chose, the memory it may use, and each policy it looked at (fastest first)."""

    policy: str
    usable_bytes: int
    tried: tuple[Tried, ...]
    memory: CompiledMemory | None = None  # the chosen step's figures

    def reason(self) -> str:
        """Why, in one line: the chosen policy's FLOPs and memory against the limit, and the faster ones' memory."""
        chosen = next(t for t in self.tried if t.policy == self.policy)
        faster = self.tried[: self.tried.index(chosen)]
        over = f"; faster but over it: {', '.join(t.says() for t in faster)}" if faster else ""
        fastest = (
            f"the fewest FLOPs a step ({_flops(chosen.flops)})"
            if chosen.flops
            else "the one that recomputes least (this backend counts no FLOPs before compiling)"
        )
        return (
            f"remat auto: {self.policy}, {fastest} of the policies whose "
            f"compiled step fits {self.usable_bytes / GIB:.2f} GiB ({USABLE:.0%} of device_memory_gib): "
            f"{(chosen.total_bytes or 0) / GIB:.2f} GiB{over}"
        )

    def report(self) -> dict[str, Any]:
        """The choice as JSON: ``rtrain plan --json``'s ``remat``."""
        return {
            "policy": self.policy,
            "reason": self.reason(),
            "usable_gib": self.usable_bytes / GIB,
            "tried": [
                {"policy": t.policy, "flops": t.flops, "gib": None if t.total_bytes is None else t.total_bytes / GIB}
                | ({"error": t.error} if t.error else {})
                for t in self.tried
            ],
        }


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def order(flops: Mapping[str, float]) -> list[str]:
    """The policies fastest first: by their step's FLOPs; within ``TIE`` of each other, the one that keeps less
    (same work, less memory).  Where the backend counts no FLOPs before compiling (a TPU's lowered program
    answers none), the one that keeps most first: it recomputes least."""
    if not any(flops.values()):
        return sorted(flops, key=lambda p: -CANDIDATES.index(p))
    least = min(flops.values()) or 1.0
    return sorted(flops, key=lambda p: (round(flops[p] / least / TIE), CANDIDATES.index(p)))


def choose(flops: Mapping[str, float], measure: Callable[[str], int | None], usable_bytes: int) -> RematChoice:
    """The fastest policy whose compiled memory fits ``usable_bytes``: ``measure(policy)`` compiles its step and
    gives its bytes (None: the device refused it for its memory), in order of ``flops`` until one fits.

    Raises PlanError naming each policy's figures when none fits.
    """
    tried: list[Tried] = []
    for policy in order(flops):
        total = measure(policy)
        tried.append(Tried(policy, flops[policy], total, "" if total is not None else "out of memory at compile"))
        if total is not None and total <= usable_bytes:
            rest = tuple(Tried(p, flops[p]) for p in order(flops)[len(tried) :])
            return RematChoice(policy, usable_bytes, (*tried, *rest))
    raise PlanError(
        f"remat auto: no policy's compiled step fits {usable_bytes / GIB:.2f} GiB ({USABLE:.0%} of the device's): "
        + "; ".join(t.says() for t in tried)
    )


def choose_remat(cfg: Config, workers: int, *, timeout_s: float = TIMEOUT_S) -> RematChoice:
    """``remat: auto`` resolved for the plan of ``workers`` hosts, in a child process (see the module's note).

    On this machine's accelerator when it has one with the plan's devices; else, or when the accelerator cannot
    be used (busy, too few devices), on the CPU backend.  Raises PlanError when no policy fits.
    """
    if accelerator_present():
        try:
            return _from_child(cfg, workers, timeout_s, device=True)
        except PlanError as e:
            if str(e).startswith("remat auto: no policy"):
                raise
    return _from_child(cfg, workers, timeout_s, device=False)


def _from_child(cfg: Config, workers: int, timeout_s: float, device: bool) -> RematChoice:
    out = run_child("training.rematfit", cfg, workers, timeout_s, device, "choice", failed="")
    choice = out["choice"]
    tried = tuple(Tried(**t) for t in choice["tried"])
    return RematChoice(choice["policy"], int(choice["usable_bytes"]), tried, CompiledMemory(**out["memory"]))


def walk(cfg: Config, workers: int, device: bool) -> RematChoice:
    """In the child: lower each policy's step, then compile them fastest first until one fits (its figures kept)."""
    from training import memfit

    plan = plan_mesh(cfg.placement, workers)
    steps = {p: memfit.lower(cfg.model_copy(update={"model.remat": p}), plan, first=device) for p in CANDIDATES}
    figures: dict[str, CompiledMemory] = {}

    def measure(policy: str) -> int | None:
        step = steps.pop(policy)  # a compiled or refused step's program is let go
        try:
            compiled = step.lowered.compile()
        except Exception as e:  # noqa: BLE001 - XLA's own error type: only its out-of-memory is an answer
            if device and out_of_memory(str(e)):
                return None
            raise
        figures[policy] = memfit.read_memory(step, compiled)
        return figures[policy].total_bytes

    flops = {p: s.flops() for p, s in steps.items()}
    usable = int(USABLE * cfg.placement.device_memory_gib * GIB)
    try:
        choice = choose(flops, measure, usable)
    except PlanError as e:
        raise PlanError(f"{e}\n{fit_hints(cfg.model)}") from None
    return RematChoice(choice.policy, choice.usable_bytes, choice.tried, figures[choice.policy])


def main(argv: list[str] | None = None) -> int:
    """The child: a config as JSON on stdin, one line of JSON out (the choice and its memory, or ``error``)."""
    ap = argparse.ArgumentParser(prog="python -m training.rematfit", description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--config-json", default=None, help="config file (default: the config as JSON on stdin)")
    ap.add_argument("--device", action="store_true", help="compile for this machine's accelerator (refused on CPU)")
    args = ap.parse_args(argv)
    from training.tasks import TaskError

    try:
        cfg = config_from_json(Path(args.config_json).read_text() if args.config_json else sys.stdin.read())
        if args.device:
            import jax

            if jax.default_backend() == "cpu":
                raise PlanError("no accelerator: JAX found only the CPU")
        choice = walk(cfg, args.workers, args.device)
        assert choice.memory is not None
        result: dict[str, Any] = {
            "choice": {"policy": choice.policy, "usable_bytes": choice.usable_bytes}
            | {"tried": [asdict(t) for t in choice.tried]},
            "memory": asdict(choice.memory),
        }
    except (PlanError, TaskError) as e:
        result = {"error": str(e), "kind": "TaskError" if isinstance(e, TaskError) else type(e).__name__}
    except Exception as e:  # noqa: BLE001 - a model may fail to trace in any way: one line back
        first = (str(e).strip().splitlines() or [""])[0]
        result = {"error": f"{type(e).__name__}: {first}", "kind": type(e).__name__}
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
