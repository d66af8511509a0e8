"""A host leaving its job on a preemption notice (SIGTERM, a pod being deleted), losing no step."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable

from training.elastic.capacity import LocalCapacity
from training.elastic.host.heartbeat import Heartbeat
from training.elastic.host.reports import ReportHandler
from training.elastic.host.supervisor import WorkerSupervisor
from training.elastic.rendezvous import Outcome

log = logging.getLogger("rtrain.agent")


class Departure:
    """One host's departure on a preemption notice: when it came, why, and the deadline; what the host does then.

    Its worker is told (it passes the notice to the whole group through the next step, and the group stops at
    that step boundary, commits it and ends the round); the host is marked leaving, so no new round counts on
    it; the agent goes once its worker has reported, or when ``grace_s`` is spent.  A leader keeps leading until
    the next round is open.
    """

    def __init__(
        self,
        signum: int,
        grace_s: float,
        *,
        host: str,
        heart: Heartbeat,
        capacity: LocalCapacity | None,
        workers: WorkerSupervisor,
        reports: ReportHandler,
        last_host_leaves: Callable[[], float],
    ) -> None:
        self.signal = signal.Signals(signum).name
        self.at = time.time()
        self.why = f"{self.signal} (preemption notice)"
        self.grace_s = grace_s
        self.deadline = self.at + grace_s
        self.host = host
        self.heart = heart
        self.capacity = capacity  # the local slice's pool, which the host leaves (None on GKE)
        self.workers = workers
        self.reports = reports
        self.last_host_leaves = last_host_leaves  # this host's leadership, when it leads: hosts left to lead?
        self.hand_over_s = 0.0  # leaving last, hosts to come back: how long the lease waits for them

    def begin(self) -> None:
        """The notice came: the host is marked leaving, leaves the pool, and its worker is told."""
        log.warning("[%s] %s: leaving within %.0fs", self.host, self.signal, self.grace_s)
        self.heart.update(state="leaving")
        if self.capacity is not None:
            with contextlib.suppress(Exception):
                self.capacity.leave(self.host, reason=f"host {self.host} got a preemption notice")
        self.workers.drop_standby()
        if not self.workers.notice():
            self.reports.emit_later(
                "preemption_notice", step=None, seconds=0.0, committed=False, reason="no worker was training"
            )

    def drained(self) -> bool:
        """May the agent go: its worker has ended and reported, and it leads nothing that needs it?"""
        if time.time() > self.deadline:
            w = self.workers.stop_worker()
            if w is not None:
                why = f"preemption notice: the grace period ({self.grace_s:.0f}s) ran out before the worker stopped"
                log.warning("[%s] %s", self.host, why)
                step = self.heart.record.step
                self.reports.report(w.round, w.rank, Outcome.FAILED, reason=why, step=step)
                self.reports.emit_later("preemption_notice", step=step, seconds=None, committed=False, reason=why)
            return True
        if self.workers.worker is not None:
            return False
        # A leaving leader: another agent of the job takes the lease when this one releases it
        # (and opens the next round); with no other host left, the job waits for its hosts or ends.
        self.hand_over_s = self.last_host_leaves()
        return True
