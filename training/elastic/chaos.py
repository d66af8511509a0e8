"""Fault injection: each fault of ``training.faults`` fired at the step its spec names, through its kind's hooks.

On the worker side (``WorkerChaos``), and the leader's record of what the job fired (``JobChaos``):
the worker faults a new round carries, and the leader-side faults (capacity) the leader fires itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from training.elastic.capacity import LocalCapacity
from training.elastic.wire import ReportType
from training.events import EventLog
from training.faults import ChaosError, Fault, parse_chaos

CAPACITY_SPACING_S = 2.0  # capacity faults due at once fire this far apart (the local pool looks every 0.2 s)


class WorkerChaos:
    """The faults one worker fires, each at the step its spec names.

    ``send`` reports a fault to the agent before it happens (the agent records
    it as a ``chaos`` event, so a resumed job does not fire it again, and
    carries out the host-level ones: preempt, kill_agent, freeze).
    """

    def __init__(
        self,
        specs: list[str],
        rank: int,
        send: Callable[..., None],
        local_dir: Path | None = None,
        settle_local: Callable[[], None] | None = None,
    ) -> None:
        self.faults = [parse_chaos(s) for s in specs]
        self.rank = rank
        self.send = send
        # ``damage_local``: this host's local tier, and a call that finishes its saves in flight and reports them.
        self.local_dir = local_dir
        self.settle_local = settle_local
        self.lr_factor = 1.0

    def fire(self, f: Fault, step: int, everyone: bool = False) -> None:
        self.send(
            ReportType.CHAOS,
            everyone=everyone,
            action=f.action,
            spec=f.spec,
            step=step,
            worker=self.rank,
            at=time.time(),
        )

    def before_step(self, step: int) -> None:
        """This worker's faults due at ``step`` (the call does not return for a process or host fault)."""
        for f in self.faults:
            if f.step == step and f.worker == self.rank:
                f.kind.before_step(f, self, step)

    def damage_local(self) -> None:
        """Cut the largest file of the newest local copy of this host to half its size (once it is described:
        the damage is what a later check must find, not part of what the manifest records)."""
        from training.checkpoint.local import finalised_steps, read_manifests

        if self.local_dir is None or self.settle_local is None:
            raise ChaosError("damage_local: the local checkpoint tier is off (local_checkpoint_every=0)")
        self.settle_local()
        newest_step = max(finalised_steps(self.local_dir), default=None)
        if newest_step is None:
            raise ChaosError("damage_local: this host has no local checkpoint yet")
        deadline = time.monotonic() + 30
        while (described := read_manifests(self.local_dir)).get(newest_step) is None:
            if time.monotonic() > deadline:
                raise ChaosError(f"damage_local: local step {newest_step} was never described by the agent")
            time.sleep(0.05)
        newest = described[newest_step]
        name = max(newest.files, key=lambda n: newest.files[n][0])
        path = Path(self.local_dir or ".") / str(newest.step) / name
        with open(path, "r+b") as f:
            f.truncate(newest.files[name][0] // 2)

    def learning_rate_scale(self, step: int) -> float:
        """1.0 normally; from an ``lr_spike`` step on its factor; NaN at a ``nan`` step."""
        scale = self.lr_factor
        for f in self.faults:
            if f.step == step:
                scale = f.kind.lr_scale(f, self, step, scale)
        return scale

    def corrupts(self, step: int) -> bool:
        """Should the parameters be overwritten with noise before the save of ``step``?"""
        due = [f for f in self.faults if f.kind.corrupts() and f.step == step]
        for f in due:
            self.fire(f, step)
        return bool(due)

    def after_save_started(self, step: int) -> None:
        """This worker's faults of ``step`` once its save has started (a kill during the save)."""
        for f in self.faults:
            if f.step == step and f.worker == self.rank:
                f.kind.after_save_started(f, self, step)


class JobChaos:
    """The faults a job has fired, as its leader keeps them (each one on record as a ``chaos`` event).

    A fault fired once is not fired again, by this leader or the next one, unless its spec repeats.
    """

    def __init__(
        self, specs: list[str], events: EventLog, emit: Callable[..., None], capacity: LocalCapacity | None
    ) -> None:
        self.specs = specs
        self.events = events
        self.emit = emit  # write an event now
        self.capacity = capacity
        self.fired = self._on_record()
        self._last_capacity: float | None = None  # seconds into the job the last one fired

    def _on_record(self) -> set[str]:
        return {str(e.get("spec")) for e in self.events.read(types=("chaos",))}

    def round_faults(self) -> list[str]:
        """The worker-side faults a new round carries: those not fired yet, and those that repeat."""
        faults = [parse_chaos(spec) for spec in self.specs]
        if any(f.kind.worker_side for f in faults):
            self.fired |= self._on_record()
        return [f.spec for f in faults if f.kind.worker_side and (f.repeats or f.spec not in self.fired)]

    def capacity_due(self, step: int | None, elapsed: float) -> None:
        """Fire the leader-side faults (``capacity``) due at rank 0's ``step``, ``elapsed`` seconds into the job.

        One at a time: several due at one look (the step seen jumped past them) fire
        :data:`CAPACITY_SPACING_S` apart, so the pool acts on each.
        """
        if self.capacity is None:
            return
        if self._last_capacity is not None and elapsed - self._last_capacity < CAPACITY_SPACING_S:
            return
        for spec in self.specs:
            f = parse_chaos(spec)
            if f.kind.worker_side or spec in self.fired or not f.kind.due(f, step, elapsed):
                continue
            self.fired.add(spec)
            self._last_capacity = elapsed
            f.kind.on_leader(f, self, step)
            return

    def set_capacity(self, fault: Fault, to: int, step: int | None) -> None:
        """The pool's capacity becomes ``to`` hosts: on record first, as the pool may take this very host at once,
        and the next leader must not fire the same fault again."""
        assert self.capacity is not None
        self.emit("chaos", action=fault.action, spec=fault.spec, to=to, step=step)
        self.capacity.set(to, reason=f"chaos {fault.spec}")
        self.emit("capacity", available=to, reason="chaos")
