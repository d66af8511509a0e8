"""The leader of a job: the host agent that holds the run lock's lease.

Policy, separated from mechanism: the agent runs
processes and follows rounds; the leader decides *what happens next*, as an
explicit state machine driven by what the rendezvous shows (heartbeats,
reports) and what the run root holds (ledger, events):

==========  ===================================================================
``gather``  the job's first round: wait (``join_timeout_s``) for the hosts it expects
``form``    a new round is due: let the members of the last one show they are
            alive (a settle of 3 heartbeats or half the heartbeat timeout,
            whichever is longer), then choose the members
``wait``    fewer hosts than ``min_workers``: wait ``capacity_timeout_s``
``running`` a round trains: watch its reports and its members' heartbeats
``done``    the job ended; the stop round is written
==========  ===================================================================

What ends a round, and what follows (a membership change is not a failure):

* every member finished -> the job finished;
* every member stopped at a checkpoint because the leader asked (hosts came
  back) -> a new, larger round;
* the in-training guard -> the pointer goes back to the newest good checkpoint
  (never to the one the round restored from, when that one produced the bad
  loss), the bad batches are skipped, a new round (``max_guard_rollbacks``);
* a checkpoint that fails its integrity check -> marked corrupt, quarantined,
  and a new round resumes from the next newest one;
* a worker failed or a member's heartbeat lapsed -> a failure (``max_failures``);
  the new round is formed on the hosts that showed life since.

The leader is the single writer of ``status.json`` and of the job's lifecycle
events; every write is fenced by the lease (``LeaseKeeper.check``).
"""

from __future__ import annotations

import errno
import json
import logging
import time
from enum import StrEnum
from typing import Any, Protocol

from training.cadence import STATUS_S, Cadence
from training.checkpoint.ledger import Ledger
from training.checkpoint.lifecycle import quarantine
from training.checkpoint.lock import LeaseKeeper, LockLost, RunLock
from training.checkpoint.retention import USABLE_STATES
from training.config import Config
from training.elastic.capacity import LocalCapacity
from training.elastic.hostview import HostView
from training.elastic.hostwatch import HostWatch
from training.elastic.membership import choose_members
from training.elastic.rendezvous import Outcome, Rendezvous, Report, Round
from training.events import EventLog, RunState, read_status, write_status
from training.faults import WORKER_SIDE, parse_chaos
from training.layout import CONTROL, RDV_EVENT_RESERVE, RDV_RESERVE
from training.mesh import MeshPlan, feasible_sizes, plan_mesh
from training.storage import AlreadyExists, NotFound, Store

log = logging.getLogger("rtrain.leader")

KEEP_ROUNDS = 20  # rounds (and their reports) kept in the rendezvous; the events keep the history


class Phase(StrEnum):
    GATHER = "gather"
    FORM = "form"
    WAIT = "wait"
    RUNNING = "running"
    DONE = "done"


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


