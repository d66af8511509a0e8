"""What the end of a round means for the job: the leader's verdict, and the records it makes.

The decisions are pure functions with typed results (who is blamed for a failure, what told the
group, where a guard rollback goes, what a notice cost).  ``RoundEnds`` reads what they need (the
round's reports, the ledger, the chaos events), writes what was decided (events, the resume
pointer, quarantine) and keeps the job's budgets (failures, guard rollbacks).  The leader applies
the verdict: a new round, a failure to settle, or the job's end.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from training.checkpoint.ledger import CheckpointRecord
from training.checkpoint.lifecycle import quarantine
from training.checkpoint.retention import USABLE_STATES
from training.elastic.codes import WorkerExit
from training.elastic.host.hostview import HostView
from training.elastic.host.rounds import LeaderRecords
from training.elastic.rendezvous import Outcome, RecoveryRecord, Report, Round
from training.elastic.wire import GuardReport
from training.faults import KINDS
from training.records import ResumeHow
from training.sections import CheckpointSection
from training.storage import NotFound

log = logging.getLogger("rtrain.leader")


@dataclass(frozen=True)
class Recovery:
    """What the next round recovers from (its ``recovered`` event): the cause, when it struck, what it cost."""

    cause: str
    kind: str  # failure | guard | notice
    fault_at: float | None
    detected_at: float
    steps_lost: int
    resume_step: int | None
    step_s: float  # rank 0's step time before it

    def as_dict(self) -> RecoveryRecord:
        return RecoveryRecord(
            cause=self.cause,
            kind=self.kind,
            fault_at=self.fault_at,
            detected_at=self.detected_at,
            steps_lost=self.steps_lost,
            resume_step=self.resume_step,
            step_s=self.step_s,
        )


@dataclass(frozen=True)
class PendingFailure:
    """Something broke a round; it is blamed and counted once the survivors have had time to show life."""

    round: int
    reports: list[Report]
    why: str  # the leader's own finding (a hang, a straggler), else ""
    detected_at: float
    lapsed: list[str]  # members whose heartbeat lapsed


@dataclass(frozen=True)
class NextRound:
    """Form a new round (``reason``); ``local_floor`` when the local copies saved until now are of another lineage."""

    reason: str
    recovery: Recovery | None = None
    local_floor: int | None = None


@dataclass(frozen=True)
class RoundFailed:
    """The round ended as a failure: settle, then blame and count it."""

    reports: list[Report]
    why: str = ""  # the leader's own finding, if it found the failure
    lapsed: list[str] = field(default_factory=list)  # members whose heartbeat lapsed


@dataclass(frozen=True)
class JobFails:
    """The job ends as failed, with ``reason``."""

    reason: str


Verdict = NextRound | RoundFailed | JobFails


@dataclass(frozen=True)
class GuardRollback:
    """The in-training guard's rollback: the pointer to ``target``, ``suspect`` steps quarantined."""

    step: int  # where the bad loss was seen
    reason: str
    target: int
    suspect: list[int]
    resume: ResumeHow


@dataclass(frozen=True)
class FailureRecord:
    """A failure as the ``failure`` event tells it."""

    reason: str
    blame: Report | None
    detected_by: str
    reached: int | None
    steps_lost: int


def detected_by_what(reports: list[Report], lapsed: list[str], ended: list[str]) -> str:
    """What told the group of a failure.

    The peer watch (a worker left because it saw another process go), a worker that failed on its
    own, the host watch (an agent's connection ended), a heartbeat that lapsed, or the leader's own
    checks (a hang, a straggler).
    """
    if any(r.peer_lost is not None for r in reports):
        return "peer watch"
    if reports:
        return "failed worker"
    if lapsed:
        return "host watch" if set(lapsed) <= set(ended) else "heartbeat timeout"
    return "leader"


def explain_failure(lost: list[str], ended: list[str], why: str, reports: list[Report]) -> tuple[str, Report | None]:
    """(the failure's reason, the worker report blamed for it, if one is).

    Lost hosts come first, then the leader's own finding; else a worker killed by a signal, then one
    that failed on its own, then a bystander (it left because a peer went first).
    """
    if lost:
        how = "agent gone" if len(ended) == len(lost) else "no heartbeat since the failure"
        return f"host {', '.join(lost)} lost ({how})", None
    if why:
        return why, None
    signalled = [r for r in reports if r.returncode is not None and r.returncode < 0]
    own = [r for r in reports if r.peer_lost is None]
    blame = (signalled or own or reports)[0] if reports else None
    if blame is None:
        return "the round failed", None
    return blame.reason + (f": {blame.error}" if blame.error else ""), blame


