"""The rounds a leader writes to the rendezvous: each new round with its launch events, and the stop round."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from training.checkpoint.ledger import Ledger
from training.checkpoint.lock import LockLost
from training.config import Config
from training.elastic.rendezvous import RecoveryRecord, Rendezvous, ResumeFrom, Round
from training.events import EventLog, RunState
from training.layout import CONTROL
from training.mesh import MeshPlan, plan_mesh
from training.storage import AlreadyExists, Store

log = logging.getLogger("rtrain.leader")

KEEP_ROUNDS = 20  # rounds (and their reports) kept in the rendezvous; the events keep the history


@dataclass(frozen=True)
class LeaderRecords:
    """The run's records a leader's parts read and write, each write under its lease (``fence``)."""

    cfg: Config
    store: Store
    rdv: Rendezvous
    ledger: Ledger
    events: EventLog
    job: str
    host: str  # the leader's
    emit: Callable[..., None]  # write an event now, naming the leader's host
    fence: Callable[[], None]  # raises unless this leader still holds the lease


@dataclass(frozen=True)
class Carried:
    """What a round carries from the job so far: the budgets spent, the local copies' lineage, what it recovers from."""

    failures: int
    guards: int
    local_floor: int = 0
    recovery: RecoveryRecord = field(default_factory=lambda: RecoveryRecord())


class RoundWriter:
    """Writes the job's rounds, each under the lease (``fence``), numbered after the one before."""

    def __init__(
        self, rec: LeaderRecords, *, gen: Callable[[], int], faults: Callable[[], list[str]], prev: Round | None
    ) -> None:
        self.placement = rec.cfg.placement  # a round's mesh is planned on it
        self.rdv = rec.rdv
        self.store = rec.store
        self.job = rec.job
        self.host = rec.host
        self.emit = rec.emit
        self.fence = rec.fence
        self.gen = gen  # the lease generation held
        self.faults = faults  # the worker faults a new round carries
        self.prev_plan: MeshPlan | None = plan_mesh(self.placement, prev.workers) if prev is not None else None
        self.number = 0  # the number the newest round opened was given (the rendezvous may have written it later)

    def _number(self, prev: Round | None) -> int:
        return (prev.round + 1) if prev else self.rdv.next_round_number()

    def open(
        self,
        prev: Round | None,
        members: list[str],
        coordinator: str,
        reason: str,
        resume: ResumeFrom,
        carried: Carried,
    ) -> tuple[Round, MeshPlan]:
        """Open the next round on ``members`` (``coordinator``: rank 0's address); the round as written, its mesh."""
        plan = plan_mesh(self.placement, len(members))
        faults = self.faults()
        number = self._number(prev)
        rnd = Round(
            round=number,
            job=self.job,
            gen=self.gen(),
            leader=self.host,
            members=members,
            mesh=plan.shape,
            coordinator=coordinator,
            resume=resume,
            faults=faults,
            reason=reason,
            failures=carried.failures,
            guards=carried.guards,
            local_floor=carried.local_floor,
            recovery=carried.recovery,
        )
        self.fence()
        self._forget_requests()
        try:
            rnd = self.rdv.open_round(rnd)
        except AlreadyExists:
            raise LockLost(f"another leader of job {self.job} opened round {number}") from None
        prev_plan = self.prev_plan
        if prev_plan is not None and (prev_plan.workers, prev_plan.shape) != (plan.workers, plan.shape):
            self.emit(
                "resize",
                old_workers=prev_plan.workers,
                new_workers=plan.workers,
                old_mesh=prev_plan.shape,
                new_mesh=plan.shape,
                round=rnd.round,
            )
        self.emit(
            "launch",
            attempt=rnd.round,
            round=rnd.round,
            workers=plan.workers,
            mesh=plan.shape,
            members=members,
            resume=rnd.resume.text(),
            reason=reason,
        )
        log.warning("[%s] round %d: %s on %s (%s)", self.host, rnd.round, plan.shape, members, reason)
        self.prev_plan = plan
        self.number = number
        return rnd, plan

    def _forget_requests(self) -> None:
        """Drop a request made of the rounds before (stop at a checkpoint); a person's stop of the job is elsewhere."""
        self.store.delete(CONTROL)

    def forget_old(self) -> None:
        """Drop the rounds (and their reports) older than the last KEEP_ROUNDS before the one just opened."""
        if self.number > KEEP_ROUNDS:
            self.rdv.forget_rounds_before(self.number - KEEP_ROUNDS)

    def stop(self, prev: Round | None, state: RunState, reason: str, carried: Carried) -> Round:
        """Write the job's stop round; the one already there when an earlier try of this leader wrote it."""
        stop = Round(
            round=self._number(prev),
            job=self.job,
            gen=self.gen(),
            leader=self.host,
            action="stop",
            final=state.value,
            reason=reason,
            failures=carried.failures,
            guards=carried.guards,
        )
        try:
            self.rdv.open_round(stop)
        except AlreadyExists:  # ours, written by a try that seemed to fail; else another leader of the job
            other = self.rdv.round(stop.round)
            if other is None or other.action != "stop" or other.job != self.job or other.leader != self.host:
                raise LockLost(f"round {stop.round} of job {self.job} was written by another leader") from None
            return other
        return stop
