"""The host agent: one per host (a pod on GKE, a simulated host on the local slice).

Level one of recovery (docs/architecture.md).  Each agent supervises its own
host's single worker process and nothing else: it keeps a warmed-up standby
worker ready, starts it when a round names this host, restarts only its own
worker, and writes a heartbeat to the rendezvous on the run root
(``training.elastic.rendezvous``).  The agents of a job find each other there;
none is special for longer than its lease:

* the agent holding the run lock's lease *leads* (``training.elastic.leader``):
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
import errno
import json
import logging
import os
import re
import signal
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from training import storage
from training.cadence import cadence
from training.checkpoint import local as local_tier
from training.checkpoint.ledger import Ledger
from training.checkpoint.lock import LeaseKeeper, LockHeld, LockLost, RunLock
from training.checkpoint.steps import file_checksums, recorded_checksums
from training.config import Config, config_from_json
from training.elastic.capacity import LocalCapacity
from training.elastic.codes import AgentExit
from training.elastic.heartbeat import Heartbeat
from training.elastic.hostwatch import HostWatch, Listener
from training.elastic.jobstatus import Phase
from training.elastic.leader import Leader
from training.elastic.outcomes import last_error, recovery_cost, worker_outcome
from training.elastic.rendezvous import HostRecord, Outcome, Rendezvous, Report, Round
from training.elastic.workerproc import WorkerProc, spawn_worker
from training.elastic.writer import Writer
from training.events import EventLog
from training.faults import HOST_ACTIONS, STORAGE_ACTIONS, parse_chaos
from training.layout import CONFIG, LOGS
from training.scalars import ScalarLog
from training.storage import LASTING_WRITE_ERRORS, Store, is_gcs, is_transient, join, open_store

log = logging.getLogger("rtrain.agent")

SCALARS_FLUSH_S = 5.0  # step scalars reach the run's TensorBoard files this often (and at each round's end)
HOST_RE = re.compile(r"^(?:s(?P<slice>\d+)-)?h(?P<index>\d+)$")
# Worker reports that become events (rank 0's; worker_started and chaos come from every rank).
EVENT_REPORTS = frozenset(
    {
        "worker_started",
        "restore",
        "init",
        "compiled",
        "compiled_ahead",
        "resumed",
        "resumed_with",
        "data_refreshed",
        "progress",
        "checkpoint",
        "evaluated",
        "guard",
        "chaos",
        "rescale_requested",
        "local_checkpoint_skipped",
        "local_tier_off",
    }
)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def slice_and_index(host: str, hosts_per_slice: int) -> tuple[int, int]:
    """``h5`` -> (5 // hosts_per_slice, 5 % hosts_per_slice); ``s2-h1`` -> (2, 1)."""
    m = HOST_RE.match(host)
    if not m:
        raise ValueError(f"host id {host!r} is not h<N> or s<slice>-h<N>")
    i = int(m["index"])
    if m["slice"] is not None:
        return int(m["slice"]), i
    return i // hosts_per_slice, i % hosts_per_slice


class HostAgent:
    """One host's agent (see the module docstring)."""

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
    ) -> None:
        self.run_uri = run
        self.job = job
        self.host = host
        self.store: Store = open_store(run)
        self.cfg: Config = config_from_json(self.store.get(CONFIG).decode())
        self.events = EventLog(self.store, source=f"agent-{host}")
        self.rdv = Rendezvous(self.store)
        self.ledger = Ledger(self.store)
        self.coordinator_host = coordinator_host
        self.coordinator_port = coordinator_port  # 0: a free port for each round (the local slice)
        self.bind_host = bind_host if bind_host is not None else coordinator_host
        started = time.time()
        # The leader's connection to this listener ends when this process does: it knows this agent gone at once.
        # And this agent's connections: to the leader while it follows, to every host while it leads.
        self.watch_listener = Listener(
            self.bind_host, coordinator_host, coordinator_port + 2 if coordinator_port else 0
        )
        self.host_watch = HostWatch()
        self.lock = RunLock(
            self.store,
            owner=f"agent {host} of job {job}",
            lease_s=self.cfg.lease_s,
            job=job,
            on_event=self.emit,
            contact={"host": host, "started": started, "watch": self.watch_listener.address},
        )
        # The local slice's pool (a preempted host leaves it); on GKE the node pools are the capacity.
        self.capacity: LocalCapacity | None = (
            LocalCapacity(self.store, default=self.cfg.max_workers) if local_capacity else None
        )
        base = log_dir or (join(run, LOGS) if not is_gcs(run) else os.path.join("var", "logs", self.cfg.run_name))
        self.log_dir = Path(base) / job / host
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.heart = Heartbeat(self.rdv, self._first_record(started), self.cfg.heartbeat_s)
        self.worker: WorkerProc | None = None
        self.standby: WorkerProc | None = None
        self.spawned = 0
        self.seen_round = 0
        self.max_gen = 0
        self.keeper: LeaseKeeper | None = None
        self.leader: Leader | None = None  # while this agent leads
        self.exit_code: AgentExit | None = None
        self._next_lead_try = 0.0
        self._signal: int | None = None
        self.leaving: dict[str, Any] | None = None  # a preemption notice: when, why, the deadline
        self._hand_over_s = 0.0  # leaving last, hosts to come back: how long the lease waits for them
        self.local_dir = local_tier.host_dir(self.cfg.local_checkpoint_dir, run, job, host)
        self.scalars: ScalarLog | None = None
        self._scalars_at = 0.0
        self.store_failure = ""  # why the run root refuses writes for good (a full disk, a read-only one), once seen
        self.cadence = cadence(self.cfg.max_workers, is_gcs(run), self.cfg.heartbeat_s, self.cfg.lease_s)
        self._follow_at = 0.0
        self._list_at = time.monotonic()
        self._lead_failing_since: float | None = None  # leading has met a run root failing for now since
        self._step_beat_at = 0.0
        self.writer = Writer(host)

    def _first_record(self, started: float) -> HostRecord:
        """This agent's heartbeat record before its first beat: where it is, how to reach it."""
        slice_, index = slice_and_index(self.host, self.cfg.hosts_per_slice)
        return HostRecord(
            host=self.host,
            job=self.job,
            slice=slice_,
            index=index,
            seq=0,
            time=time.time(),
            pid=os.getpid(),
            node=socket.gethostname(),
            coordinator=self._coordinator_address(),
            started=started,
            watch=self.watch_listener.address,
        )

    # --- small helpers ------------------------------------------------------------------------

    def emit(self, type_: str, **fields: Any) -> None:
        """Write an event now (the leader's decisions: they must be on record before what follows)."""
        fields.setdefault("host", self.host)
        try:
            self.events.emit(type_, **fields)
        except Exception as e:  # noqa: BLE001 - an event that cannot be written must not take the host down
            log.warning("[%s] could not write a %s event: %s", self.host, type_, e)

    def emit_later(self, type_: str, **fields: Any) -> None:
        """Write an event from the writer thread, in order: the main loop does not wait for the store."""
        self.writer.put(lambda: self.emit(type_, **fields))

    def _coordinator_address(self) -> str:
        port = self.coordinator_port or free_port(self.coordinator_host)
        return f"{self.coordinator_host}:{port}"

    def update(self, now: bool = True, **fields: Any) -> None:
        """Change this host's heartbeat record; write it now (else with the next beat)."""
        self.heart.update(now, **fields)

    @property
    def record(self) -> HostRecord:
        return self.heart.record

    # --- the main loop ------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        newest = self.rdv.newest_round(self.job)
        if newest is not None:
            # A round already running cannot take a new process; if it counted on this host, say
            # at once that this host's worker is gone (this agent was restarted).
            self.seen_round = max(self.rdv.round_numbers() or [0])
            if self.host in newest.members and newest.action == "train":
                self._report(newest.round, newest.rank(self.host), Outcome.FAILED, reason="host agent restarted")
            if newest.action == "stop":
                return int(AgentExit.FINISHED if newest.final == "finished" else AgentExit.FAILED)
        if self.cfg.local_checkpoint_every:
            local_tier.forget_other_jobs(self.cfg.local_checkpoint_dir, self.run_uri, self.job)
            self._advertise_local(local_tier.read_manifests(self.local_dir))
        self.heart.start()
        self.writer.start()
        self.standby = self._spawn()
        log.info("[%s] agent of job %s on %s, pid %d", self.host, self.job, self.run_uri, os.getpid())
        try:
            while self.exit_code is None:
                if self._signal is not None and self.leaving is None:
                    self._notice(self._signal)
                if self.leaving is not None and self._drained():
                    self.exit_code = AgentExit.INTERRUPTED
                    break
                self._follow_safely()
                self._pump()
                self._maybe_lead()
                if self.leader is not None:
                    self._lead_tick()
                self._flush_scalars()
                time.sleep(self.cadence.poll_s)
        finally:
            self._shutdown()
        return int(self.exit_code if self.exit_code is not None else AgentExit.INTERRUPTED)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signal = signum

    # --- a preemption notice ------------------------------------------------------------------

    def _notice(self, signum: int) -> None:
        """SIGTERM (a preemption notice, a pod being deleted): this host leaves, losing no step.

        Its worker is told (it passes the notice to the whole group through the
        next step, and the group stops at that step boundary, commits it and ends
        the round); the host is marked leaving, so no new round counts on it; the
        agent goes once its worker has reported, or when ``preemption_grace_s``
        is spent.  A leader keeps leading until the next round is open.
        """
        name = signal.Signals(signum).name
        now = time.time()
        self.leaving = {"at": now, "why": f"{name} (preemption notice)", "deadline": now + self.cfg.preemption_grace_s}
        log.warning("[%s] %s: leaving within %.0fs", self.host, name, self.cfg.preemption_grace_s)
        self.update(state="leaving")
        if self.capacity is not None:
            with contextlib.suppress(Exception):
                self.capacity.leave(self.host, reason=f"host {self.host} got a preemption notice")
        if self.standby is not None:
            self._kill(self.standby)
            self.standby = None
        w = self.worker
        if w is not None and w.assigned and w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(signal.SIGTERM)
        else:
            self.emit_later(
                "preemption_notice", step=None, seconds=0.0, committed=False, reason="no worker was training"
            )

    def _drained(self) -> bool:
        """May a leaving agent go: its worker has ended and reported, and it leads nothing that needs it?"""
        assert self.leaving is not None
        if time.time() > self.leaving["deadline"]:
            w = self.worker
            if w is not None:
                why = (
                    f"preemption notice: the grace period ({self.cfg.preemption_grace_s:.0f}s) ran out before "
                    f"the worker stopped"
                )
                log.warning("[%s] %s", self.host, why)
                self._kill(w)
                self.worker = None
                self._report(w.round, w.rank, Outcome.FAILED, reason=why, step=self.record.step)
                self.emit_later("preemption_notice", step=self.record.step, seconds=None, committed=False, reason=why)
            return True
        if self.worker is not None:
            return False
        if self.leader is None:
            return True
        # A leaving leader: another agent of the job takes the lease when this one releases it
        # (and opens the next round).  With no other host left: where the hosts come back by
        # themselves (no local pool: pods that their Job makes again), the job waits for them, the
        # lease handed to its next agents; on the local slice the job ends, resumable, unless a
        # scheduler took the hosts (the local slice then holds the run, queued, until they return).
        queued = self.capacity is not None and self.capacity.assigned()
        if self.leader.phase != Phase.DONE and not (self.leader.view.fresh() - {self.host}) and not queued:
            if self.capacity is None:
                self._hand_over_s = self.leader.wait_for_returning_hosts()
            else:
                self.leader.fail(
                    "every host of the job left after a preemption notice; a relaunch resumes from the newest "
                    "committed checkpoint"
                )
        return True

    def _shutdown(self) -> None:
        self.writer.closing.set()  # writes still queued are tried once more, not again and again
        for w in (self.worker, self.standby):
            if w is not None:
                self._kill(w)
        self.worker = self.standby = None
        self.writer.close()  # what the worker reported is on record before the agent goes
        if self.keeper is not None:
            self.keeper.stop()
        with contextlib.suppress(Exception):
            if self._hand_over_s and self.keeper is not None and self.keeper.valid():
                self.lock.handoff(self.job, self._hand_over_s)  # the job's next agents claim it
                log.warning(
                    "[%s] no host of the job is left: it waits %.0fs for its hosts", self.host, self._hand_over_s
                )
            else:
                self.lock.release()  # a no-op unless this agent still holds it
        with contextlib.suppress(Exception):
            self.heart.last("leaving" if self.exit_code == AgentExit.INTERRUPTED else "gone")
        self.host_watch.close()
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
        now = time.monotonic()
        if now < self._follow_at:
            return
        w = self.worker
        busy = w is not None and w.proc.poll() is None
        self._follow_at = now + (self.cadence.busy_poll_s if busy else self.cadence.poll_s)
        listing = now >= self._list_at  # now and then, in case this host fell behind the rounds still kept
        if listing:
            self._list_at = now + self.cadence.list_rounds_s
        rounds = self.rdv.rounds_listed_after if listing else self.rdv.rounds_after
        for rnd in rounds(self.seen_round):
            self.seen_round = max(self.seen_round, rnd.round)
            if rnd.job != self.job or rnd.gen < self.max_gen:
                continue  # another job's round, or one written by a leader that has lost its lease
            self.max_gen = rnd.gen
            self._apply(rnd)

    def _apply(self, rnd: Round) -> None:
        if rnd.action == "stop":
            if self.worker is not None:
                self._kill(self.worker)
                self.worker = None
            self.exit_code = AgentExit.FINISHED if rnd.final == "finished" else AgentExit.FAILED
            return
        if self.worker is not None:  # a worker of an older round: that round is over
            self._kill(self.worker)
            self.worker = None
        rank = rnd.rank(self.host)
        if rank < 0:
            if self.leaving is None:
                self.update(state="idle", round=rnd.round, rank=-1)
            return
        if self.leaving is not None:  # opened before the leader saw this host leave
            self._report(rnd.round, rank, Outcome.FAILED, reason=f"host {self.host} is leaving (preemption notice)")
            return
        w = self.standby if self.standby is not None and self.standby.proc.poll() is None else self._spawn()
        self.standby = None
        w.round, w.rank, w.plan = rnd.round, rank, rnd
        bind = self.bind_host if rank == 0 else ""
        assignment = {
            "round": rnd.round,
            "rank": rank,
            "processes": rnd.workers,
            "coordinator": rnd.coordinator,
            "bind": f"{bind}:{rnd.coordinator.rsplit(':', 1)[1]}" if bind else "",
            "resume": rnd.resume,
            "faults": rnd.faults,
            "env": self._round_env(rnd, rank),
            # Process 0's peer watch listens next to the coordinator (a fixed port on GKE, declared in the pod).
            "watch_port": self.coordinator_port + 1 if rank == 0 and self.coordinator_port else 0,
            "job": self.job,
        }
        try:
            assert w.proc.stdin is not None
            w.proc.stdin.write((json.dumps(assignment) + "\n").encode())
            w.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            self._report(rnd.round, rank, Outcome.FAILED, reason=f"worker could not be started: {e}")
            self._kill(w)
            return
        self.worker = w
        self.update(state="training", round=rnd.round, rank=rank, step=None, loss=None)

    def _round_env(self, rnd: Round, rank: int) -> dict[str, str]:
        """What the worker's runtime must know of this round before it starts (TPU identity, Multislice).

        On GKE every value is this round's: the worker was started without the pod's own TPU_WORKER_* and
        MEGASCALE_* (``worker_base_env`` in ``_spawn``), which GKE's webhook set for the JobSet as created.
        """
        if self.cfg.backend != "gke":
            return {}
        from training.backends.gke import round_env

        return round_env(rnd.members, rank, self.cfg.hosts_per_slice, rnd.coordinator, os.environ.get("MEGASCALE_PORT"))

    # --- the worker processes -----------------------------------------------------------------

    def _spawn(self) -> WorkerProc:
        """A standby worker: it warms up (imports, config, dataset) and waits for its assignment."""
        self.spawned += 1
        return spawn_worker(
            self.cfg, self.run_uri, self.host, self.job, self.log_dir / f"worker-{os.getpid()}-{self.spawned}.log"
        )

    @staticmethod
    def _kill(w: WorkerProc) -> None:
        w.kill()

    def _read(self, w: WorkerProc) -> list[dict[str, Any]]:
        return w.read(self.host)

    def _pump(self) -> None:
        w = self.worker
        if self.standby is not None and self.standby.proc.poll() is not None:
            log.warning(
                "[%s] the standby worker exited (%s); see %s", self.host, self.standby.proc.returncode, self.standby.log
            )
            self._kill(self.standby)
            self.standby = None
        if w is None:
            return
        for msg in self._read(w):
            self._handle(w, msg)
        code = w.proc.poll()
        if code is None:
            return
        for msg in self._read(w):  # what it said before it went
            self._handle(w, msg)
        self._kill(w)
        self.worker = None
        self._follow_at = 0.0  # the next round is what matters now: look at once
        self._worker_ended(w, code)

    def _handle(self, w: WorkerProc, msg: dict[str, Any]) -> None:
        t = str(msg.pop("type", ""))
        if t == "metrics":
            # Every step (rank 0): the heartbeat's step and loss, and the TensorBoard scalars.
            # Rank 0's step is what the status shows: beat soon after it moves, at most every step_beat_s.
            soon = w.rank == 0 and time.monotonic() - self._step_beat_at >= self.cadence.step_beat_s
            if soon:
                self._step_beat_at = time.monotonic()
            self.update(now=soon, step=msg.get("step"), loss=msg.get("loss"), step_time=msg.get("step_time"))
            if self.scalars is None:
                self.scalars = ScalarLog(self.run_uri, self.host, store=self.store)
            values = {k: float(v) for k, v in (msg.get("values") or {}).items() if isinstance(v, int | float)}
            values["workers"] = w.plan.workers if w.plan is not None else 0
            if "metrics" not in w.seen:
                w.seen["metrics"] = True
                self.scalars.restart(int(msg["step"]))  # what an earlier round wrote from here on is superseded
            self.scalars.add(int(msg["step"]), values, wall_time=msg.get("time"))
            return
        if t == "progress":
            self.update(now=False, tokens_per_s=msg.get("tokens_per_s"))
            if self.scalars is not None and msg.get("tokens_per_s") is not None:
                self.scalars.add(int(msg["step"]), {"tokens_per_s": float(msg["tokens_per_s"])})
        elif t == "checkpoint" and msg.get("committed"):
            step = int(msg["step"])
            self.writer.put(lambda: self._committed(step, msg))
        elif t in ("finished", "rescale_requested", "guard", "corrupt", "error"):
            w.seen[t] = msg
        elif t == "chaos":
            w.seen["fault_at"] = msg.get("at") or msg.get("time")
        elif t == "preempted":
            w.seen["notice"] = msg
            if msg.get("noticed"):
                at = self.leaving["at"] if self.leaving is not None else msg.get("notice_at")
                seconds = float(msg["committed_at"]) - float(at) if at else None
                self.emit_later(
                    "preemption_notice",
                    step=msg.get("step"),
                    seconds=seconds,
                    committed=True,
                    stop_s=msg.get("stop_s"),
                    round=w.round,
                )
        elif t == "local_checkpoint":
            round_ = int(msg.get("round", w.round))
            self.writer.put(lambda: self._describe_local(round_))
        elif t in ("worker_started", "restore", "compiled"):
            w.seen[t] = dict(msg)
        if t == "resumed":
            if w.rank == 0:
                self.update(step=msg.get("step"))
                self._recovered(w, msg)
            if self.standby is None and self.leaving is None:
                # The next worker warms up now, while this one trains: a recovery then starts at
                # jax.distributed, not at `import jax` (and the warm-up does not slow this round's start).
                self.standby = self._spawn()
        host_fault = t == "chaos" and msg.get("action") in HOST_ACTIONS
        storage_fault = t == "chaos" and msg.get("action") in STORAGE_ACTIONS
        committed = t == "checkpoint" and bool(msg.get("committed"))  # its event follows the ledger record
        if t in EVENT_REPORTS and not committed and (msg.get("process_id") == 0 or t in ("worker_started", "chaos")):
            msg.pop("time", None)
            if host_fault or storage_fault:
                self.emit(t, **msg)  # on record before the host goes down, or loses its run root
            else:
                self.emit_later(t, **msg)
        if host_fault:
            self._host_fault(str(msg["action"]), msg)
        if storage_fault:
            self._storage_fault(msg)

    def _committed(self, step: int, msg: dict[str, Any]) -> None:
        """Rank 0's agent records a commit (writer thread): the step's file checksums go into the ledger.

        They are the record written into the step as it committed; a step without one is summed now.
        """
        try:
            try:
                files = recorded_checksums(self.run_uri, step)
            except ValueError:  # unreadable: what is there now is all there is
                files = None
            files = files or file_checksums(self.run_uri, step)
        except Exception as e:  # noqa: BLE001 - the step stays usable, just unverified
            log.warning("[%s] could not checksum checkpoint %s: %s", self.host, step, e)
            files = None
        self.ledger.record(step, "committed", attempt=msg.get("attempt"), files=files)
        self.ledger.set_pointer(step, "committed")
        self.update(committed=step)
        fields = {k: v for k, v in msg.items() if k != "time"}
        self.emit("checkpoint", **fields)

    def _storage_fault(self, msg: dict[str, Any]) -> None:
        """Chaos on this agent's link to the run root: every call fails (or is slow) for a while."""
        f = parse_chaos(str(msg.get("spec")))
        log.warning("[%s] chaos %s: the run root is %s for %ss", self.host, f.spec, f.action, f.get("for_s"))
        storage.disturb(self.run_uri, float(f.get("for_s") or 0.0), float(f.get("latency_s") or 0.0))

    def _host_fault(self, action: str, msg: dict[str, Any]) -> None:
        """Chaos carried out on this whole host (the worker said so, then waits)."""
        if action == "preempt" and self.capacity is not None:
            # This host leaves the pool, and no other: lowering the pool's size alone would let the
            # local slice stop another host too, when it looks before this one's agent is gone.
            self.capacity.leave(self.host, reason=f"chaos {msg.get('spec')}: host {self.host} lost")
            self.emit("capacity", available=self.capacity.available(), reason=f"host {self.host} preempted")
        log.warning("[%s] chaos %s: taking this host down", self.host, action)
        sig = signal.SIGSTOP if action == "freeze" else signal.SIGKILL
        if action == "kill_agent":
            os.kill(os.getpid(), sig)  # the worker dies with its agent (PR_SET_PDEATHSIG)
        os.killpg(os.getpgid(0), sig)  # the agent, its worker and its standby: the host is gone (or frozen)

    def _worker_ended(self, w: WorkerProc, code: int) -> None:
        seen = w.seen
        outcome, reason = worker_outcome(seen, code, w.rank, self.host)
        error = str(seen.get("error", {}).get("error", "")) or (last_error(w.log) if outcome == Outcome.FAILED else "")
        fields = dict(
            returncode=code,
            reason=reason,
            error=error,
            log=str(w.log),
            step=self.record.step,
            guard=seen.get("guard"),
            corrupt=seen.get("corrupt"),
            fault_at=seen.get("fault_at"),
            notice=seen.get("notice"),
            peer_lost=seen.get("error", {}).get("peer_lost"),
        )
        if self.cfg.local_checkpoint_every:
            # Local saves this worker finished but did not live to report, and the copies it pruned
            # since its last report: described now, before the report, so the leader forming the next
            # round (and this host's record) knows exactly what is on disk.
            self._describe_local(w.round)
        if outcome == Outcome.FAILED:
            if self.cfg.local_checkpoint_every:
                self.heart.beat()  # the copies on record before the report: the leader forms the next round from both
            self._report(w.round, w.rank, outcome, **fields)  # at once: the survivors are waiting
        else:
            # An orderly end is reported after what the worker said before it (its commit records):
            # the leader's next decision reads them.
            self.writer.put(lambda: self._report(w.round, w.rank, outcome, **fields))
        if self.scalars is not None:
            self.writer.put(self.scalars.flush)
            self._scalars_at = time.monotonic()
        if self.leaving is not None:
            return  # this host goes: no standby, and it stays "leaving"
        self.update(state="idle", coordinator=self._coordinator_address())
        if self.standby is None and self.exit_code is None:
            self.standby = self._spawn()
        self._next_lead_try = 0.0  # something happened: is there still a leader?

    # --- the local tier, TensorBoard scalars, recoveries --------------------------------------

    def _describe_local(self, round_: int) -> None:
        """Describe this host's finalised local copies (manifests with checksums) and advertise them."""
        try:
            self._advertise_local(local_tier.describe_new(self.local_dir, round_))
        except OSError as e:
            log.warning("[%s] cannot describe the local checkpoints in %s: %s", self.host, self.local_dir, e)

    def _advertise_local(self, steps: dict[int, local_tier.LocalStep]) -> None:
        self.update(local=sorted([s.step, s.round] for s in steps.values()))

    def _flush_scalars(self) -> None:
        if self.scalars is not None and time.monotonic() - self._scalars_at >= SCALARS_FLUSH_S:
            self._scalars_at = time.monotonic()
            if self.scalars.pending:
                self.writer.put(self.scalars.flush)

    def _recovered(self, w: WorkerProc, resumed: dict[str, Any]) -> None:
        """Rank 0's first step after a failure or a notice: what the recovery cost, phase by phase."""
        recovery = dict(w.plan.recovery) if w.plan is not None else {}
        if not recovery:
            return
        cost = recovery_cost(recovery, w.seen, float(resumed.get("time") or time.time()))
        self.emit_later(
            "recovered",
            cause=recovery.get("cause"),
            kind=recovery.get("kind"),
            round=w.round,
            step=resumed.get("step"),
            resume_step=cost.resume_step,
            tier=cost.tier,
            compile_cached=cost.compile_cached,
            steps_lost=cost.steps_lost,
            lost_s=asdict(cost.lost_s),
            seconds=cost.lost_s.total,
        )

    def _report(self, round_: int, rank: int, outcome: Outcome, **fields: Any) -> None:
        rep = Report(round=round_, host=self.host, rank=rank, outcome=outcome.value, **fields)
        try:
            self.rdv.report(rep)
        except Exception as e:  # noqa: BLE001 - the leader also sees the heartbeat
            log.warning("[%s] could not report round %s: %s", self.host, round_, e)
            if is_transient(e):  # the writer tries again while the root fails
                self.writer.put(lambda: self.writer.until_written(lambda: self.rdv.report(rep)))

    # --- leading ------------------------------------------------------------------------------

    def _maybe_lead(self) -> None:
        now = time.monotonic()
        if self.leader is not None or now < self._next_lead_try:
            return
        self._next_lead_try = now + self.cfg.heartbeat_s
        try:
            holder = self.lock.held_by()
        except Exception as e:  # noqa: BLE001 - try again at the next beat
            log.warning("[%s] cannot read the run lock: %s", self.host, e)
            return
        if holder is not None and holder.get("job") != self.job:
            log.warning("[%s] the run now belongs to job %s; this job's agents stop", self.host, holder.get("job"))
            self.exit_code = AgentExit.SUPERSEDED
            return
        exited: int | None = None
        if holder is not None and holder.get("action") != "handoff":
            exited = self._holder_exited(holder)
            if exited is None:
                return  # a live leader of this job
        try:
            self.lock.acquire(holder_exited=exited)
        except LockHeld:
            return
        except OSError as e:
            log.warning("[%s] cannot take the lease: %s", self.host, e)
            self._store_error(e)
            return
        self.keeper = LeaseKeeper(
            self.lock, on_lost=lambda why: log.warning("[%s] %s", self.host, why), on_error=self._store_error
        ).start()
        self.update(leader=True)
        self._lead_failing_since = None
        self.leader = Leader(self)
        log.warning("[%s] leads job %s (lease generation %s)", self.host, self.job, self.lock.gen)

    def _holder_exited(self, holder: dict[str, Any]) -> int | None:
        """The lease's generation when its holder's agent has exited (its host-watch connection was closed)."""
        contact = holder.get("contact") or {}
        if not contact.get("watch") or contact.get("started") == self.record.started:
            return None
        host, started = str(contact["host"]), float(contact["started"])
        self.host_watch.watch(host, started, str(contact["watch"]))
        return int(holder["gen"]) if self.host_watch.exited(host, started) else None

    def _store_error(self, e: Exception) -> None:
        """The run root refused a write.  One it will keep refusing ends the job: room is made for its last words."""
        why = store_failure(e, self.run_uri)
        if why and not self.store_failure:
            self.store_failure = why
            if isinstance(e, OSError) and e.errno == errno.ENOSPC and self.rdv.free_reserve():
                log.warning("[%s] the run root is full: freed the space held back for the job's end", self.host)

    def _lead_tick(self) -> None:
        leader = self.leader
        if leader is None:
            return
        opened = leader.round.round if leader.round else None
        try:
            leader.tick()
            if (leader.round.round if leader.round else None) != opened:
                self._follow_at = 0.0  # this host's own part in the round it just opened: at once
        except LockLost as e:
            self._step_down(str(e))
        except Exception as e:  # noqa: BLE001 - leading failed: the job still ends with the reason
            now = time.monotonic()
            if not is_transient(e) or now - (self._lead_failing_since or now) > self.cfg.heartbeat_timeout_s * 3:
                self._lead_failed(leader, e)
                return
            # The run root fails for now: lead on at the next tick (a lease that lapses meanwhile is lost).
            self._lead_failing_since = self._lead_failing_since or now
            log.warning("[%s] leading: the run root fails for now: %s", self.host, e)
        else:
            self._lead_failing_since = None

    def _lead_failed(self, leader: Leader, e: Exception) -> None:
        """Leading raised: the job ends, with the reason (a full disk: the space held back is freed first)."""
        log.error("[%s] leading the job failed", self.host, exc_info=e)
        self._store_error(e)
        why = self.store_failure or f"the leader ({self.host}) failed: {type(e).__name__}: {e}"
        try:
            leader.fail(why)
        except Exception:  # noqa: BLE001 - nothing more to do here; whoever looks next records it
            log.exception("[%s] could not record the job's end", self.host)
        self.exit_code = AgentExit.FAILED

    def _step_down(self, why: str) -> None:
        log.warning("[%s] no longer leads: %s", self.host, why)
        self._lead_failing_since = None
        if self.keeper is not None:
            self.keeper.stop()
        self.keeper = None
        self.leader = None
        self.lock.gen = None
        self.update(leader=False)


