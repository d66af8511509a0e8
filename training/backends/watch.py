"""One watch of a job, whatever its backend: an iterator of typed looks (state, status, the run's new events).

The front ends are adapters over it: ``rtrain train`` (the local slice in the foreground, a GKE
run followed from a workstation), the Airflow deferrable trigger and the polling sensor.  Each
look asks the backend for the job's state (``Backend.poll``) and reads the run's events since the
last look, those that landed late included (each told once).  A look that fails is an
:class:`Unreadable` item; the adapter decides how many it tolerates, and the watch makes its
backend anew for the next look when it was given a factory (GKE: a fresh cluster client).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Literal

from training import api
from training.api import Event, JobLook, RunStatus
from training.backends.base import Backend, JobHandle, Timeouts
from training.sections import ElasticSection

# A live job whose status is not written for this long past two hang timeouts is failed by a watch
# (the agents' own hang detection fires first: this catches a job whose leader is gone unseen).
STALE_MARGIN_S = 120.0
# Default start timeout of a watch: a launched job that never writes its status is failed after it.
START_TIMEOUT_S = 300.0

Outcome = Literal["success", "failed", "stopped"]
BY_REQUEST = ("stopped", "cancelled")  # the ends a person asked for (rtrain stop or cancel, a teardown)


def stale_after_s(hang_timeout_s: float) -> float:
    """How long a live job may leave its status unwritten before a watch calls it failed."""
    return float(hang_timeout_s) * 2 + STALE_MARGIN_S


def timeouts(elastic: ElasticSection, start_timeout_s: float = START_TIMEOUT_S) -> Timeouts:
    """The watch's timeouts for a run whose elastic section is ``elastic``."""
    return Timeouts(start_timeout_s=float(start_timeout_s), stale_after_s=stale_after_s(elastic.hang_timeout_s))


@dataclass(frozen=True)
class Look:
    """One look at a job: its state and why, the run's status, why its pods wait, and the events new since the last."""

    state: str
    reason: str
    status: RunStatus
    events: list[Event] = field(default_factory=list)
    waiting: str = ""  # why the job's pods wait ("" none does; a backend that can tell)
    queue: dict[str, object] | None = None  # the job's row of its shared pool's queue (QueueRow.to_dict())
    cursor: str | None = None  # the newest event key read so far (where a later watch goes on from)
    retry: bool = True  # False: the job failed in a way a relaunch cannot help

    @property
    def final(self) -> bool:
        """Is the job over (finished, failed, stopped or cancelled)?"""
        return self.state in api.FINAL_STATES

    @property
    def outcome(self) -> Outcome | None:
        """How the job ended for its watcher: success, failed, stopped (by a person); None while it lives."""
        if self.state == "finished":
            return "success"
        if self.state in BY_REQUEST:
            return "stopped"
        return "failed" if self.final else None

    def job_look(self) -> JobLook:
        """The look as the engine's ``JobLook`` (what ``Backend.poll`` answers)."""
        look = JobLook(state=self.state, reason=self.reason, status=self.status)
        if self.waiting:
            look["waiting"] = self.waiting
        if self.queue is not None:
            look["queue"] = self.queue
        if not self.retry:
            look["retry"] = False
        return look


@dataclass(frozen=True)
class Unreadable:
    """A look that failed (the storage, the cluster's API): how many in a row, since when (``time.monotonic``)."""

    error: Exception
    failures: int
    since: float


WatchItem = Look | Unreadable


class JobWatch:
    """The looks of one watch of one job: its backend, the job's handle, and how far its events were read.

    ``backend``: a backend, kept; or a factory, whose backend the watch owns: made at the first
    look, closed after a failed look (the next look makes another) and by :meth:`close`.
    ``events_after``: tell only events after this key (a job's launch: the events before it are an
    earlier job's).  Not for two threads at once; the trigger's looks run one at a time in a thread.
    """

    def __init__(
        self,
        backend: Backend | Callable[[], Backend],
        handle: JobHandle,
        limits: Timeouts,
        events_after: str | None = None,
    ) -> None:
        self._make = None if hasattr(backend, "poll") else backend
        self._backend: Backend | None = None if self._make is not None else backend  # type: ignore[assignment]
        self.handle = handle
        self.limits = limits
        self.run_uri = str(handle["run_uri"])
        self.start = events_after
        self.cursor = events_after
        self._seen: set[str] | None = None  # events read since floor_key(cursor); None until the first look

    def backend(self) -> Backend:
        if self._backend is None:
            assert self._make is not None
            self._backend = self._make()
        return self._backend

    def look(self) -> Look:
        """One look: the job's state, then the run's events since the last look (raises what a read raises)."""
        try:
            found = self.backend().poll(self.handle, self.limits)
        except Exception:
            if self._make is not None:
                self.close()  # the next look with clients made anew
            raise
        if self._seen is None:
            new = api.events(self.run_uri, after=self.cursor)
            self._seen = set()
        else:  # late events too, never before where this watch began
            new = api.events_since(self.run_uri, self.cursor, self._seen, self.start)
        self._seen.update(ev["_key"] for ev in new)
        self.cursor = max([self.cursor or "", *self._seen]) or None
        floor = api.floor_key(self.cursor) if self.cursor else ""
        self._seen = {k for k in self._seen if k > floor}
        return Look(
            state=str(found["state"]),
            reason=str(found.get("reason") or ""),
            status=found.get("status") or {},
            events=new,
            waiting=str(found.get("waiting") or ""),
            queue=found.get("queue"),
            cursor=self.cursor,
            retry=found.get("retry", True),
        )

    def close(self) -> None:
        """Close the backend's clients when this watch made it (GKE: the cluster's, and its CA file)."""
        backend, self._backend = self._backend, None
        close = getattr(backend, "close", None)
        if self._make is not None and callable(close):
            close()


def watch(
    backend: Backend | Callable[[], Backend],
    handle: JobHandle,
    limits: Timeouts,
    *,
    events_after: str | None = None,
    poll_s: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Generator[WatchItem]:
    """Look at the job every ``poll_s`` until it is over: a :class:`Look` each time, an :class:`Unreadable` per failed look.

    The last item is the final look.  A failed look does not end the watch; the adapter breaks
    off when it has seen enough of them.  ``sleep``: how to wait between looks (an asynchronous
    adapter passes a no-op and waits itself).  The watch's own backend is closed however it ends.
    """
    w = JobWatch(backend, handle, limits, events_after)
    failures, since = 0, 0.0
    try:
        while True:
            try:
                look = w.look()
            except Exception as e:  # noqa: BLE001 - a transient read error (GCS 5xx, the API server): the adapter judges
                failures, since = failures + 1, since if failures else time.monotonic()
                yield Unreadable(e, failures, since)
                sleep(poll_s)
                continue
            failures = 0
            yield look
            if look.final:
                return
            sleep(poll_s)
    finally:
        with contextlib.suppress(Exception):  # closing is tidying up: the watch's outcome stands
            w.close()
