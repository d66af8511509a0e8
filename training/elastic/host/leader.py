"""The leader of a job: the host agent that holds the run lock's lease, and decides what happens next.

A state machine driven by the rendezvous (heartbeats, reports) and the run root (ledger, events):

==========  ========================================================================
``gather``  the first round: wait up to ``join_timeout_s`` for the hosts it expects
``form``    a round is due: let the last members show life (a settle: 3 heartbeats
            or half the heartbeat timeout, the longer), then choose the members
``wait``    fewer hosts than ``min_workers``: wait up to ``capacity_timeout_s``; once
            enough beat, up to ``join_timeout_s`` more for all the capacity says came back
``running`` a round trains: watch its reports and its members' heartbeats
``done``    the job ended; the stop round is written
==========  ========================================================================

A round ends when every member finished (the job is done), stopped at a checkpoint the leader
asked for (a new, larger round), tripped the guard (back to the newest good checkpoint, never the
one that gave the bad loss; bad batches skipped; ``max_guard_rollbacks``), found a checkpoint
corrupt (quarantined; resume from the next), or failed or let its heartbeat lapse.  Only the last
is a failure (``max_failures``; re-formed on the hosts that showed life since), not a membership
change.  The leader alone writes ``status.json`` and the lifecycle events, each fenced by the lease.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from training.cadence import Cadence
from training.checkpoint.ledger import Ledger
from training.checkpoint.lock import LeaseKeeper, LockLost, RunLock
from training.config import Config
from training.elastic.capacity import LocalCapacity
from training.elastic.chaos import JobChaos
from training.elastic.host.hostview import HostView
from training.elastic.host.hostwatch import HostWatch
from training.elastic.host.job_end import JobEnd
from training.elastic.host.jobstatus import JobStatus, Phase, inherited_phase
from training.elastic.host.membership import choose_members, largest_round, resume_for
from training.elastic.host.reform import Reform
from training.elastic.host.round_end import JobFails, RoundEnds, RoundFailed, Verdict
from training.elastic.host.rounds import LeaderRecords, RoundWriter
from training.elastic.host.roundwatch import RoundWatch
from training.elastic.rendezvous import Outcome, Rendezvous, Report, ResumeFrom, Round
from training.elastic.status import stop_asked
from training.events import EventLog, RunState
from training.storage import Store

log = logging.getLogger("rtrain.leader")


class LeaderHost(Protocol):
    """What a leader uses of the host agent it runs in: the run's records, the lease, the capacity, the events."""

    run_uri: str
    job: str
    host: str
    cfg: Config
    store: Store
    rdv: Rendezvous
    ledger: Ledger
    events: EventLog
    lock: RunLock
    keeper: LeaseKeeper | None
    capacity: LocalCapacity | None
    host_watch: HostWatch  # the agent's connections to other agents (they survive a change of leader)
    cadence: Cadence  # how often the control plane looks and writes
    store_failure: str  # why the run root refuses writes for good, once seen ("" until then)

    def emit(self, type_: str, **fields: Any) -> None:
        """Write an event now, naming this host."""

    def stop_worker_at_step(self, round_: int) -> bool:
        """Tell this host's worker of ``round_`` to stop its group at the next step and commit it (a notice for a
        person's stop); False when this host has none."""


class PersonStop:
    """A person's stop (``rtrain stop``, a cancel, a teardown) as the leader carries it out.

    A round that trains stops at its next step and commits it, as for a preemption notice: the leader's own
    worker is told, and the notice reaches the whole group through that step; the round's reports then end
    the job.  With no worker of the round on the leader's host, or past ``grace_s``, the job ends at once.
    """

    def __init__(self, agent: LeaderHost, grace_s: float) -> None:
        self.agent = agent
        self.grace_s = grace_s
        self.reason = ""
        self.deadline: float | None = None  # while the round stops at a step

    def now(self, reason: str, rnd: Round | None, running: bool) -> str:
        """The reason to end the job with now; '' while the running round stops at a step."""
        if self.deadline is None and running and rnd is not None and self.agent.stop_worker_at_step(rnd.round):
            self.reason, self.deadline = reason, time.time() + self.grace_s
            log.warning("[%s] stopping the job at its next step: %s", self.agent.host, reason)
            return ""
        if self.deadline is None:
            return reason
        if time.time() < self.deadline:
            return ""
        return f"{reason} (the round did not stop at a step within {self.grace_s:.0f}s)"


