"""The scheduler: one process per storage root that gives the pool's hosts to submitted runs by priority.

It keeps no state of its own: each look reads the submissions, its own
placements and each run's status from the root, decides with
:func:`training.service.policy.allocate`, and acts only where the root differs
from the decision (launch a run, change a run's assigned hosts, stop a cancelled
one). So a scheduler killed at any point and started again picks up where the
root stands, and a run is launched at most once per placement (a launch that
landed before the kill is found by its status and adopted). One scheduler acts
at a time: it holds a lease on ``<root>/_service/lock/`` and checks it before
every write.

On the local slice a run's hosts are its ``capacity.json``, written as an
assignment: hosts taken away get a preemption notice (the run commits the step
and loses nothing), and a run assigned none is held, queued, until hosts return.
The scheduler launches a placed run's job through a ``Launch`` it is given: its
process (``training.backends.pool_scheduler``) launches through the run's backend.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from training import api
from training.checkpoint.lock import LeaseKeeper, LockHeld, LockLost, RunLock
from training.config import Config, config_from_json
from training.elastic.capacity import LocalCapacity
from training.events import ALIVE_STATES, FINAL_STATES, EventLog, RunState, read_status, write_status
from training.procctl import start_detached
from training.service.policy import allocate
from training.service.queue import Placement, Queue, Submission
from training.storage import open_store, scheme

log = logging.getLogger("rtrain.scheduler")

TICK_S = 0.5
LEASE_S = 10.0
IDLE_EXIT_S = 5.0  # with nothing left to place for this long, the scheduler goes (the next submit starts one)
PROCESS = "training.backends.pool_scheduler"  # the scheduler's process, started by module name


@dataclass(frozen=True)
class Launched:
    """A placed run's job: its id, and the process that keeps its hosts (0: a live job of the run adopted)."""

    job: str
    controller_pid: int


# How a placed run's job is started (its config, the placement's launch count): never a second live job of the run.
Launch = Callable[[Config, int], Launched]


class Scheduler:
    """Places the submitted runs of one storage root on its pool of hosts."""

    def __init__(self, root: str, launch: Launch) -> None:
        self.launch = launch
        self.queue = Queue(root)
        self.lock = RunLock(self.queue.store, owner=f"scheduler pid {os.getpid()}", lease_s=LEASE_S)
        self.keeper: LeaseKeeper | None = None

    def acquire(self) -> None:
        """Take the scheduler's lease (a lapsed one is taken over); LockHeld if another scheduler is alive."""
        self.lock.acquire()
        self.keeper = LeaseKeeper(self.lock, on_lost=lambda why: log.warning("scheduler lease lost: %s", why)).start()

    def release(self) -> None:
        if self.keeper is not None:
            self.keeper.stop()
        with contextlib.suppress(Exception):
            self.lock.release()

    def _fence(self) -> None:
        if self.keeper is None:
            raise LockLost("the scheduler holds no lease")
        self.keeper.check()

    def tick(self) -> int:
        """One look: settle ended runs, allocate, act. Returns how many runs are still to be placed or running."""
        pool = self.queue.pool() or 0
        active: list[Submission] = []
        stopping = 0
        for sub in self.queue.submissions():
            p = self.queue.placement(sub.run_name)
            if p.ended:
                continue
            state = self._settle(sub, p)
            if state == "active":
                active.append(sub)
            stopping += state == "stopping"
        alloc = allocate(pool, [s.demand() for s in active])
        for sub in active:
            self._apply(sub, self.queue.placement(sub.run_name), alloc[sub.run_name])
        return len(active) + stopping

    def _settle(self, sub: Submission, p: Placement) -> str:
        """Record a run's end (finished, failed, cancelled): ``ended``, ``stopping`` (cancelled) or ``active``."""
        st = api.repair_status(sub.run_uri) or {}
        mine = bool(p.job) and st.get("job") == p.job
        if mine and st.get("state") in FINAL_STATES:
            self._end(p, str(st["state"]), str(st.get("reason") or sub.cancelled))  # a cancelled job: stopped
            return "ended"
        if sub.cancelled:
            if not p.job:
                self._end(p, "cancelled", sub.cancelled)
                record_cancelled(sub.run_uri, sub.cancelled)
                return "ended"
            self._stop(sub, p)
            return "stopping"
        return "active"

    def _end(self, p: Placement, ended: str, reason: str) -> None:
        self._fence()
        p.ended, p.reason = ended, reason
        if p.hosts:
            p.hosts = 0
            p.history.append([time.time(), 0])
        self.queue.put_placement(p)
        log.info("run %s: %s %s", p.run_name, ended, reason)

    def _stop(self, sub: Submission, p: Placement) -> None:
        """Stop a cancelled run's job: its launcher's stop (which also ends a held job), else the job's control."""
        if not p.reason.startswith("stopping"):  # asked once; the job's end is then settled like any other
            self._fence()
            api.stop_job(sub.run_uri, f"cancelled: {sub.cancelled}")  # the job ends stopped, with this reason
            pid = p.controller_pid
            if pid and _is_local_slice_of(pid, sub.run_uri):
                os.kill(pid, signal.SIGTERM)
            p.reason = f"stopping: {sub.cancelled}"
            self.queue.put_placement(p)

    def _apply(self, sub: Submission, p: Placement, hosts: int) -> None:
        if not p.job:
            if hosts >= sub.min_hosts:
                self._launch(sub, p, hosts)
            return
        if hosts != p.hosts:
            self._fence()
            why = (
                f"the scheduler assigns {hosts} host(s) to this {sub.priority}-priority run"
                if hosts
                else f"queued: a run of higher priority than {sub.priority} needs the hosts"
            )
            store = open_store(sub.run_uri)
            LocalCapacity(store, default=hosts).assign(hosts, reason=why)
            EventLog(store, source="scheduler").emit("capacity", available=hosts, reason=why, assigned=True)
            p.hosts = hosts
            p.history.append([time.time(), hosts])
            self.queue.put_placement(p)
            log.info("run %s: %s", sub.run_name, why)

    def _launch(self, sub: Submission, p: Placement, hosts: int) -> None:
        st = api.repair_status(sub.run_uri) or {}
        if st.get("state") in ALIVE_STATES and st.get("job"):
            # Launched before a restart of this scheduler, or by hand: adopt it, do not launch twice.
            p.job = str(st["job"])
        else:
            self._fence()
            try:
                cfg = config_from_json(sub.config)
                LocalCapacity(open_store(sub.run_uri), default=hosts).assign(
                    hosts, reason=f"launched on {hosts} host(s)"
                )
                got = self.launch(cfg, p.launches + 1)
            except LockLost:
                raise
            except Exception as e:  # noqa: BLE001 - a run that cannot launch ends with the reason; the rest go on
                self._end(p, "failed", f"launch failed: {type(e).__name__}: {e}")
                return
            p.job = got.job
            p.controller_pid = got.controller_pid
            p.launches += 1
            log.info("run %s: launched job %s on %d host(s)", sub.run_name, p.job, hosts)
        p.hosts = hosts
        p.history.append([time.time(), hosts])
        self.queue.put_placement(p)

    def run(self) -> int:
        """Place runs until none is left to place (then go); 0 on a clean exit."""
        self.acquire()
        idle_since: float | None = None
        try:
            while True:
                _reap()
                try:
                    busy = self.tick()
                except LockLost as e:
                    log.warning("scheduler stops: %s", e)
                    return 1
                except Exception:  # noqa: BLE001 - a look that failed (a store hiccup): the next one retries
                    log.exception("a scheduler tick failed")
                    busy = 1
                if busy:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > IDLE_EXIT_S:
                    return 0
                time.sleep(TICK_S)
        finally:
            self.release()


