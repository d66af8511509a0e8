"""A running round as the leader watches it: its reports, its members' heartbeats, rank 0's progress, room to grow."""

from __future__ import annotations

import json
import logging

from training.elastic.host.hostview import HostView
from training.elastic.host.jobstatus import JobStatus
from training.elastic.host.membership import choose_members
from training.elastic.host.round_end import RoundFailed
from training.elastic.host.rounds import LeaderRecords
from training.elastic.rendezvous import Outcome, Report, Round
from training.layout import CONTROL
from training.sections import ElasticSection

log = logging.getLogger("rtrain.leader")


def round_broken(
    rnd: Round, reps: dict[str, Report], view: HostView, elastic: ElasticSection, now: float
) -> RoundFailed | None:
    """A round not every member has ended: has it failed (a worker, a lapsed heartbeat, a straggler)?"""
    failed = [r for r in reps.values() if r.outcome == Outcome.FAILED]
    lapsed = [
        h for h in rnd.members if h not in reps and (view.age(h) >= elastic.heartbeat_timeout_s or view.known_gone(h))
    ]
    if failed or lapsed:
        return RoundFailed(failed, lapsed=lapsed)
    if reps and now - min(r.time for r in reps.values()) > max(2 * elastic.heartbeat_timeout_s, 10.0):
        missing = sorted(set(rnd.members) - set(reps))
        return RoundFailed([], f"hosts {missing} did not end round {rnd.round} with the others")
    return None


def carried_reports(rnd: Round, view: HostView, reps: dict[str, Report]) -> dict[str, Report]:
    """The round's reports that members' agents could not write, as their heartbeats carry them."""
    out = {}
    for h in rnd.members:
        rec = view.hosts.get(h)
        if h in reps or rec is None or not rec.unreported:
            continue
        rep = Report.from_json(rec.unreported)
        if rep.round == rnd.round:
            out[h] = rep
    return out


class RoundWatch:
    """Watches the running round: has it ended, has it failed, has it stalled, could a larger one form?"""

    def __init__(self, rec: LeaderRecords, view: HostView, status: JobStatus) -> None:
        self.cfg = rec.cfg
        self.rdv = rec.rdv
        self.store = rec.store
        self.host = rec.host
        self.fence = rec.fence
        self.view = view  # the job's hosts as the leader last read them
        self.status = status  # follows rank 0's progress
        self.rescale_asked = False  # this round was asked to stop at its next checkpoint, to grow

    def look(self, rnd: Round, now: float) -> dict[str, Report] | RoundFailed | None:
        """Every member's report once all have ended; the failure, if the round failed; else None (it trains)."""
        reps = self.rdv.reports(rnd.round)
        reps.update(carried_reports(rnd, self.view, reps))
        if set(rnd.members) <= set(reps):
            return reps
        broken = round_broken(rnd, reps, self.view, self.cfg.elastic, now)
        if broken is not None:
            return broken
        self.status.follow(self.view.hosts.get(rnd.members[0]), rnd.round, now)
        if now - self.status.last_step_change > self.cfg.elastic.hang_timeout_s:
            return RoundFailed([], f"no progress for {self.cfg.elastic.hang_timeout_s:.0f}s (hang)")
        if not self.rescale_asked:
            self._grow(rnd)
        return None

    def _grow(self, rnd: Round) -> None:
        """Spares that beat now, members that still do: is a larger round possible?  Then stop at a checkpoint."""
        bigger = choose_members(self.cfg, self.view.hosts, self.view.fresh(), prefer=rnd.members)
        if bigger is not None and len(bigger) > rnd.workers:
            self.fence()
            self.store.put(CONTROL, json.dumps({"round": rnd.round, "action": "stop_at_checkpoint"}).encode())
            self.rescale_asked = True
            log.warning("[%s] %d hosts available: growing at the next checkpoint", self.host, len(bigger))