def stopped_step(seen: dict[str, Report] | RoundFailed) -> int | None:
    """The step a round that stopped for a notice committed (None: it failed instead)."""
    reps = [] if isinstance(seen, RoundFailed) else list(seen.values())
    steps = [int(r.notice["step"]) for r in reps if r.notice and r.notice.get("step") is not None]
    return max(steps) if steps else None


class Leader:
    """The job's decisions, taken by the one host agent that holds the run's lease: the round state machine.

    Its parts: the host view, the round writer, the round watch, the round's end (verdicts and budgets),
    what the next round is formed from, the job's status, its end and the chaos it fired.
    """

    def __init__(self, agent: LeaderHost) -> None:
        self.agent = agent
        self.cfg = agent.cfg
        self.store = agent.store
        self.round: Round | None = agent.rdv.newest_round(agent.job)
        rec = LeaderRecords(
            self.cfg, self.store, agent.rdv, agent.ledger, agent.events, agent.job, agent.host, agent.emit, self._fence
        )
        self.view = HostView(self.cfg.elastic, agent.rdv, agent.job, agent.host, agent.host_watch)
        self.status = JobStatus(
            self.store,
            agent.cadence,
            self.round,
            run_uri=agent.run_uri,
            job=agent.job,
            leader=agent.host,
            steps=self.cfg.optimizer.steps,
        )
        self.chaos = JobChaos(self.cfg.elastic.chaos, agent.events, agent.emit, agent.capacity)
        self.rounds = RoundWriter(
            rec, gen=lambda: int(agent.lock.gen or 0), faults=self.chaos.round_faults, prev=self.round
        )
        self.watch = RoundWatch(rec, self.view, self.status)
        self.ends = RoundEnds(rec, self.round)
        self.reform = Reform(self.cfg.elastic, self.view, self.ends, self.status, self.round)
        self.end = JobEnd(rec, self.status, self.rounds, self.ends, self._ended)
        self.phase, self.t_phase = inherited_phase(self.round, self.status.waiting_since, time.time())
        if self.phase == Phase.WAIT:
            self.status.fields["waiting_since"] = self.t_phase
        self._enough_at: float | None = None  # waiting for capacity: since a round could form with fewer hosts
        # a person's stop: at the next step, committed
        self.stop = PersonStop(agent, self.cfg.checkpoint.preemption_grace_s)
        self.cadence = agent.cadence
        self._control_at = 0.0
        self.agent.emit(
            "leader",
            host=agent.host,
            job=agent.job,
            gen=agent.lock.gen,
            round=self.round.round if self.round else None,
            reason="took over a running job" if self.round else "the job's first leader",
        )
        self._write_status(force=True)

    # --- the loop -------------------------------------------------------------------------------

    def tick(self) -> None:
        self._fence()
        if self.agent.store_failure and self.phase != Phase.DONE:
            self._fail(f"{self.agent.store_failure}: the job cannot record its progress")
            return
        now = time.time()
        # A large job's hosts are read less often while it trains; a round to form is read at once.
        steady = self.phase == Phase.RUNNING and self.reform.settle is None
        scan_s = self.cadence.hosts_read_s if steady else min(0.25, self.cadence.hosts_read_s)
        if now - self.view.read_at >= scan_s:
            self.view.read(now)
        if now - self._control_at >= self.cadence.control_s:
            self._control_at = now
            self._control()
        self.chaos.capacity_due(self.status.step, now - self.status.started_at)
        {
            Phase.GATHER: self._gather,
            Phase.FORM: self._form,
            Phase.WAIT: self._wait,
            Phase.RUNNING: self._running,
            Phase.DONE: self._done,
        }[self.phase](now)
        self._write_status()

    def _fence(self) -> None:
        keeper = self.agent.keeper
        if keeper is None:
            raise LockLost("no lease keeper")
        keeper.check()

    def _set_phase(self, phase: Phase) -> None:
        if phase != self.phase:
            self.phase = phase
            self.t_phase = time.time()
            self._write_status(force=True)

    # --- phases ---------------------------------------------------------------------------------

    def _gather(self, now: float) -> None:
        cap = self.agent.capacity
        want = largest_round(self.cfg, cap.available() if cap is not None else None)
        members = choose_members(self.cfg, self.view.hosts, self.view.fresh())
        if members and (len(members) >= want or now - self.t_phase >= self.cfg.elastic.join_timeout_s):
            self._open(members, "start")
        elif now - self.t_phase >= self.cfg.elastic.join_timeout_s:
            self._start_waiting(now)

    def _form(self, now: float) -> None:
        if self.reform.settling(now):
            return  # let the members of the failed round show they are alive
        lost = self.reform.lost()
        alive = self.view.fresh() - set(lost)
        members = choose_members(self.cfg, self.view.hosts, alive, prefer=self.reform.members)
        resume, resume_step = self._resume_for(members)
        fails = self.reform.count(self.round, lost, resume_step)  # a failure that waited: blamed and counted
        if fails is not None:
            self._fail(fails.reason)
        elif members is None:
            self._start_waiting(now)
        else:
            self._open(members, self.reform.reason, resume)

    def _resume_for(self, members: list[str] | None) -> tuple[ResumeFrom, int | None]:
        """The next round's ``resume`` (local candidates, else ``latest``) and the step it will start from."""
        floor = self.reform.local_floor
        return resume_for(self.cfg.checkpoint, self.agent.ledger.states(), self.view.hosts, members, floor)

    def _start_waiting(self, now: float) -> None:
        n = len(self.view.fresh())
        self.agent.emit("waiting_for_capacity", available=n, min_workers=self.cfg.elastic.min_workers)
        self.status.waiting(n, now)
        self._enough_at = None
        self._set_phase(Phase.WAIT)

    def _wait(self, now: float) -> None:
        members = choose_members(self.cfg, self.view.hosts, self.view.fresh(), prefer=self.reform.members)
        cap = self.agent.capacity.available() if members is not None and self.agent.capacity is not None else 0
        if members is not None and cap and len(members) < largest_round(self.cfg, cap):  # cap 0: not known
            # The capacity came back larger than the hosts beating yet: one round with them all (as the
            # first round waits), rather than a smaller one and a resize at once.
            self._enough_at = self._enough_at or now
            if now - self._enough_at < self.cfg.elastic.join_timeout_s:
                return
        if members is not None:
            self.agent.emit("capacity", available=len(self.view.fresh()))
            self._open(members, "capacity returned")
        elif now - self.t_phase >= self.cfg.elastic.capacity_timeout_s:
            self._fail(
                f"capacity stayed below min_workers={self.cfg.elastic.min_workers} for {self.cfg.elastic.capacity_timeout_s:.0f}s "
                f"(available: {len(self.view.fresh())} hosts)"
            )

    def _open(self, members: list[str], reason: str, resume: ResumeFrom | None = None) -> None:
        if self.round is None:
            resume = ResumeFrom(self.cfg.checkpoint.resume_from)
        elif resume is None:
            resume = self._resume_for(members)[0]
        coordinator = self.view.hosts[members[0]].coordinator
        rnd, plan = self.rounds.open(self.round, members, coordinator, reason, resume, self.reform.carried())
        self.round = rnd
        self.reform.opened(members)
        self.watch.rescale_asked = False
        self.status.opened(rnd, plan, time.time())
        self._set_phase(Phase.RUNNING)
        self._write_status(force=True)
        self.rounds.forget_old()

    def _running(self, now: float) -> None:
        rnd = self.round
        assert rnd is not None
        seen = self.watch.look(rnd, now)
        if self.stop.deadline is not None and seen is not None:  # the round stopped for a person's stop
            self.status.stopped_at(stopped_step(seen))
            self._fail(self.stop.reason, RunState.STOPPED)
        elif isinstance(seen, RoundFailed):
            self._failed(rnd, seen, now)
        elif seen is not None:
            self._round_over(rnd, seen)

    # --- a round's end --------------------------------------------------------------------------

    def _round_over(self, rnd: Round, reps: dict[str, Report]) -> None:
        if {r.outcome for r in reps.values()} == {Outcome.FINISHED}:
            self._finish()
        else:
            self._apply(rnd, self.ends.verdict(rnd, reps, self.status.step_s))

    def _apply(self, rnd: Round, verdict: Verdict) -> None:
        """Carry out what a round's end was judged to mean."""
        if isinstance(verdict, JobFails):
            self._fail(verdict.reason)
            return
        if isinstance(verdict, RoundFailed):
            self._failed(rnd, verdict, time.time())
            return
        self.reform.ended(rnd, verdict)
        self._set_phase(Phase.FORM)

    def _failed(self, rnd: Round, f: RoundFailed, now: float) -> None:
        """Something broke the round: settle (who is still alive?), then blame, count and re-form."""
        self.reform.failed(rnd, f, now)
        self.status.fields["progressing"] = False
        self._set_phase(Phase.FORM)

    # --- the end --------------------------------------------------------------------------------

    def _finish(self) -> None:
        self.view.read(time.time())  # the members' last word: the final step and its commit
        rank0 = self.view.hosts.get(self.round.members[0]) if self.round is not None else None
        self.round = self.end.finished(self.round, rank0)

    def wait_for_returning_hosts(self) -> float:
        """The last host leaves and the job's hosts come back by themselves (pods their Job makes again):
        the job waits for capacity.  Seconds of ``capacity_timeout_s`` left, for the lease handed to
        the job's next agents (the next reader records the job failed if none claims it by then)."""
        now = time.time()
        if self.phase != Phase.WAIT:
            self._start_waiting(now)
            self.t_phase = now
        self._write_status(force=True)
        return max(self.cfg.elastic.capacity_timeout_s - (now - self.t_phase), 1.0)

    def fail(self, reason: str) -> None:
        """End the job as failed with ``reason`` (the agent, when leading itself failed)."""
        if self.phase != Phase.DONE:
            self._fail(reason)

    def _fail(self, reason: str, state: RunState = RunState.FAILED) -> None:
        """End the job as failed, or as stopped at a person's request (``rtrain stop``, a cancel, a teardown)."""
        self.round = self.end.failed(self.round, reason, state)

    def _done(self, _now: float) -> None:
        """The job has ended: an end whose records a failing run root cut short is written again."""
        self.round = self.end.again(self.round)

    def _ended(self, state: RunState) -> None:
        """The job's end is decided (and fenced): the phase is done, and the final status written as ``state``."""
        self.phase = Phase.DONE
        self._write_status(force=True, state=state)

    # --- requests, status -----------------------------------------------------------------------

    def _control(self) -> None:
        reason = stop_asked(self.store) if self.phase != Phase.DONE else None
        if reason is not None and (why := self.stop.now(reason, self.round, self.phase == Phase.RUNNING)):
            self._fail(why, RunState.STOPPED)

    def _write_status(self, force: bool = False, state: RunState | None = None) -> None:
        if self.status.due(force):
            self._fence()
            self.status.write(self.phase, self.round, self.ends.failures, sorted(self.view.alive()), state)
