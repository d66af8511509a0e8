"""What a worker's reports mean: how its round ended, and what a recovery cost phase by phase (pure).

A host agent collects what its worker said (``seen``: the last report of each kind) and asks here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.elastic.codes import WorkerExit
from training.elastic.rendezvous import Outcome, RecoveryRecord


def worker_outcome(seen: Mapping[str, Any], code: int, rank: int, host: str) -> tuple[Outcome, str]:
    """How the worker of rank ``rank`` on ``host`` ended, and why, from what it said and its exit code.

    What the worker said decides, not how it exited: when the first process of a group exits, the
    coordination service goes with it and a peer that has already said "finished" may abort.
    """
    if "finished" in seen:
        return Outcome.FINISHED, ""
    if "rescale_requested" in seen:
        return Outcome.RESCALE, ""
    if "guard" in seen:
        return Outcome.GUARD, str(seen["guard"].get("reason"))
    if "notice" in seen:
        return Outcome.NOTICE, f"stopped at step {seen['notice'].get('step')} (preemption notice)"
    if code == WorkerExit.CORRUPT:
        return Outcome.CORRUPT, str(seen.get("corrupt", {}).get("reason", "checkpoint corrupt"))
    peer = seen.get("error", {}).get("peer_lost")
    if peer is not None:  # a bystander: another process of the round went first, and this one left at once
        return Outcome.FAILED, f"worker {rank} on host {host} stopped: peer process {peer} is gone"
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return Outcome.FAILED, f"worker {rank} on host {host} {how}"


def last_error(path: Path, lines: int = 40) -> str:
    """The last line of a worker's log that looks like an error (its own exception)."""
    try:
        tail = path.read_bytes()[-20000:].decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    for line in reversed(tail):
        if re.match(r"^\w[\w.]*(Error|Exception|Interrupt)\b", line.strip()) or "Error:" in line:
            return line.strip()[:500]
    return ""


@dataclass(frozen=True)
class LostSeconds:
    """Where the wall time of one recovery went, from the fault to the first step after it."""

    detect: float  # the fault until the leader knew
    relaunch: float  # knowing until the restore began (the round formed, the worker assigned)
    restore: float
    compile: float
    first_step: float  # the first step's time beyond a steady step
    replay: float  # the steps since the restored checkpoint, at a steady step's pace

    @property
    def total(self) -> float:
        return round(self.detect + self.relaunch + self.restore + self.compile + self.first_step + self.replay, 3)


@dataclass(frozen=True)
class RecoveryCost:
    """One recovery: which step it resumed from, what it lost, and where its time went."""

    resume_step: int | None
    steps_lost: int
    lost_s: LostSeconds
    tier: str | None  # where the restore read from (local, persistent)
    compile_cached: bool | None  # the compiled step came from the cache


def recovery_cost(recovery: RecoveryRecord, seen: Mapping[str, Any], resumed_at: float) -> RecoveryCost:
    """What a recovery cost: the leader's record of it (``recovery``, from the round) and what the first
    worker of the new round said on its way to the step it resumed at (``resumed_at``, wall time)."""
    restore = seen.get("restore") or {}
    compiled = seen.get("compiled") or {}
    t_detected = float(recovery.get("detected_at") or resumed_at)
    t_fault = float(recovery.get("fault_at") or t_detected)
    restore_s = float(restore.get("seconds") or 0.0)
    restore_start = float(restore.get("time") or t_detected) - restore_s
    step_s = float(recovery.get("step_s") or 0.0)
    steps_lost = int(recovery.get("steps_lost") or 0)
    resume_step = recovery.get("resume_step")
    if restore.get("step") is not None and resume_step is not None:
        # The leader's estimate was made at the failure; a save still in flight then may have
        # committed since, and the round restored that newer step: count from what it restored.
        reached = int(resume_step) + steps_lost
        resume_step = int(restore["step"])
        steps_lost = max(reached - resume_step, 0)
    lost = LostSeconds(
        detect=round(max(t_detected - t_fault, 0.0), 3),
        relaunch=round(max(restore_start - t_detected, 0.0), 3),
        restore=round(restore_s, 3),
        compile=round(float(compiled.get("seconds") or 0.0), 3),
        first_step=round(max(resumed_at - float(compiled.get("time") or resumed_at) - step_s, 0.0), 3),
        replay=round(steps_lost * step_s, 3),
    )
    return RecoveryCost(
        resume_step=None if resume_step is None else int(resume_step),
        steps_lost=steps_lost,
        lost_s=lost,
        tier=restore.get("tier"),
        compile_cached=compiled.get("cache_hit"),
    )