def store_failure(e: Exception, run_uri: str) -> str:
    """The job's end reason for a write error the run root will keep giving ('' for any other error)."""
    if not isinstance(e, OSError) or e.errno not in LASTING_WRITE_ERRORS:
        return ""
    writing = f", writing {e.filename}" if e.filename else ""
    if e.errno == errno.ENOSPC:
        return f"no space left on {run_uri} (No space left on device{writing})"
    return (
        f"the run root {run_uri} refuses writes ({e.strerror or errno.errorcode.get(e.errno or 0, 'error')}{writing})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rtrain agent", description="One host's agent of a training job.")
    p.add_argument("run", help="the run's URI (<root>/<run_name>)")
    p.add_argument("--job", required=True, help="the job id the launcher handed the run lock to")
    p.add_argument("--host", required=True, help="this host's id: h<N>, or s<slice>-h<N> on multi-host slices")
    p.add_argument("--coordinator-host", default="127.0.0.1", help="the address peers reach this host on")
    p.add_argument("--coordinator-port", type=int, default=0, help="jax.distributed port (0: a free one)")
    p.add_argument("--bind-host", default=None, help="the address the coordinator binds (default: --coordinator-host)")
    p.add_argument("--local-capacity", action="store_true", help="the local slice: preempt lowers capacity.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    agent = HostAgent(
        args.run,
        args.job,
        args.host,
        coordinator_host=args.coordinator_host,
        coordinator_port=args.coordinator_port,
        bind_host=args.bind_host,
        local_capacity=args.local_capacity,
    )
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
