"""What a leader forms the next round from: the last round's members, why it forms, what it recovers from, and a
failed round's settle (who shows life) before its failure is blamed and counted, once."""

from __future__ import annotations

from training.elastic.host.hostview import HostView, Settle
from training.elastic.host.jobstatus import JobStatus
from training.elastic.host.round_end import JobFails, NextRound, PendingFailure, Recovery, RoundEnds, RoundFailed
from training.elastic.host.rounds import Carried
from training.elastic.rendezvous import Round
from training.sections import ElasticSection


class Reform:
    """The job between one round and the next: set as a round ends, read as the next forms, cleared as it opens.

    A round that failed leaves a settle: its members have a while to show life; whoever did not is lost, and the
    failure is then blamed and counted (``RoundEnds.failure``).
    """

    def __init__(
        self, elastic: ElasticSection, view: HostView, ends: RoundEnds, status: JobStatus, prev: Round | None
    ) -> None:
        self.elastic = elastic  # its heartbeat_s and heartbeat_timeout_s: how long a settle lasts
        self.view = view
        self.ends = ends
        self.status = status
        self.members: list[str] = list(prev.members) if prev else []  # the last round's: preferred for the next
        self.reason = "recovery"  # why the next round forms
        self.settle: Settle | None = None  # since the round failed: who shows life
        self.failure: PendingFailure | None = None  # what went wrong, blamed once the settle is over
        # Local copies saved before this round number are of another lineage (a guard rollback since).
        self.local_floor = prev.local_floor if prev else 0
        self.recovery: Recovery | None = None  # what the next round recovers from (its `recovered` event)

    def ended(self, rnd: Round, verdict: NextRound) -> None:
        """``rnd`` ended, not as a failure: the next round forms on its members, for the verdict's reason."""
        if verdict.recovery is not None:
            self.recovery = verdict.recovery
        if verdict.local_floor is not None:
            self.local_floor = verdict.local_floor
        self.members = list(rnd.members)
        self.settle = self.failure = None
        self.reason = verdict.reason

    def failed(self, rnd: Round, f: RoundFailed, now: float) -> None:
        """Something broke ``rnd``: its members settle (who is still alive?) before the failure is blamed."""
        self.settle = self.view.settle(now, f.lapsed)
        self.failure = PendingFailure(round=rnd.round, reports=f.reports, why=f.why, detected_at=now, lapsed=f.lapsed)
        self.members = list(rnd.members)
        self.reason = "recovery"

    def settling(self, now: float) -> bool:
        """Do members of the failed round still have time to show they are alive?"""
        # A member that does not show life within the settle is lost.  Not just 3 heartbeats: a busy host
        # (its worker tearing down, the machine loaded) can miss a few beats and is not lost for that.
        # A member whose agent's connection ended is lost at once: no settle.
        settle_s = max(3 * self.elastic.heartbeat_s, self.elastic.heartbeat_timeout_s / 2)
        if self.settle is None:
            return False
        pending = self.view.unsettled(self.members, self.settle, settle_s)
        return bool(pending) and now - self.settle.at < self.elastic.heartbeat_timeout_s

    def lost(self) -> list[str]:
        """The last round's members that showed no life since the settle began (or its end), declared lost."""
        lost = self.view.lost_since(self.members, self.settle)
        self.view.declare_lost(lost)
        return lost

    def count(self, rnd: Round | None, lost: list[str], resume_step: int | None) -> JobFails | None:
        """Record the failure that waits (if one does), the settle over (who was lost); JobFails: the job fails."""
        if self.failure is None:
            return None
        assert rnd is not None
        step, step_s = self.status.step, self.status.step_s
        verdict = self.ends.failure(
            self.failure, rnd, lost, self.view, resume_step=resume_step, status_step=step, step_s=step_s
        )
        self.failure = None  # only once what the store says was read: a tick the store failed comes back here
        self.status.fields["failures"] = self.ends.failures
        if isinstance(verdict, JobFails):
            return verdict
        self.recovery = verdict.recovery
        return None

    def carried(self) -> Carried:
        """What the round that opens now carries: the budgets spent, the local copies' lineage, what it recovers from."""
        recovery = self.recovery.as_dict() if self.recovery is not None else {}
        return Carried(self.ends.failures, self.ends.guards, self.local_floor, recovery)

    def opened(self, members: list[str]) -> None:
        """A round opened on ``members``: nothing waits for the next."""
        self.members = list(members)
        self.settle = self.failure = self.recovery = None
