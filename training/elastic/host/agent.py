"""The host agent: one per host (a pod on GKE, a simulated host on the local slice).

Level one of recovery (docs/architecture.md).  Each agent supervises its own
host's single worker process and nothing else: it keeps a warmed-up standby
worker ready, starts it when a round names this host, restarts only its own
worker, and writes a heartbeat to the rendezvous on the run root
(``training.elastic.rendezvous``).  The agents of a job find each other there;
none is special for longer than its lease:

* the agent holding the run lock's lease *leads* (``training.elastic.host.leader``):
  it writes each round (members, mesh, coordinator, resume step) and the run's
  status, and decides what a failure means;
* every agent *follows* the rounds: it starts, stops or keeps its worker as the
  newest round says, and reports how its worker ended;
* when the leader's lease lapses (its host is gone or frozen), another agent of
  the job takes the lease and leads the next round.

A host that is lost takes its agent and worker with it; the survivors' workers
see the peer vanish (a collective error within a second), their agents report
it, and the leader opens a new round on the hosts that are left.  A host whose
heartbeat stops (frozen) is treated the same way.  Pods and agents stay up.

The agent's threads: the main loop (rounds, the worker's pipe, leading), a
heartbeat thread, and, while leading, the lease keeper.  Workers die with their
agent (``PR_SET_PDEATHSIG``), so no process outlives the host it belongs to.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from training import procctl
from training.cadence import cadence
from training.checkpoint import local as local_tier
from training.checkpoint.ledger import Ledger
from training.config import Config, config_from_json
from training.elastic.capacity import LocalCapacity
from training.elastic.codes import AgentExit
from training.elastic.host.departure import Departure
from training.elastic.host.follower import RoundFollower
from training.elastic.host.heartbeat import Heartbeat, first_record
from training.elastic.host.hostctx import HostContext
from training.elastic.host.hostwatch import Listener, host_watch_port
from training.elastic.host.leadership import Leadership
from training.elastic.host.reports import ReportHandler
from training.elastic.host.supervisor import WorkerSupervisor
from training.elastic.host.workerproc import ForkServer
from training.elastic.host.writer import Writer
from training.elastic.rendezvous import Outcome, Rendezvous, Round
from training.events import EventLog
from training.layout import CONFIG, logs_base
from training.storage import Store, expect_root, is_transient, open_store, scheme

log = logging.getLogger("rtrain.agent")
# The job is over for every host: the local copies it kept are of no use to any later job.  (A host
# that left, INTERRUPTED, keeps its copies: it may come back to the same job.)
JOB_OVER = frozenset({AgentExit.FINISHED, AgentExit.FAILED, AgentExit.STOPPED, AgentExit.SUPERSEDED})


class HostAgent:
    """One host's agent (see the module docstring): its loop follows the rounds, a preemption notice, the lease.

    Its parts: the worker supervisor (``workers``), the report handler (``reports``), the rounds
    followed (``rounds``), the heartbeat, the writer, and its part in leading (``lead``).
    """

    def __init__(
        self,
        run: str,
        job: str,
        host: str,
        *,
        coordinator_host: str = "127.0.0.1",
        coordinator_port: int = 0,
        bind_host: str | None = None,
        local_capacity: bool = False,
        log_dir: str | None = None,
        fork_server: ForkServer | None = None,
    ) -> None:
        self.run_uri = run
        self.job = job
        self.host = host
        expect_root(run)  # a run root that vanishes is not made anew by this host's writes
        self.store: Store = open_store(run)
        self.cfg: Config = config_from_json(self.store.get(CONFIG).decode())
        self.events = EventLog(self.store, source=f"agent-{host}")
        self.rdv = Rendezvous(self.store)
        ledger = Ledger(self.store)
        bind_host = bind_host if bind_host is not None else coordinator_host
        started = time.time()
        # Its connections (to the leader, or from it to every host) end with this process: a loss is known at once.
        self.watch_listener = Listener(bind_host, coordinator_host, host_watch_port(coordinator_port))
        # The local slice's pool (a preempted host leaves it); on GKE the node pools are the capacity.
        self.capacity = LocalCapacity(self.store, default=self.cfg.elastic.max_workers) if local_capacity else None
        base = log_dir or logs_base(run, self.cfg.run_name)
        self.workers = WorkerSupervisor(
            self.cfg,
            run,
            host,
            job,
            Path(base) / job / host,
            coordinator_host=coordinator_host,
            coordinator_port=coordinator_port,
            bind_host=bind_host,
            server=fork_server,
        )
        address = self.workers.coordinator_address()
        record = first_record(
            host, job, self.cfg.placement.hosts_per_slice, address, started, self.watch_listener.address
        )
        self.heart = Heartbeat(self.rdv, record, self.cfg.elastic.heartbeat_s)
        self.writer = Writer(host)
        self.cadence = cadence(
            self.cfg.elastic.max_workers, scheme(run).requests, self.cfg.elastic.heartbeat_s, self.cfg.elastic.lease_s
        )
        ctx = HostContext(
            self.cfg, run, job, host, self.store, self.rdv, ledger, self.events, self.heart, self.emit, self.capacity
        )
        self.lead = Leadership(ctx, cadence=self.cadence, stop_worker_at_step=self._stop_worker_at_step)
        self.reports = ReportHandler(
            ctx,
            local_dir=local_tier.host_dir(self.cfg.checkpoint.local_checkpoint_dir, run, job, host),
            step_beat_s=self.cadence.step_beat_s,
            writer=self.writer,
            leaving_at=lambda: self.departure.at if self.departure is not None else None,
            warm=self._warm,
        )
        self.rounds = RoundFollower(self.rdv, job, self.cadence)
        self.exit_code: AgentExit | None = None
        self._signal: int | None = None
        self.departure: Departure | None = None  # once a preemption notice came: this host leaves

    # --- small helpers ------------------------------------------------------------------------

    def emit(self, type_: str, *, reported_at: float | None = None, **fields: Any) -> None:
        """Write an event now (the leader's decisions: they must be on record before what follows); ``reported_at``: when
        it was reported, if before now."""
        fields.setdefault("host", self.host)
        try:
            self.events.emit(type_, reported_at=reported_at, **fields)
        except Exception as e:  # noqa: BLE001 - an event that cannot be written must not take the host down
            log.warning("[%s] could not write a %s event: %s", self.host, type_, e)

    def _warm(self) -> None:
        """The next worker warms up (not on a host that is leaving)."""
        if self.departure is None:
            self.workers.warm()

    # --- the main loop ------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        newest = self.rdv.newest_round(self.job)
        if newest is not None:
            # A round already running cannot take a new process; if it counted on this host, say
            # at once that this host's worker is gone (this agent was restarted).
            self.rounds.seen_round = max(self.rdv.round_numbers() or [0])
            if self.host in newest.members and newest.action == "train":
                self.reports.report(newest.round, newest.rank(self.host), Outcome.FAILED, reason="host agent restarted")
            if newest.action == "stop":
                return int(AgentExit.of_final(newest.final))
        if self.cfg.checkpoint.local_checkpoint_every:
            local_tier.forget_other_jobs(self.cfg.checkpoint.local_checkpoint_dir, self.run_uri, self.job)
            self.reports.advertise_local(local_tier.read_manifests(self.reports.local_dir))
        self.heart.start()
        self.writer.start()
        self.workers.standby = self.workers.spawn()
        log.info("[%s] agent of job %s on %s, pid %d", self.host, self.job, self.run_uri, os.getpid())
        try:
            while self.exit_code is None:
                if self._signal is not None and self.departure is None:
                    self._notice(self._signal)
                if self.departure is not None and self.departure.drained():
                    self.exit_code = AgentExit.INTERRUPTED
                    break
                self._follow_safely()
                self._pump()
                self._note_pids()
                self._lead()
                self.reports.flush_scalars()
                time.sleep(self.cadence.poll_s)
        finally:
            self._shutdown()
        if self.exit_code in JOB_OVER and self.cfg.checkpoint.local_checkpoint_every:
            local_tier.forget_job(self.cfg.checkpoint.local_checkpoint_dir, self.run_uri, self.job)
        return int(self.exit_code if self.exit_code is not None else AgentExit.INTERRUPTED)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signal = signum

    def _lead(self) -> None:
        """Take the lease when it is free; while this agent holds it, lead."""
        self.exit_code = self.lead.maybe_lead() or self.exit_code
        if self.lead.leader is None:
            return
        tick = self.lead.tick()
        if tick.opened:
            self.rounds.look_now()  # this host's own part in the round it just opened: at once
        self.exit_code = tick.exit or self.exit_code

    # --- a preemption notice ------------------------------------------------------------------

    def _notice(self, signum: int) -> None:
        """SIGTERM (a preemption notice, a pod being deleted): this host leaves, losing no step (a Departure)."""
        self.departure = Departure(
            signum,
            self.cfg.checkpoint.preemption_grace_s,
            host=self.host,
            heart=self.heart,
            capacity=self.capacity,
            workers=self.workers,
            reports=self.reports,
            last_host_leaves=self.lead.last_host_leaves,
        )
        self.departure.begin()

    def _stop_worker_at_step(self, round_: int) -> bool:
        """A person's stop (the leader asks): this host's worker of ``round_`` gets a notice, so its group stops at
        the next step and commits it; recorded as the job's stop, not as a preemption notice.  False: none trains."""
        w = self.workers.worker
        if w is None or w.round != round_ or self.departure is not None:
            return False
        self.reports.stopping = True
        return self.workers.notice()

    def _note_pids(self) -> None:
        """Put this host's worker and standby pids in its record when they change (an operator's ``ps`` finds them)."""
        w, s = self.workers.worker, self.workers.standby
        pids = (w.live_pid() if w is not None else None, s.live_pid() if s is not None else None)
        if pids != (self.heart.record.worker_pid, self.heart.record.standby_pid):
            self.heart.update(worker_pid=pids[0], standby_pid=pids[1])

    def _shutdown(self) -> None:
        self.writer.closing.set()  # writes still queued are tried once more, not again and again
        self.workers.kill_all()
        self.heart.update(now=False, worker_pid=None, standby_pid=None)
        self.writer.close()  # what the worker reported is on record before the agent goes
        self.lead.release(self.departure.hand_over_s if self.departure is not None else 0.0)
        with contextlib.suppress(Exception):
            self.heart.last("leaving" if self.exit_code == AgentExit.INTERRUPTED else "gone")
        self.lead.host_watch.close()
        self.watch_listener.close()

    # --- following the rounds -----------------------------------------------------------------

    def _follow_safely(self) -> None:
        """Follow the rounds; a run root that fails for now is looked at again next time."""
        try:
            self._follow()
        except Exception as e:
            if not is_transient(e):
                raise
            log.warning("[%s] cannot read the rounds now: %s", self.host, e)

    def _follow(self) -> None:
        """Apply the rounds written since the last look (a worker that trains needs to look less often)."""
        w = self.workers.worker
        for rnd in self.rounds.new_rounds(busy=w is not None and w.proc.poll() is None):
            self._apply(rnd)

    def _apply(self, rnd: Round) -> None:
        self.workers.stop_worker()  # a worker of an older round: that round is over
        if rnd.action == "stop":
            self.exit_code = AgentExit.of_final(rnd.final)
            return
        rank = rnd.rank(self.host)
        if rank < 0:
            if self.departure is None:
                self.heart.update(state="idle", round=rnd.round, rank=-1)
            return
        if self.departure is not None:  # opened before the leader saw this host leave
            self.reports.report(
                rnd.round, rank, Outcome.FAILED, reason=f"host {self.host} is leaving (preemption notice)"
            )
            return
        error = self.workers.assign(rnd, rank)
        if error:
            self.reports.report(rnd.round, rank, Outcome.FAILED, reason=error)
            return
        self.heart.update(state="training", round=rnd.round, rank=rank, step=None, loss=None, unreported=None)

    # --- the worker ---------------------------------------------------------------------------

    def _pump(self) -> None:
        """Handle what the worker reported; once it has ended, report that and get ready for the next round."""
        ended = self.workers.pump(self.reports.handle)
        if ended is None:
            return
        w, code = ended
        self.rounds.look_now()  # the next round is what matters now: look at once
        self.reports.worker_ended(w, code)
        if self.departure is not None:
            return  # this host goes: no standby, and it stays "leaving"
        self.heart.update(state="idle", coordinator=self.workers.coordinator_address())
        if self.workers.standby is None and self.exit_code is None:
            self.workers.standby = self.workers.spawn()
        self.lead.look_soon()  # something happened: is there still a leader?


def parser() -> argparse.ArgumentParser:
    """``rtrain agent``'s arguments."""
    p = argparse.ArgumentParser(prog="rtrain agent", description="One host's agent of a training job.")
    p.add_argument("run", help="the run's URI (<root>/<run_name>)")
    p.add_argument("--job", required=True, help="the job id the launcher handed the run lock to")
    p.add_argument("--host", required=True, help="this host's id: h<N>, or s<slice>-h<N> on multi-host slices")
    p.add_argument("--coordinator-host", default="127.0.0.1", help="the address peers reach this host on")
    p.add_argument("--coordinator-port", type=int, default=0, help="jax.distributed port (0: a free one)")
    p.add_argument("--bind-host", default=None, help="the address the coordinator binds (default: --coordinator-host)")
    p.add_argument("--local-capacity", action="store_true", help="the local slice: preempt lowers capacity.json")
    return p


def title(args: argparse.Namespace) -> str:
    """The agent's process title: ``rtrain agent h2 <run> --job <job>``."""
    return procctl.job_title("agent", args.run, args.job, args.host)


def main(argv: list[str] | None = None, fork_server: ForkServer | None = None) -> int:
    """``rtrain agent``; ``fork_server``: the workers' fork server, forked already (the local slice's template)."""
    args = parser().parse_args(argv)
    procctl.set_title(title(args), name="rtrain-agent")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    agent = HostAgent(
        args.run,
        args.job,
        args.host,
        coordinator_host=args.coordinator_host,
        coordinator_port=args.coordinator_port,
        bind_host=args.bind_host,
        local_capacity=args.local_capacity,
        fork_server=fork_server,
    )
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