def decide_guard(
    g: GuardReport, states: Mapping[int, CheckpointRecord], guards: int, checkpoint: CheckpointSection
) -> GuardRollback | JobFails:
    """The guard's report -> a rollback to the newest good checkpoint before the bad loss, or the job's end.

    Never back to the step the round restored from when the bad loss came right after restoring it;
    ``guards`` counts this rollback too.
    """
    step, reason = int(g.get("step", -1)), str(g.get("reason", "bad loss"))
    restored = g.get("restored_from")
    good = sorted(s for s, r in states.items() if r["state"] in USABLE_STATES and s < step)
    suspect: list[int] = []
    if restored is not None and not g.get("committed_since_restore"):
        # The bad loss came right after restoring that step: never roll back to it again.
        suspect = [s for s in good if s >= int(restored)]
        good = [s for s in good if s < int(restored)]
    if guards > checkpoint.max_guard_rollbacks or not good:
        if guards > checkpoint.max_guard_rollbacks:
            why = f"{guards - 1} rollback(s) did not help (max_guard_rollbacks={checkpoint.max_guard_rollbacks})"
        elif suspect:
            why = f"no checkpoint before step {suspect[0]}, which gave this loss right after it was restored"
        else:
            why = "no committed checkpoint before it to roll back to"
        return JobFails(f"in-training guard: {reason} at step {step} (metric {g.get('metric', 'loss')}); {why}")
    how = ResumeHow(lr_scale=checkpoint.rollback_lr_scale)
    if checkpoint.rollback_skip_data and g.get("next_batch") is not None:
        how["skip_to_batch"] = int(g["next_batch"])
    return GuardRollback(step=step, reason=reason, target=good[-1], suspect=suspect, resume=how)


@dataclass(frozen=True)
class NoticeStop:
    """The group stopped at ``step`` for a preemption notice to ``hosts``, and committed it."""

    hosts: str
    step: int | None
    recovery: Recovery

    @property
    def next_round(self) -> NextRound:
        return NextRound(f"preemption notice: host {self.hosts} left at step {self.step}", self.recovery)


def decide_notice(reps: list[Report], step_s: float, now: float) -> NoticeStop:
    """The group stopped at a step boundary for a preemption notice, that step committed: go on without the host."""
    told = [r for r in reps if (r.notice or {}).get("noticed")]
    notices = [r.notice or {} for r in reps]
    step = max(int(n.get("step") or 0) for n in notices) if notices else None
    hosts = ", ".join(sorted(r.host for r in told)) or "?"
    at = [float(a) for n in notices if (a := n.get("notice_at"))]
    done = [float(d) for n in notices if (d := n.get("committed_at"))]
    recovery = Recovery(
        cause=f"preemption notice to host {hosts}",
        kind="notice",
        fault_at=min(at) if at else None,
        detected_at=max(done) if done else now,
        steps_lost=0,
        resume_step=step,
        step_s=step_s,
    )
    return NoticeStop(hosts, step, recovery)


def judge_failure(
    f: PendingFailure,
    reports: list[Report],
    lost: list[str],
    ended: list[str],
    reached: int | None,
    resume_step: int | None,
) -> FailureRecord:
    """The failure's explanation: its reason, the report blamed, what detected it, the steps it loses."""
    reason, blame = explain_failure(lost, ended, f.why, reports)
    steps_lost = max(reached - (resume_step or 0), 0) if reached is not None else 0
    return FailureRecord(reason, blame, detected_by_what(reports, f.lapsed, ended), reached, steps_lost)


