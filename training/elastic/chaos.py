"""Fault injection: each fault of ``training.faults`` fired at the step its spec names.

On the worker side (``WorkerChaos``), and the leader's record of what the job fired (``JobChaos``):
the worker faults a new round carries, and the capacity faults the leader fires itself.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from training.elastic.capacity import LocalCapacity
from training.elastic.wire import ReportType
from training.events import EventLog
from training.faults import HOST_ACTIONS, STORAGE_ACTIONS, WORKER_SIDE, ChaosError, Fault, parse_chaos

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

    def _fire(self, f: Fault, step: int, everyone: bool = False) -> None:
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
        """Process and host faults due at ``step`` (this call does not return for them)."""
        for f in self.faults:
            if f.step != step or f.worker != self.rank:
                continue
            if f.action == "damage_local":
                self._damage_local()
            if f.action in ("crash", "damage_local"):
                self._fire(f, step, everyone=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if f.action in HOST_ACTIONS:
                self._fire(f, step, everyone=True)
                time.sleep(3600)  # the agent takes the host down (with this process)
            if f.action in STORAGE_ACTIONS:
                self._fire(f, step, everyone=True)  # the agent loses (or slows) its run root; this worker goes on
            if f.action == "preempt_notice":
                self._fire(f, step, everyone=True)
                # The platform's notice goes to the host's agent (a pod's first process), which passes it on.
                os.kill(int(os.environ.get("RTRAIN_AGENT_PID") or os.getppid()), signal.SIGTERM)

    def _damage_local(self) -> None:
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
            if f.step != step:
                continue
            if f.action == "lr_spike":
                self.lr_factor = scale = float(f.get("factor") or 1.0)
                self._fire(f, step)
            elif f.action == "nan":
                scale = float("nan")
                self._fire(f, step)
        return scale

    def corrupts(self, step: int) -> bool:
        """Should the parameters be overwritten with noise before the save of ``step``?"""
        due = [f for f in self.faults if f.action == "corrupt" and f.step == step]
        for f in due:
            self._fire(f, step)
        return bool(due)

    def after_save_started(self, step: int) -> None:
        for f in self.faults:
            if f.action == "kill_during_save" and f.step == step and f.worker == self.rank:
                self._fire(f, step, everyone=True)
                os.kill(os.getpid(), signal.SIGKILL)


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
        if any(parse_chaos(spec).action in WORKER_SIDE for spec in self.specs):
            self.fired |= self._on_record()
        return [
            spec
            for spec in self.specs
            if parse_chaos(spec).action in WORKER_SIDE and (parse_chaos(spec).repeats or spec not in self.fired)
        ]

    def capacity_due(self, step: int | None, elapsed: float) -> None:
        """Fire the ``capacity`` faults due at rank 0's ``step``, ``elapsed`` seconds into the job.

        One at a time: several due at one look (the step seen jumped past them) fire
        :data:`CAPACITY_SPACING_S` apart, so the pool acts on each.
        """
        if self.capacity is None:
            return
        if self._last_capacity is not None and elapsed - self._last_capacity < CAPACITY_SPACING_S:
            return
        for spec in self.specs:
            f = parse_chaos(spec)
            if f.action != "capacity" or spec in self.fired:
                continue
            after = f.get("after_s")
            due = (f.step is not None and step is not None and int(step) >= f.step) or (
                after is not None and elapsed >= float(after)
            )
            if due:
                self.fired.add(spec)
                self._last_capacity = elapsed
                to = int(f.get("to") or 0)
                # On record first: the pool may take this very host at once, and the next leader must not
                # fire the same fault again.
                self.emit("chaos", action="capacity", spec=spec, to=to, step=step)
                self.capacity.set(to, reason=f"chaos {spec}")
                self.emit("capacity", available=to, reason="chaos")
                return