class Leader:
    """The job's decisions, taken by the one host agent that holds the run's lease."""

    def __init__(self, agent: LeaderHost) -> None:
        self.agent = agent
        self.cfg = agent.cfg
        self.rdv = agent.rdv
        self.store = agent.store
        self.ledger = agent.ledger
        self.job = agent.job
        now = time.time()
        self.view = HostView(self.cfg, self.rdv, self.job, agent.host, agent.host_watch)
        self.round: Round | None = self.rdv.newest_round(self.job)
        self.failures = self.round.failures if self.round else 0
        self.guards = self.round.guards if self.round else 0
        self.prev_plan: MeshPlan | None = plan_mesh(self.cfg, self.round.workers) if self.round else None
        self.prev_members: list[str] = list(self.round.members) if self.round else []
        self.fired = {str(e.get("spec")) for e in agent.events.read(types=("chaos",))}
        st = read_status(self.store) or {}
        mine = st.get("job") == self.job
        self.started_at = float(st.get("started_at", now)) if mine else now
        self.status: dict[str, Any] = {k: st[k] for k in ("step", "loss", "latest_committed") if mine and k in st}
        self.phase = Phase.GATHER
        self.t_phase = now
        if self.round is not None:
            self.phase = Phase.DONE if self.round.action == "stop" else Phase.RUNNING
            if self.phase == Phase.RUNNING and mine and st.get("state") == RunState.WAITING_FOR_CAPACITY.value:
                # The job was waiting for capacity (no host was left, the local slice held the run):
                # hosts are back; wait on from when the wait began, then form a round on them.
                self.phase = Phase.WAIT
                self.t_phase = float(st.get("waiting_since") or now)
                self.status["waiting_since"] = self.t_phase
        self.fail_at: float | None = None
        self.seq_at_fail: dict[str, int] = {}
        self.failure: dict[str, Any] | None = None  # what went wrong, blamed once the settle is over
        self.rescale_asked = False
        self._form_reason = "recovery"
        # Local copies saved before this round number are of another lineage (a guard rollback since).
        self.local_floor = self.round.local_floor if self.round else 0
        self.recovery: dict[str, Any] = {}  # what the next round recovers from (its `recovered` event)
        self.step_s = 0.0  # rank 0's latest step time
        self.last_step: int | None = None
        self.last_step_change = now
        self._status_at = 0.0
        self._status_step: Any = None  # the step status.json said when last written
        # status.json is one small object, rewritten whole: every STATUS_S, and sooner when the step moved,
        # so that it trails training by about a second (rank 0's heartbeat carries the step within the
        # cadence's step beat, the leader reads it within a host scan).
        self.cadence = agent.cadence
        self._control_at = 0.0
        # The job's end, once decided (a leader that takes over an ended job: the end its stop round says).
        self._ending: tuple[RunState, str] | None = None
        if self.round is not None and self.round.action == "stop" and self.round.final in {x.value for x in RunState}:
            self._ending = (RunState(self.round.final), self.round.reason)
            self.status["reason"] = self.round.reason
        self.agent.emit(
            "leader",
            host=agent.host,
            job=self.job,
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
        steady = self.phase == Phase.RUNNING and self.fail_at is None
        scan_s = self.cadence.hosts_read_s if steady else min(0.25, self.cadence.hosts_read_s)
        if now - self.view.read_at >= scan_s:
            self.view.read(now)
        if now - self._control_at >= self.cadence.control_s:
            self._control_at = now
            self._control()
        self._capacity_chaos(now)
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

    # --- hosts ----------------------------------------------------------------------------------

    # --- phases ---------------------------------------------------------------------------------

    def _expected_hosts(self) -> int:
        cap = self.agent.capacity.available() if self.agent.capacity is not None else self.cfg.max_workers
        return min(cap or self.cfg.max_workers, self.cfg.max_workers)

    def _gather(self, now: float) -> None:
        expected = self._expected_hosts()
        want = max([n for n in feasible_sizes(self.cfg) if n <= expected] or [0])
        members = choose_members(self.cfg, self.view.hosts, self.view.fresh())
        if members and (len(members) >= want or now - self.t_phase >= self.cfg.join_timeout_s):
            self._open(members, "start")
        elif now - self.t_phase >= self.cfg.join_timeout_s:
            self._start_waiting(now)

    def _form(self, now: float) -> None:
        # A member that does not show life within the settle is lost.  Not just 3 heartbeats: a busy host
        # (its worker tearing down, the machine loaded) can miss a few beats and is not lost for that.
        # A member whose agent's connection ended is lost at once: no settle.
        settle = max(3 * self.cfg.heartbeat_s, self.cfg.heartbeat_timeout_s / 2)
        if self.fail_at is not None:
            pending = [
                h
                for h in self.prev_members
                if not self.view.shown_life(h, self.seq_at_fail, self.fail_at)
                and self.view.age(h) < settle
                and not self.view.known_gone(h)
            ]
            if pending and now - self.fail_at < self.cfg.heartbeat_timeout_s:
                return  # let the members of the failed round show they are alive
        lost = [
            h
            for h in self.prev_members
            if self.fail_at is not None and not self.view.shown_life(h, self.seq_at_fail, self.fail_at)
        ]
        self.view.declare_lost(lost)
        alive = self.view.fresh() - set(lost)
        members = choose_members(self.cfg, self.view.hosts, alive, prefer=self.prev_members)
        resume, resume_step = self._resume_for(members)
        if self.failure is not None:
            if not self._record_failure(lost, resume_step):
                return
        if members is None:
            self._start_waiting(now)
        else:
            self._open(members, self._form_reason, resume)

    # --- where the next round resumes ------------------------------------------------------------

    def _newest_persistent(self) -> int | None:
        """The newest committed checkpoint the ledger holds usable (what ``resume=latest`` will pick)."""
        good = [s for s, r in self.ledger.states().items() if r.get("state") in USABLE_STATES]
        return max(good) if good else None

    def _local_candidates(self, members: list[str]) -> list[int]:
        """Steps every member holds a local copy of (of this lineage), newer than any persistent one."""
        if not self.cfg.local_checkpoint_every:
            return []
        common: set[int] | None = None
        for h in members:
            rec = self.view.hosts.get(h)
            held = {int(s) for s, r in (rec.local if rec is not None else []) if int(r) >= self.local_floor}
            common = held if common is None else common & held
        newest = self._newest_persistent()
        return sorted((s for s in common or set() if newest is None or s > newest), reverse=True)

    def _resume_for(self, members: list[str] | None) -> tuple[str, int | None]:
        """The next round's ``resume`` (local candidates, else ``latest``) and the step it will start from."""
        local = self._local_candidates(members) if members else []
        if local:
            return "local:" + ",".join(map(str, local)), local[0]
        return "latest", self._newest_persistent()

    def _reached(self, rnd: Round) -> int | None:
        """The furthest step the members of ``rnd`` trained to (their reports, else rank 0's heartbeat)."""
        steps = [int(r.step) for r in self.rdv.reports(rnd.round).values() if r.step is not None]
        if self.status.get("step") is not None:
            steps.append(int(self.status["step"]))
        return max(steps) if steps else None

    def _start_waiting(self, now: float) -> None:
        n = len(self.view.fresh())
        self.agent.emit("waiting_for_capacity", available=n, min_workers=self.cfg.min_workers)
        self.status["available"] = n
        self.status["waiting_since"] = now  # whoever holds the run next waits on from here
        self._set_phase(Phase.WAIT)

    def _wait(self, now: float) -> None:
        members = choose_members(self.cfg, self.view.hosts, self.view.fresh(), prefer=self.prev_members)
        if members is not None:
            self.agent.emit("capacity", available=len(self.view.fresh()))
            self._open(members, "capacity returned")
        elif now - self.t_phase >= self.cfg.capacity_timeout_s:
            self._fail(
                f"capacity stayed below min_workers={self.cfg.min_workers} for {self.cfg.capacity_timeout_s:.0f}s "
                f"(available: {len(self.view.fresh())} hosts)"
            )

    def _open(self, members: list[str], reason: str, resume: str | None = None) -> None:
        plan = plan_mesh(self.cfg, len(members))
        first = self.round is None
        if any(parse_chaos(spec).action in WORKER_SIDE for spec in self.cfg.chaos):
            self.fired |= {str(e.get("spec")) for e in self.agent.events.read(types=("chaos",))}
        number = (self.round.round + 1) if self.round else max([0, *self.rdv.round_numbers()]) + 1
        faults = [
            spec
            for spec in self.cfg.chaos
            if parse_chaos(spec).action in WORKER_SIDE and (parse_chaos(spec).repeats or spec not in self.fired)
        ]
        rnd = Round(
            round=number,
            job=self.job,
            gen=int(self.agent.lock.gen or 0),
            leader=self.agent.host,
            members=members,
            mesh=plan.shape,
            coordinator=self.view.hosts[members[0]].coordinator,
            resume=self.cfg.resume_from if first else (resume or self._resume_for(members)[0]),
            faults=faults,
            reason=reason,
            failures=self.failures,
            guards=self.guards,
            local_floor=self.local_floor,
            recovery=self.recovery,
        )
        self._fence()
        self.store.delete(CONTROL)
        try:
            rnd = self.rdv.open_round(rnd)
        except AlreadyExists:
            raise LockLost(f"another leader of job {self.job} opened round {number}") from None
        if self.prev_plan is not None and (self.prev_plan.workers, self.prev_plan.shape) != (plan.workers, plan.shape):
            self.agent.emit(
                "resize",
                old_workers=self.prev_plan.workers,
                new_workers=plan.workers,
                old_mesh=self.prev_plan.shape,
                new_mesh=plan.shape,
                round=rnd.round,
            )
        self.agent.emit(
            "launch",
            attempt=rnd.round,
            round=rnd.round,
            workers=plan.workers,
            mesh=plan.shape,
            members=members,
            resume=rnd.resume,
            reason=reason,
        )
        log.warning("[%s] round %d: %s on %s (%s)", self.agent.host, rnd.round, plan.shape, members, reason)
        self.round = rnd
        self.prev_plan = plan
        self.prev_members = list(members)
        self.fail_at = None
        self.failure = None
        self.recovery = {}
        self.rescale_asked = False
        self.last_step_change = time.time()
        self.status.update(workers=plan.workers, mesh=plan.shape, members=members, round=rnd.round)
        self.status.pop("available", None)
        self.status.pop("waiting_since", None)
        self._set_phase(Phase.RUNNING)
        self._write_status(force=True)
        if number > KEEP_ROUNDS:
            self.rdv.forget_rounds_before(number - KEEP_ROUNDS)

    def _running(self, now: float) -> None:
        rnd = self.round
        assert rnd is not None
        reps = self.rdv.reports(rnd.round)
        if set(rnd.members) <= set(reps):
            self._round_over(rnd, reps)
            return
        failed = [r for r in reps.values() if r.outcome == Outcome.FAILED]
        lapsed = [
            h
            for h in rnd.members
            if h not in reps and (self.view.age(h) >= self.cfg.heartbeat_timeout_s or self.view.known_gone(h))
        ]
        if failed or lapsed:
            self._failed(rnd, failed, lapsed, now)
            return
        if reps:
            first = min(r.time for r in reps.values())
            if now - first > max(2 * self.cfg.heartbeat_timeout_s, 10.0):
                missing = sorted(set(rnd.members) - set(reps))
                self._failed(rnd, [], [], now, f"hosts {missing} did not end round {rnd.round} with the others")
                return
        rank0 = self.view.hosts.get(rnd.members[0])
        if rank0 is not None and rank0.round == rnd.round and rank0.step is not None:
            if rank0.step != self.last_step:
                self.last_step, self.last_step_change = rank0.step, now
            self.status.update(step=rank0.step, loss=rank0.loss, tokens_per_s=rank0.tokens_per_s)
            self.status["progressing"] = True
            if rank0.step_time:
                self.step_s = float(rank0.step_time)
        if rank0 is not None and rank0.committed is not None:
            self.status["latest_committed"] = max(rank0.committed, int(self.status.get("latest_committed") or 0))
        if now - self.last_step_change > self.cfg.hang_timeout_s:
            self._failed(rnd, [], [], now, f"no progress for {self.cfg.hang_timeout_s:.0f}s (hang)")
            return
        if not self.rescale_asked:
            # Spares that beat now, members that still do: is a larger round possible?
            bigger = choose_members(self.cfg, self.view.hosts, self.view.fresh(), prefer=rnd.members)
            if bigger is not None and len(bigger) > rnd.workers:
                self._fence()
                self.store.put(CONTROL, json.dumps({"round": rnd.round, "action": "stop_at_checkpoint"}).encode())
                self.rescale_asked = True
                log.warning("[%s] %d hosts available: growing at the next checkpoint", self.agent.host, len(bigger))

    def _round_over(self, rnd: Round, reps: dict[str, Report]) -> None:
        outcomes = {r.outcome for r in reps.values()}
        if outcomes == {Outcome.FINISHED}:
            self._finish()
        elif Outcome.CORRUPT in outcomes:
            self._corrupt(next((r for r in reps.values() if r.outcome == Outcome.CORRUPT and r.corrupt), None), rnd)
        elif Outcome.FAILED in outcomes:
            self._failed(rnd, [r for r in reps.values() if r.outcome == Outcome.FAILED], [], time.time())
        elif Outcome.GUARD in outcomes:
            self._guard(next(r for r in reps.values() if r.outcome == Outcome.GUARD), rnd)
        elif Outcome.NOTICE in outcomes:
            self._notice(rnd, [r for r in reps.values() if r.outcome == Outcome.NOTICE])
        else:  # every member stopped at a checkpoint to grow the group
            self._next_round(rnd, "resize: hosts came back")

    def _notice(self, rnd: Round, reps: list[Report]) -> None:
        """The group stopped at a step boundary for a preemption notice, that step committed: go on without the host."""
        told = [r for r in reps if (r.notice or {}).get("noticed")]
        notices = [r.notice or {} for r in reps]
        step = max(int(n.get("step") or 0) for n in notices) if notices else None
        hosts = ", ".join(sorted(r.host for r in told)) or "?"
        at = [float(n["notice_at"]) for n in notices if n.get("notice_at")]
        done = [float(n["committed_at"]) for n in notices if n.get("committed_at")]
        self.recovery = {
            "cause": f"preemption notice to host {hosts}",
            "kind": "notice",
            "fault_at": min(at) if at else None,
            "detected_at": max(done) if done else time.time(),
            "steps_lost": 0,
            "resume_step": step,
            "step_s": self.step_s,
        }
        log.warning(
            "[%s] preemption notice to %s: committed step %s, going on without it", self.agent.host, hosts, step
        )
        self._next_round(rnd, f"preemption notice: host {hosts} left at step {step}")

    def _next_round(self, rnd: Round, reason: str) -> None:
        self.prev_members = list(rnd.members)
        self.fail_at = None
        self.failure = None
        self._form_reason = reason
        self._set_phase(Phase.FORM)

    # --- failures -------------------------------------------------------------------------------

    def _failed(self, rnd: Round, failed: list[Report], lapsed: list[str], now: float, why: str = "") -> None:
        """Something broke the round: settle (who is still alive?), then blame, count and re-form."""
        self.fail_at = now
        self.seq_at_fail = {h: r.seq for h, r in self.view.hosts.items()}
        for h in lapsed:  # a heartbeat that lapsed is no sign of life, whatever its sequence number
            self.seq_at_fail[h] = 1 << 62
        self.failure = {"round": rnd.round, "reports": failed, "why": why, "detected_at": now, "lapsed": lapsed}
        self.prev_members = list(rnd.members)
        self._form_reason = "recovery"
        self.status["progressing"] = False
        self._set_phase(Phase.FORM)

    def _record_failure(self, lost: list[str], resume_step: int | None) -> bool:
        """Emit the failure with its best explanation and the steps it loses; False when the job has failed."""
        assert self.failure is not None
        f = self.failure  # cleared once what the store says is read: a tick the store failed comes back here
        rnd = self.round
        assert rnd is not None
        reports = self._failed_reports(list(f["reports"]), rnd)
        fault_at = next((r.fault_at for r in reports if r.fault_at), None) or self._fault_time(rnd)
        reached = self._reached(rnd)  # the store is read: what follows is recorded once
        ended = [h for h in lost if self.view.known_gone(h)]  # the rest did not beat since the failure
        detected_by = detected_by_what(reports, f["lapsed"], ended)
        for h in lost:
            self.agent.emit("host_lost", host=h, reason="agent gone" if h in ended else "no heartbeat", round=rnd.round)
        reason, blame = explain_failure(lost, ended, f["why"], reports)
        self.failure = None
        self.failures += 1
        full = [r for r in reports if "No space left on device" in f"{r.reason} {r.error}"]
        if full:
            # Another round would fill the same disk again: end the job with the reason now.
            self._fail(f"no space left on {self.store.uri} (No space left on device): {reason}")
            return False
        steps_lost = max(reached - (resume_step or 0), 0) if reached is not None else 0
        self.recovery = {
            "cause": reason,
            "kind": "failure",
            "fault_at": fault_at,
            "detected_at": f["detected_at"],
            "steps_lost": steps_lost,
            "resume_step": resume_step,
            "step_s": self.step_s,
        }
        self.agent.emit(
            "failure",
            attempt=rnd.round,
            round=rnd.round,
            reason=reason,
            steps_lost=steps_lost,
            reached_step=reached,
            resume_step=resume_step,
            worker=blame.rank if blame is not None else (rnd.rank(lost[0]) if lost else None),
            hosts=lost or ([blame.host] if blame is not None else []),
            returncode=blame.returncode if blame is not None else None,
            error=blame.error if blame is not None else "",
            log=blame.log if blame is not None else "",
            fault_at=fault_at,
            detected_at=f["detected_at"],
            detect_s=(f["detected_at"] - fault_at) if fault_at else None,
            detected_by=detected_by,
            failures=self.failures,
        )
        self.status["failures"] = self.failures
        log.warning("[%s] failure %d/%d: %s", self.agent.host, self.failures, self.cfg.max_failures, reason)
        if self.failures > self.cfg.max_failures:
            self._fail(
                f"failure budget spent: {self.failures} failures > max_failures={self.cfg.max_failures}; last: {reason}"
            )
            return False
        return True

    def _failed_reports(self, alarm: list[Report], rnd: Round) -> list[Report]:
        """Every failed report of the round by now, not only those that raised the alarm.

        The peer watch makes the other processes leave as soon as one fails, and their reports can come first.
        """
        try:
            later = [r for r in self.rdv.reports(rnd.round).values() if r.outcome == Outcome.FAILED]
        except Exception as e:  # noqa: BLE001 - blame what raised the alarm
            log.warning("[%s] could not read round %d's reports: %s", self.agent.host, rnd.round, e)
            later = []
        return alarm + [r for r in later if r.host not in {x.host for x in alarm}]

    def _fault_time(self, rnd: Round) -> float | None:
        """When chaos struck in this round (its event, written before the fault), if it did."""
        times = [
            float(e.get("at") or e["time"])
            for e in self.agent.events.read(types=("chaos",))
            if e.get("attempt") == rnd.round and e.get("action") in WORKER_SIDE
        ]
        return max(times) if times else None

    def _guard(self, rep: Report, rnd: Round) -> None:
        g = rep.guard or {}
        step, reason = int(g.get("step", -1)), str(g.get("reason", "bad loss"))
        restored = g.get("restored_from")
        states = self.ledger.states()  # read before counting: a tick the store failed comes back here
        self.guards += 1
        good = sorted(s for s, r in states.items() if r["state"] in USABLE_STATES and s < step)
        suspect: list[int] = []
        if restored is not None and not g.get("committed_since_restore"):
            # The bad loss came right after restoring that step: never roll back to it again.
            suspect = [s for s in good if s >= int(restored)]
            good = [s for s in good if s < int(restored)]
        if self.guards > self.cfg.max_guard_rollbacks or not good:
            if self.guards > self.cfg.max_guard_rollbacks:
                why = f"{self.guards - 1} rollback(s) did not help (max_guard_rollbacks={self.cfg.max_guard_rollbacks})"
            elif suspect:
                why = f"no checkpoint before step {suspect[0]}, which gave this loss right after it was restored"
            else:
                why = "no committed checkpoint before it to roll back to"
            self._fail(f"in-training guard: {reason} at step {step} (metric {g.get('metric', 'loss')}); {why}")
            return
        target = good[-1]
        self._fence()
        for s in suspect:
            quarantine(self.store, self.ledger, s, f"in-training guard: {reason} right after restoring step {s}")
        how: dict[str, Any] = {"lr_scale": self.cfg.rollback_lr_scale}
        if self.cfg.rollback_skip_data and g.get("next_batch") is not None:
            how["skip_to_batch"] = int(g["next_batch"])
        self.ledger.set_pointer(target, f"guard: {reason} at step {step}", resume=how)
        self.local_floor = rnd.round + 1  # local copies saved until now are of the rolled-back lineage
        self.recovery = {
            "cause": f"guard: {reason} at step {step}",
            "kind": "guard",
            "fault_at": float(g.get("time") or time.time()),
            "detected_at": time.time(),
            "steps_lost": max(step - target, 0),
            "resume_step": target,
            "step_s": self.step_s,
        }
        self.agent.emit(
            "rollback",
            from_step=step,
            to_step=target,
            reason=f"guard: {reason}",
            kind="in-job",
            resume=how,
            attempt_no=self.guards,
            quarantined=suspect,
            round=rnd.round,
        )
        self._next_round(rnd, f"guard rollback to step {target}")

    def _corrupt(self, rep: Report | None, rnd: Round) -> None:
        info = (rep.corrupt if rep is not None else None) or {}
        step = info.get("step")
        if step is None:
            self._failed(rnd, [rep] if rep else [], [], time.time(), "a restore failed")
            return
        self._fence()
        reason = str(info.get("reason") or "failed its integrity check")
        try:
            where = quarantine(self.store, self.ledger, int(step), reason, state="corrupt")
        except (NotFound, OSError):
            self.ledger.record(int(step), "corrupt", reason=reason)
            where = ""
        self.agent.emit("checkpoint_corrupt", step=int(step), reason=reason, location=where, round=rnd.round)
        log.warning("[%s] checkpoint %s is corrupt (%s); resuming from an older one", self.agent.host, step, reason)
        self._next_round(rnd, f"checkpoint {step} corrupt")

    # --- the end --------------------------------------------------------------------------------

    def _finish(self) -> None:
        self.view.read(time.time())  # the members' last word: the final step and its commit
        rank0 = self.view.hosts.get(self.round.members[0]) if self.round is not None else None
        if rank0 is not None:
            if rank0.step is not None:
                self.status.update(step=rank0.step, loss=rank0.loss)
            if rank0.committed is not None:
                self.status["latest_committed"] = max(rank0.committed, int(self.status.get("latest_committed") or 0))
        # Every member reached the last step and saved it (a round that restored it trains no step to report).
        for key in ("step", "latest_committed"):
            self.status[key] = max(int(self.status.get(key) or 0), self.cfg.steps)
        step = self.status.get("step")
        self.agent.emit("finished", step=step, failures=self.failures, seconds=time.time() - self.started_at)
        self._end(RunState.FINISHED, "")

    def wait_for_returning_hosts(self) -> float:
        """The last host leaves and the job's hosts come back by themselves (pods their Job makes again):
        the job waits for capacity.  Seconds of ``capacity_timeout_s`` left, for the lease handed to
        the job's next agents (the next reader records the job failed if none claims it by then)."""
        now = time.time()
        if self.phase != Phase.WAIT:
            self._start_waiting(now)
            self.t_phase = now
        self._write_status(force=True)
        return max(self.cfg.capacity_timeout_s - (now - self.t_phase), 1.0)

    def fail(self, reason: str) -> None:
        """End the job as failed with ``reason`` (the agent, when leading itself failed)."""
        if self.phase != Phase.DONE:
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        fields = {"reason": reason, "step": self.status.get("step"), "host": self.agent.host}
        try:
            self.agent.events.emit("failed", **fields)
        except OSError as e:
            # A full disk: other writers race for any space freed, so the event goes into blocks held for it.
            try:
                if e.errno != errno.ENOSPC:
                    raise
                self.agent.events.emit_in(RDV_EVENT_RESERVE, "failed", **fields)
            except (OSError, NotFound) as e2:
                log.warning("[%s] could not write the failed event: %s", self.agent.host, e2)
        log.warning("[%s] the job failed: %s", self.agent.host, reason)
        self._end(RunState.FAILED, reason)

    def _end(self, state: RunState, reason: str) -> None:
        try:
            self._write_end(state, reason)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            # A full disk: give back the space held for this moment, and record the end.
            log.warning("[%s] the run root is full; using the space held back to record the end", self.agent.host)
            self.store.delete(RDV_RESERVE)
            self._write_end(state, reason)

    def _done(self, _now: float) -> None:
        """The job has ended: an end whose records a failing run root cut short is written again."""
        if self._ending is not None and (self.round is None or self.round.action != "stop"):
            self._end(*self._ending)

    def _write_end(self, state: RunState, reason: str) -> None:
        self._fence()
        self.status["reason"] = reason
        self.phase = Phase.DONE
        self._ending = (state, reason)
        self._write_status(force=True, state=state)
        if self.round is not None and self.round.action == "stop":
            return  # written already (a retry after a full disk)
        number = (self.round.round + 1) if self.round else max([0, *self.rdv.round_numbers()]) + 1
        stop = Round(
            round=number,
            job=self.job,
            gen=int(self.agent.lock.gen or 0),
            leader=self.agent.host,
            action="stop",
            final=state.value,
            reason=reason,
            failures=self.failures,
            guards=self.guards,
        )
        try:
            self.rdv.open_round(stop)
        except AlreadyExists:  # ours, written by a try that seemed to fail; else another leader of the job
            other = self.rdv.round(stop.round)
            if other is None or other.action != "stop" or other.job != self.job or other.leader != self.agent.host:
                raise LockLost(f"round {stop.round} of job {self.job} was written by another leader") from None
            stop = other
        self.round = stop

    # --- requests, chaos, status ----------------------------------------------------------------

    def _control(self) -> None:
        try:
            req = json.loads(self.store.get(CONTROL))
        except (NotFound, ValueError):
            return
        if req.get("action") == "stop_job" and self.phase != Phase.DONE:
            self._fail(f"stopped: {req.get('reason') or 'asked to stop'}")

    def _capacity_chaos(self, now: float) -> None:
        if self.agent.capacity is None:
            return
        step = self.status.get("step")
        for spec in self.cfg.chaos:
            f = parse_chaos(spec)
            if f.action != "capacity" or spec in self.fired:
                continue
            after = f.get("after_s")
            due = (f.step is not None and step is not None and int(step) >= f.step) or (
                after is not None and now - self.started_at >= float(after)
            )
            if due:
                self.fired.add(spec)
                to = int(f.get("to") or 0)
                # On record first: the pool may take this very host at once, and the next leader must not
                # fire the same fault again.
                self.agent.emit("chaos", action="capacity", spec=spec, to=to, step=step)
                self.agent.capacity.set(to, reason=f"chaos {spec}")
                self.agent.emit("capacity", available=to, reason="chaos")

    def _state(self) -> RunState:
        if self.phase == Phase.DONE and self._ending is not None:
            return self._ending[0]
        if self.phase == Phase.GATHER:
            return RunState.STARTING
        if self.phase == Phase.WAIT:
            return RunState.WAITING_FOR_CAPACITY
        if self.phase == Phase.FORM:
            return RunState.RECOVERING
        if self.status.get("progressing"):
            return RunState.RUNNING
        return RunState.STARTING if self.round is not None and self.round.reason == "start" else RunState.RECOVERING

    def _write_status(self, force: bool = False, state: RunState | None = None) -> None:
        now = time.time()
        moved = self.status.get("step") != self._status_step
        if not force and now - self._status_at < (self.cadence.status_s if moved else STATUS_S):
            return
        self._status_at = now
        self._status_step = self.status.get("step")
        self._fence()
        fields = {k: v for k, v in self.status.items() if k != "progressing"}
        write_status(
            self.store,
            **{
                **fields,
                "state": (state or self._state()).value,
                "run_uri": self.agent.run_uri,
                "job": self.job,
                "leader": self.agent.host,
                "steps_total": self.cfg.steps,
                "failures": self.failures,
                "hosts_alive": sorted(self.view.alive()),
                "started_at": self.started_at,
                "phase": self.phase.value,
            },
        )


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
