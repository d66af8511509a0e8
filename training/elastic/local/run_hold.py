"""The run held for a job of the local slice none of whose hosts is left: its lease, its status, its end.

With no host left, no agent can lead: the local slice takes the lease once the last leader's lapsed (or
was handed to the job) and keeps ``status.json`` at ``waiting_for_capacity`` until capacity returns (the
lock is handed back, and the new agents' leader waits on from the same moment), a stop is asked, or
``capacity_timeout_s`` fails the job.  A job a scheduler's assignment left no host is held, queued, with no
timeout.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from training.checkpoint.lock import LeaseKeeper, LockHeld, LockLost, RunLock
from training.config import Config
from training.elastic.capacity import LocalCapacity
from training.elastic.host.leadership import store_failure
from training.elastic.rendezvous import Rendezvous, Round
from training.elastic.status import keep_end_here, stop_asked
from training.events import FINAL_STATES, EventLog, RunState, RunStatus, read_status, write_status
from training.storage import RootGone, Store, check_root

log = logging.getLogger("rtrain.local_slice")

HANDOFF_S = 120.0  # how long the job's new agents have to claim the run lock from this process
HOLD_STATUS_S = 1.0  # while holding the run, the status is rewritten this often (readers see a live holder)


class RunHold:
    """Holds the run for one job while none of its hosts is left (see the module docstring)."""

    def __init__(self, cfg: Config, job: str, store: Store, capacity: LocalCapacity, events: EventLog) -> None:
        self.cfg = cfg
        self.job = job
        self.store = store
        self.capacity = capacity
        self.events = events  # what the holder does, under its own source
        self._hold: RunLock | None = None  # the run lock, while no host of the job is left
        self._taker: RunLock | None = None  # the lock that will hold it, until it has the lease
        self._keeper: LeaseKeeper | None = None
        self._waiting_since = 0.0
        self._held_status: dict[str, Any] = {}
        self._status_at = 0.0
        self._final_doc: RunStatus = {}

    @property
    def holding(self) -> bool:
        """Whether this process holds the run now."""
        return self._hold is not None

    @property
    def step(self) -> Any:
        """The job's step as its status said when the run was taken (None before)."""
        return self._held_status.get("step")

    def look(self, stopping: str | None) -> RunStatus | None:
        """One look while no agent of the job runs and the pool has no host for one: take the run, or hold it on.

        ``stopping``: the reason of a stop the local slice was asked for.  The job's final status once it ended
        here (or ended before its agents went, or the run moved on to another job); else None.
        """
        if self._hold is None:
            return self._take()
        return self._hold_on(stopping)

    def _take(self) -> RunStatus | None:
        """Take the run lock: handed to the job, at once; the last leader's lease, once it lapsed."""
        # One lock object across looks: it watches the last leader's lease lapse (RunLock.lapses_in).
        if self._taker is None:
            self._taker = RunLock(
                self.store,
                owner=f"local slice of job {self.job} (no host left)",
                lease_s=self.cfg.elastic.lease_s,
                job=self.job,
                on_event=lambda type_, **f: self.events.emit(type_, **f),
            )
        lock = self._taker
        try:
            lock.acquire()  # a handoff to the job at once; the last leader's lease once it lapsed
        except LockHeld as e:
            holder = e.holder or {}
            if holder.get("job") not in (None, self.job):
                log.warning("the run now belongs to job %s; job %s ends here", holder.get("job"), self.job)
                return read_status(self.store) or RunStatus(state=RunState.FAILED.value)
            return None  # else: the last leader's lease has not lapsed yet; look again
        except OSError as e:
            log.warning("cannot take the run lock to hold it for job %s: %s", self.job, e)
            keep_lasting_end(self.store, self.job, e, self.step)
            return None
        self._hold, self._taker = lock, None
        self._keeper = LeaseKeeper(lock, on_lost=lambda why: log.warning("holding the run: %s", why)).start()
        return self._begin()

    def _begin(self) -> RunStatus | None:
        """The run taken: the job waits for capacity, from when its status says it began to (else now)."""
        st = read_status(self.store) or RunStatus()
        mine = st.get("job") == self.job
        if not mine or st.get("state") in FINAL_STATES:
            self.let_go()
            return st  # the job ended (or the run moved on) before its agents went
        waiting = mine and st.get("state") == RunState.WAITING_FOR_CAPACITY.value
        self._waiting_since = float(st.get("waiting_since") or time.time()) if waiting else time.time()
        keep = ("step", "loss", "latest_committed", "failures", "started_at", "steps_total", "round", "mesh")
        self._held_status = {k: v for k, v in st.items() if mine and k in keep}
        queued = self.capacity.assigned()
        self.events.emit(
            "waiting_for_capacity",
            available=self.capacity.available(),
            min_workers=self.cfg.elastic.min_workers,
            queued=queued,
            reason="a scheduler gave the job's hosts to a higher-priority run: queued until hosts free up"
            if queued
            else "no host of the job is left; the local slice holds the run until capacity returns",
        )
        self._write(force=True)
        log.info("no host of job %s is left: holding the run, waiting for capacity", self.job)
        return None

    def _hold_on(self, stopping: str | None) -> RunStatus | None:
        """Holding the run: end it when a stop is asked or the wait ran out, hand it back when capacity returned."""
        assert self._keeper is not None and self._hold is not None
        if not self._keeper.valid():
            self.let_go()  # the lease was lost: someone else holds the run now
            return None
        asked = stop_asked(self.store) or stopping
        if asked is not None:
            return self._end(f"{asked} (while waiting for capacity)", RunState.STOPPED)
        if self.capacity.available() > 0:
            self.events.emit("capacity", available=self.capacity.available(), reason="capacity returned")
            self._keeper.stop()
            self._hold.handoff(self.job, HANDOFF_S)  # the new agents claim it; their leader waits on
            self._hold, self._keeper = None, None
            log.info("capacity returned: the run is handed back to job %s", self.job)
        elif time.time() - self._waiting_since >= self.cfg.elastic.capacity_timeout_s and not self.capacity.assigned():
            return self._end(
                f"capacity stayed below min_workers={self.cfg.elastic.min_workers} for {self.cfg.elastic.capacity_timeout_s:.0f}s "
                "(available: 0 hosts; no host of the job was left)"
            )
        else:
            self._write()
        return None

    def _write(self, force: bool = False, state: RunState = RunState.WAITING_FOR_CAPACITY) -> None:
        """Write the held job's status under the lease (at most every HOLD_STATUS_S unless ``force``)."""
        if not force and time.monotonic() - self._status_at < HOLD_STATUS_S:
            return
        assert self._keeper is not None
        self._keeper.check()
        self._status_at = time.monotonic()
        self._final_doc = write_status(
            self.store,
            **{
                **self._held_status,
                "state": state.value,
                "run_uri": self.cfg.run_uri,
                "job": self.job,
                "leader": "local-slice",
                "phase": "wait",
                "hosts_alive": [],
                "workers": 0,
                "available": self.capacity.available(),
                "waiting_since": self._waiting_since,
            },
        )

    def _end(self, reason: str, state: RunState = RunState.FAILED) -> RunStatus | None:
        """End the held job as ``state`` with ``reason``: the status, the event and a stop round, then let go.

        The job's final status; None when the end could not be recorded (the lease was lost).
        """
        try:
            self.events.ended(state, reason, step=self._held_status.get("step"))
            self._held_status["reason"] = reason
            self._write(force=True, state=state)
            rdv = Rendezvous(self.store)
            rdv.open_round(
                Round(
                    round=rdv.next_round_number(),
                    job=self.job,
                    gen=int(self._hold.gen or 0) if self._hold is not None else 0,
                    leader="local-slice",
                    action="stop",
                    final=state.value,
                    reason=reason,
                    failures=int(self._held_status.get("failures") or 0),
                )
            )
            return self._final_doc
        except LockLost as e:
            log.warning("could not record the end of job %s: %s", self.job, e)
            return None
        finally:
            self.let_go()

    def let_go(self) -> None:
        """Stop holding the run: the lease keeper stopped, the lock released."""
        if self._keeper is not None:
            self._keeper.stop()
        if self._hold is not None:
            with contextlib.suppress(Exception):
                self._hold.release()
        self._hold, self._keeper = None, None


def keep_lasting_end(store: Store, job: str, e: OSError, step: Any) -> None:
    """Where ``e`` says the run root refuses the job's records for good (read-only, gone), the job ends: its end is
    kept on this machine (its leader's, if it kept one first), for the slice's next look and every reader here."""
    log.warning("job %s: %s", job, e)
    why = store_failure(e, store.uri)
    try:
        check_root(store.uri)
    except RootGone as gone:  # a log's directory is missing because the whole run root is
        why = store_failure(gone, store.uri)
    if why:
        keep_end_here(store, job, f"{why}: the job cannot go on", step)