class RoundEnds:
    """The leader's reading of a round's end: the verdict, its records, and the job's failure and rollback budgets."""

    def __init__(self, rec: LeaderRecords, prev: Round | None) -> None:
        self.checkpoint = rec.cfg.checkpoint  # the rollback guard's keys
        self.elastic = rec.cfg.elastic  # the failure budget
        self.store = rec.store
        self.ledger = rec.ledger
        self.rdv = rec.rdv
        self.events = rec.events  # read: the chaos events of a round
        self.host = rec.host
        self.emit = rec.emit
        self.fence = rec.fence
        # The budgets spent so far (a leader that takes over: as the newest round says).
        self.failures = prev.failures if prev is not None else 0
        self.guards = prev.guards if prev is not None else 0

    def verdict(self, rnd: Round, reps: dict[str, Report], step_s: float) -> Verdict:
        """Every member ended the round, not all of them finished: what follows."""
        outcomes = {r.outcome for r in reps.values()}
        if Outcome.CORRUPT in outcomes:
            return self._corrupt(
                next((r for r in reps.values() if r.outcome == Outcome.CORRUPT and r.corrupt), None), rnd
            )
        if Outcome.FAILED in outcomes:
            return RoundFailed([r for r in reps.values() if r.outcome == Outcome.FAILED])
        if Outcome.GUARD in outcomes:
            return self._guard(next(r for r in reps.values() if r.outcome == Outcome.GUARD), rnd, step_s)
        if Outcome.NOTICE in outcomes:
            notice = decide_notice([r for r in reps.values() if r.outcome == Outcome.NOTICE], step_s, time.time())
            log.warning(
                "[%s] preemption notice to %s: committed step %s, going on without it",
                self.host,
                notice.hosts,
                notice.step,
            )
            return notice.next_round
        return NextRound("resize: hosts came back")  # every member stopped at a checkpoint to grow the group

    def _guard(self, rep: Report, rnd: Round, step_s: float) -> NextRound | JobFails:
        g = rep.guard or {}
        states = self.ledger.states()  # read before counting: a tick the store failed comes back here
        self.guards += 1
        d = decide_guard(g, states, self.guards, self.checkpoint)
        if isinstance(d, JobFails):
            return d
        self.fence()
        for s in d.suspect:
            quarantine(self.store, self.ledger, s, f"in-training guard: {d.reason} right after restoring step {s}")
        self.ledger.set_pointer(d.target, f"guard: {d.reason} at step {d.step}", resume=d.resume)
        recovery = Recovery(
            cause=f"guard: {d.reason} at step {d.step}",
            kind="guard",
            fault_at=float(g.get("time") or time.time()),
            detected_at=time.time(),
            steps_lost=max(d.step - d.target, 0),
            resume_step=d.target,
            step_s=step_s,
        )
        self.emit(
            "rollback",
            from_step=d.step,
            to_step=d.target,
            reason=f"guard: {d.reason}",
            kind="in-job",
            resume=d.resume,
            attempt_no=self.guards,
            quarantined=d.suspect,
            round=rnd.round,
        )
        # Local copies saved until now are of the rolled-back lineage.
        return NextRound(f"guard rollback to step {d.target}", recovery, local_floor=rnd.round + 1)

    def _corrupt(self, rep: Report | None, rnd: Round) -> NextRound | RoundFailed:
        info = (rep.corrupt if rep is not None else None) or {}
        step = info.get("step")
        if step is None:
            return RoundFailed([rep] if rep else [], "a restore failed")
        self.fence()
        reason = str(info.get("reason") or "failed its integrity check")
        try:
            where = quarantine(self.store, self.ledger, int(step), reason, state="corrupt")
        except (NotFound, OSError):
            self.ledger.record(int(step), "corrupt", reason=reason)
            where = ""
        self.emit("checkpoint_corrupt", step=int(step), reason=reason, location=where, round=rnd.round)
        log.warning("[%s] checkpoint %s is corrupt (%s); resuming from an older one", self.host, step, reason)
        return NextRound(f"checkpoint {step} corrupt")

    # --- failures -------------------------------------------------------------------------------

    def failure(
        self,
        f: PendingFailure,
        rnd: Round,
        lost: list[str],
        view: HostView,
        *,
        resume_step: int | None,
        status_step: int | None,
        step_s: float,
    ) -> NextRound | JobFails:
        """Record the failure (its events) and count it; ``status_step``: the step rank 0 last beat with."""
        ended = [h for h in lost if view.known_gone(h)]  # the rest did not beat since the failure
        reports = self._failed_reports(list(f.reports), rnd)
        fault_at = next((r.fault_at for r in reports if r.fault_at), None) or self._fault_time(rnd)
        reached = self._reached(rnd, status_step)  # the store is read: what follows is recorded once
        for h in lost:
            self.emit("host_lost", host=h, reason="agent gone" if h in ended else "no heartbeat", round=rnd.round)
        rec = judge_failure(f, reports, lost, ended, reached, resume_step)
        self.failures += 1
        lasting = lasting_storage_error(reports, self.store.uri)
        if lasting:
            # Another round would meet the same storage again (a full disk, a read-only root): end the job now.
            return JobFails(f"{lasting}: {rec.reason}")
        own = next((r for r in reports if r.returncode == WorkerExit.TASK), None)
        if own is not None:
            # The task's own code raised (its one line names the task, the method and the error): another round
            # would run the same code again.  Its traceback is in the worker's log.
            return JobFails(f"{own.error} (worker {own.rank} on host {own.host}; traceback in {own.log})")
        recovery = Recovery(
            cause=rec.reason,
            kind="failure",
            fault_at=fault_at,
            detected_at=f.detected_at,
            steps_lost=rec.steps_lost,
            resume_step=resume_step,
            step_s=step_s,
        )
        blame = rec.blame
        self.emit(
            "failure",
            attempt=rnd.round,
            round=rnd.round,
            reason=rec.reason,
            steps_lost=rec.steps_lost,
            reached_step=reached,
            resume_step=resume_step,
            worker=blame.rank if blame is not None else (rnd.rank(lost[0]) if lost else None),
            hosts=lost or ([blame.host] if blame is not None else []),
            returncode=blame.returncode if blame is not None else None,
            error=blame.error if blame is not None else "",
            log=blame.log if blame is not None else "",
            fault_at=fault_at,
            detected_at=f.detected_at,
            detect_s=(f.detected_at - fault_at) if fault_at else None,
            detected_by=rec.detected_by,
            failures=self.failures,
        )
        log.warning("[%s] failure %d/%d: %s", self.host, self.failures, self.elastic.max_failures, rec.reason)
        if self.failures > self.elastic.max_failures:
            return JobFails(
                f"failure budget spent: {self.failures} failures > max_failures={self.elastic.max_failures}; "
                f"last: {rec.reason}"
            )
        return NextRound("recovery", recovery)

    def _failed_reports(self, alarm: list[Report], rnd: Round) -> list[Report]:
        """Every failed report of the round by now, not only those that raised the alarm.

        The peer watch makes the other processes leave as soon as one fails, and their reports can come first.
        """
        try:
            later = [r for r in self.rdv.reports(rnd.round).values() if r.outcome == Outcome.FAILED]
        except Exception as e:  # noqa: BLE001 - blame what raised the alarm
            log.warning("[%s] could not read round %d's reports: %s", self.host, rnd.round, e)
            later = []
        return alarm + [r for r in later if r.host not in {x.host for x in alarm}]

    def _fault_time(self, rnd: Round) -> float | None:
        """When chaos struck in this round (its event, written before the fault), if it did."""
        times = [
            float(e.get("at") or e["time"])
            for e in self.events.read(types=("chaos",))
            if e.get("attempt") == rnd.round and (kind := KINDS.get(str(e.get("action")))) and kind.worker_side
        ]
        return max(times) if times else None

    def _reached(self, rnd: Round, status_step: int | None) -> int | None:
        """The furthest step the members of ``rnd`` trained to (their reports, else rank 0's heartbeat)."""
        steps = [int(r.step) for r in self.rdv.reports(rnd.round).values() if r.step is not None]
        if status_step is not None:
            steps.append(int(status_step))
        return max(steps) if steps else None


# Storage errors another round would meet again: a worker reporting one (a save that failed) ends the job at once.
LASTING_STORAGE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def lasting_storage_error(reports: list[Report], uri: str) -> str:
    """The storage error the failed workers name that another round would meet again ('' for none): the job's end."""
    for code in LASTING_STORAGE_ERRORS:
        said = os.strerror(code)
        if any(said in f"{r.reason} {r.error}" for r in reports):
            head = f"no space left on {uri}" if code == errno.ENOSPC else f"the run root {uri} refuses writes"
            return f"{head} ({said})"
    return ""