def record_cancelled(run_uri: str, reason: str) -> None:
    """Record a run cancelled before any job of it ran: its status ``cancelled`` and a ``cancelled`` event.

    Written under the run lock, only where no job is alive (a status that says alive belongs to a job launched by
    hand, which its own leader ends); an earlier job's step and newest commit stay in the status.
    """
    store = open_store(run_uri)
    lock = RunLock(store, owner=f"scheduler pid {os.getpid()} (cancel)", lease_s=LEASE_S)
    try:
        lock.acquire()
    except (LockHeld, OSError) as e:
        log.warning("run %s: cancelled, but its status is not written (%s)", run_uri, e)
        return
    try:
        st = read_status(store) or {}
        if st.get("state") in ALIVE_STATES:
            return
        keep = {k: st[k] for k in ("step", "latest_committed", "steps_total") if k in st}
        EventLog(store, source="scheduler").emit("cancelled", reason=reason)
        write_status(store, **keep, state=RunState.CANCELLED.value, run_uri=run_uri, job="", reason=reason)
    finally:
        lock.release()


def _reap() -> None:
    """Collect the exit of the local slices this process launched (no zombies while it runs on)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _is_local_slice_of(pid: int, run_uri: str) -> bool:
    """Is process ``pid`` (still) the local slice of ``run_uri`` (not a reused pid, not another machine's)?"""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"training.elastic.local.local_slice" in argv and run_uri.encode() in argv


def log_path(root: str) -> Path:
    """Where a scheduler of ``root`` started by ``ensure_running`` writes its log."""
    if not scheme(root).filesystem:
        return Path(tempfile.gettempdir()) / f"rtrain-scheduler-{abs(hash(root)):x}.log"
    return Path(root) / "_service" / "scheduler.log"


def ensure_running(root: str) -> int | None:
    """Start a scheduler for ``root`` unless a live one holds its lease; the new process's pid, or None.

    A live scheduler refreshes its lease every quarter lease; a lease not refreshed for
    half of one is a dead scheduler's, which the new process takes over once it lapses.
    """
    q = Queue(root)
    holder = RunLock(q.store, owner="probe", lease_s=LEASE_S).held_by()
    if holder is not None and time.time() - float(holder.get("time") or 0) < LEASE_S / 2:
        return None
    return start_detached(PROCESS, [root], log_path(root))


def serve(sched: Scheduler) -> int:
    """Run ``sched`` as the root's scheduler process: a killed scheduler's lease is taken over once it lapses; with
    another scheduler alive, go."""
    deadline = time.monotonic() + 2 * LEASE_S + 5
    while True:
        try:
            return sched.run()
        except LockHeld as e:
            if time.monotonic() > deadline:
                log.warning("another scheduler holds %s: %s", sched.queue.uri, e)
                return 0
            time.sleep(1.0)
