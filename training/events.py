"""Typed event records, the run's states and its status document.

Events are write-once JSON objects under ``<run>/events/`` whose names sort in
time order (``<time_ns>-<source>-<nonce>.json``), so a log is built without
appends and reads the same on a local path and on GCS.  ``status.json`` is one
object replaced whole, so a reader never sees half of it; its one writer is
the job's leader.

Nothing downstream parses human log lines: sensors, the CLI, reports and the
benchmark read these records.  :mod:`training.event_text` gives each event type
one sentence for people (task logs, ``rtrain events``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from enum import StrEnum
from typing import Any, Required, TypedDict, cast

from training.layout import EVENTS, RDV_EVENT_RESERVE, STATUS
from training.records import RecordedMetrics, ResumeHow, nonce, stamp
from training.storage import NotFound, Store, open_store

log = logging.getLogger(__name__)


class RunState(StrEnum):
    """The state of a run as ``status.json`` says it."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    WAITING_FOR_CAPACITY = "waiting_for_capacity"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"  # a person stopped the job after it started (rtrain stop, a cancel, a teardown): resumable
    CANCELLED = "cancelled"  # a person cancelled the run before any job of it started (a queued submission)

    @property
    def alive(self) -> bool:
        return self not in (RunState.FINISHED, RunState.FAILED, RunState.STOPPED, RunState.CANCELLED)

    @property
    def by_request(self) -> bool:
        """Did a person end the run (stopped or cancelled), rather than the job finishing or failing?"""
        return self in (RunState.STOPPED, RunState.CANCELLED)


ALIVE_STATES: frozenset[str] = frozenset(s.value for s in RunState if s.alive)
FINAL_STATES: frozenset[str] = frozenset(s.value for s in RunState if not s.alive)


class EventType(StrEnum):
    LAUNCH = "launch"  # the leader opened a round: workers, mesh, members
    WORKER_STARTED = "worker_started"
    RESTORE = "restore"
    INIT = "init"
    COMPILED = "compiled"
    COMPILED_AHEAD = "compiled_ahead"  # the step for a smaller size, compiled into the cache before it is needed
    RESUMED = "resumed"  # the first completed step of a round
    RESUMED_WITH = "resumed_with"
    DATA_REFRESHED = "data_refreshed"
    GUARD = "guard"
    PROGRESS = "progress"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"
    FAILURE = "failure"
    RESIZE = "resize"
    CAPACITY = "capacity"
    WAITING_FOR_CAPACITY = "waiting_for_capacity"
    PODS_WAITING = "pods_waiting"  # why the job's pods do not run (GKE), told by the Airflow sensor; "" when none
    CHAOS = "chaos"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"  # a person stopped the job (it is resumable from its newest committed checkpoint)
    CANCELLED = "cancelled"  # a person cancelled the run before any job of it started
    RESCALE_REQUESTED = "rescale_requested"
    VALIDATION = "validation"
    EVALUATED = "evaluated"  # the job evaluated a step it saved on its own mesh (validate_on: slice)
    ROLLBACK = "rollback"
    PRUNE = "prune"
    LOCK = "lock"
    LEADER = "leader"  # an agent became the job's leader
    HOST_JOINED = "host_joined"
    HOST_LOST = "host_lost"
    CONFIG = "config"  # config.json written (by whom, what changed)
    PREEMPTION_NOTICE = "preemption_notice"  # a host was told to go: the step it stopped at, committed or not
    RECOVERED = "recovered"  # the first step after a failure or a notice: steps and seconds lost, by phase
    LOCAL_CHECKPOINT_SKIPPED = "local_checkpoint_skipped"  # a host's local copy failed its check
    LOCAL_TIER_OFF = "local_tier_off"  # the local tier cannot help on this mesh, or a save of it failed (and why)


# Every event type and the fields it must carry (more are allowed).
REQUIRED: dict[EventType, tuple[str, ...]] = {
    EventType.LAUNCH: ("attempt", "workers", "mesh"),
    EventType.WORKER_STARTED: ("attempt", "process_id"),
    EventType.RESTORE: ("step", "mesh", "seconds"),
    EventType.INIT: ("step", "mesh"),
    EventType.COMPILED: ("step", "seconds"),
    EventType.COMPILED_AHEAD: ("workers", "seconds"),
    EventType.RESUMED: ("step",),
    EventType.RESUMED_WITH: ("step", "next_batch", "lr_scale"),
    EventType.DATA_REFRESHED: ("step", "old", "new"),
    EventType.GUARD: ("step", "metric", "value", "reason"),
    EventType.PROGRESS: ("step", "loss"),
    EventType.CHECKPOINT: ("step", "committed"),
    EventType.EVALUATED: ("step", "metrics", "seconds"),
    EventType.CHECKPOINT_CORRUPT: ("step", "reason"),
    EventType.FAILURE: ("attempt", "reason"),
    EventType.RESIZE: ("old_workers", "new_workers", "old_mesh", "new_mesh"),
    EventType.CAPACITY: ("available",),
    EventType.WAITING_FOR_CAPACITY: ("available", "min_workers"),
    EventType.PODS_WAITING: ("reason",),
    EventType.CHAOS: ("action",),
    EventType.FINISHED: ("step",),
    EventType.FAILED: ("reason",),
    EventType.STOPPED: ("reason",),
    EventType.CANCELLED: ("reason",),
    EventType.RESCALE_REQUESTED: ("step", "workers"),
    EventType.VALIDATION: ("step", "verdict"),
    EventType.ROLLBACK: ("from_step", "to_step", "reason"),
    EventType.PRUNE: ("deleted", "kept"),
    EventType.LOCK: ("owner",),
    EventType.LEADER: ("host", "job"),
    EventType.HOST_JOINED: ("host",),
    EventType.HOST_LOST: ("host", "reason"),
    EventType.CONFIG: ("by",),
    EventType.PREEMPTION_NOTICE: ("step", "seconds", "committed"),
    EventType.RECOVERED: ("cause", "steps_lost", "lost_s"),
    EventType.LOCAL_CHECKPOINT_SKIPPED: ("step", "host", "reason"),
    EventType.LOCAL_TIER_OFF: ("reason",),
}
EVENT_TYPES: frozenset[str] = frozenset(t.value for t in EventType)


class Event(TypedDict, total=False):
    """One event record: what every event carries, then every field some event type carries.

    ``REQUIRED`` says which fields each type must have; the rest appear where they apply.  The set
    is closed: a field not declared here is a type error where it is read.
    """

    type: Required[str]
    time: Required[float]  # when it was stamped (seconds since the epoch, the source's clock)
    source: Required[str]  # the host and process that wrote it
    _key: str  # the object's name, added when read (a cursor for "events after this one")
    # where in the run
    step: int
    attempt: int
    attempt_no: int
    round: int | None
    job: str | None
    host: str
    hosts: list[str]
    members: list[str]
    process_id: int
    pid: int
    worker: int
    workers: int
    old_workers: int
    new_workers: int
    min_workers: int
    available: int
    mesh: dict[str, int]  # axis -> size
    old_mesh: dict[str, int]
    new_mesh: dict[str, int]
    runtime_env: dict[str, str]  # the round's environment variables
    # progress and metrics
    loss: float
    accuracy: float
    grad_norm: float
    lr: float
    lr_scale: float
    step_time: float
    tokens_per_s: float
    metrics: RecordedMetrics
    metric: str
    value: float
    next_batch: int
    evaluated_on: str
    # checkpoints
    committed: bool
    committed_since_restore: bool
    blocking_s: float
    local_save_blocking_s: float | None
    save_s: float
    write_s: float
    bytes: int
    bytes_freed: int
    copy_bound_s: float
    copy_GBps: float
    tier: str | None
    checked_ahead: bool  # restore: its agent had checked the local copy whole
    restored_from: int | None
    deleted: list[int]
    kept: list[int]
    incomplete: list[int]
    skipped: list[int]
    quarantined: list[int]
    policy: str
    # failures, recoveries, rollbacks
    reason: str
    error: str
    cause: str
    log: str
    returncode: int | None
    failures: int
    fault_at: float | None
    detect_s: float | None
    detected_at: float
    detected_by: str
    reached_step: int | None
    resume_step: int | None
    resume: str | ResumeHow
    steps_lost: int
    lost_s: dict[str, float]
    lost: bool
    from_step: int
    to_step: int
    to: int
    gen: int
    verdict: str
    action: str
    kind: str
    spec: str
    at: float
    seconds: float
    stop_s: float
    # compiles, data, config
    cache_hit: bool
    compile_s: float  # the step's compile, alongside the restore ("seconds": the wait for it after the restore)
    compile_cached: bool
    cpu_s: float  # rank 0's CPU time from its assignment to its round's first step (resumed)
    loaded: bool
    already: bool  # compiled_ahead: the cache held that size's step for this round program already
    old: str
    new: str
    by: str
    changed: list[str]
    location: str
    # capacity, leases, the shared pool
    assigned: bool
    queued: bool
    owner: str
    handoff: bool
    holder_exited: bool
    previous_owner: str
    previous_pid: int
    previous_job: str | None
    previous_expires_at: float


EVENT_FIELDS: frozenset[str] = Event.__required_keys__ | Event.__optional_keys__


class EndFields(TypedDict, total=False):
    """The fields of a job's ``failed``, ``stopped`` or ``cancelled`` event."""

    reason: Required[str]
    step: int
    host: str
    lost: bool


class EventError(ValueError):
    pass


def make_event(type_: str, source: str, time_s: float, **fields: Any) -> Event:
    try:
        kind = EventType(type_)
    except ValueError:
        raise EventError(f"unknown event type {type_!r}") from None
    missing = [f for f in REQUIRED[kind] if f not in fields]
    if missing:
        raise EventError(f"event {type_!r} lacks {missing}")
    undeclared = sorted(set(fields) - EVENT_FIELDS)
    if undeclared:
        raise EventError(f"event {type_!r} has fields {undeclared} that events.Event does not declare")
    return cast(Event, {"type": kind.value, "time": time_s, "source": source, **fields})


class EventLog:
    """The run's events: ``emit`` writes one write-once object, ``read`` lists them in time order."""

    def __init__(self, store: Store, source: str | None = None) -> None:
        self.store = store
        self.source = source or f"{socket.gethostname()}-{os.getpid()}"

    def emit(self, type_: str, *, reported_at: float | None = None, **fields: Any) -> Event:
        """Write an event: its ``time`` is ``reported_at`` (when it was reported, by this host's clock) or now; its
        place in the log is when it was written."""
        ns = stamp()
        event = make_event(type_, self.source, ns / 1e9 if reported_at is None else reported_at, **fields)
        key = f"{EVENTS}{ns:020d}-{self.source}-{nonce()}.json"
        self.store.create(key, json.dumps(event, sort_keys=True, default=str).encode())
        return event

    def emit_in(self, reserve: str, type_: str, **fields: Any) -> Event:
        """``emit`` into the space of the object ``reserve`` (a full disk: the job's last event)."""
        ns = stamp()
        event = make_event(type_, self.source, ns / 1e9, **fields)
        key = f"{EVENTS}{ns:020d}-{self.source}-{nonce()}.json"
        self.store.create_in(reserve, key, json.dumps(event, sort_keys=True, default=str).encode())
        return event

    def failed(self, reason: str, *, step: int | None, host: str | None = None, lost: bool = False) -> None:
        """Write the job's ``failed`` event, with ``step`` when one was reached; on a full disk, into the blocks held for it.

        ``lost``: no host was left to end the job, so a later reader ended it.  A write that still fails is logged,
        not raised: the caller goes on to write the failed status.
        """
        self.ended(RunState.FAILED, reason, step=step, host=host, lost=lost)

    def ended(
        self, state: RunState, reason: str, *, step: int | None, host: str | None = None, lost: bool = False
    ) -> None:
        """Write the event of the job's end by ``state`` (``failed``, ``stopped``, ``cancelled``), as ``failed`` does."""
        type_ = state.value
        fields = EndFields(reason=reason)
        if step is not None:
            fields["step"] = step
        if host is not None:
            fields["host"] = host
        if lost:
            fields["lost"] = True
        try:
            self.emit(type_, **fields)
        except OSError as e:
            # A full disk: other writers race for any space freed, so the event goes into blocks held for it.
            try:
                if e.errno != errno.ENOSPC:
                    raise
                self.emit_in(RDV_EVENT_RESERVE, type_, **fields)
            except (OSError, NotFound) as e2:
                log.warning("could not write the %s event (%s): %s", type_, host or self.source, e2)

    def keys(self, after_key: str | None = None) -> list[str]:
        return [k for k in self.store.list(EVENTS) if k.endswith(".json") and (after_key is None or k > after_key)]

    def get(self, keys: list[str], types: tuple[str, ...] | None = None) -> list[Event]:
        """The events of ``keys`` (each with its ``_key``), of ``types`` if given; keys gone since are left out."""
        events = []
        for key in keys:
            try:
                ev = cast(Event, json.loads(self.store.get(key)))
            except NotFound:  # pruned between list and get
                continue
            ev["_key"] = key
            if types is None or ev["type"] in types:
                events.append(ev)
        return events

    def newest_key(self) -> str | None:
        keys = self.keys()
        return max(keys) if keys else None

    def read(self, types: tuple[str, ...] | None = None, after_key: str | None = None) -> list[Event]:
        return self.get(self.keys(after_key), types)


# An event's name is stamped before it is stored, so one may land after events stamped later (a slow
# upload, a retried write, a host whose clock is behind): a reader that goes on from the newest name it
# saw looks again this far back for such late events.
LATE_S = 120.0


def floor_key(key: str, margin_s: float = LATE_S) -> str:
    """The event name ``margin_s`` before ``key``'s stamp: events listed after it include the late ones."""
    ns = int(key[len(EVENTS) :].split("-", 1)[0]) - int(margin_s * 1e9)
    return f"{EVENTS}{max(ns, 0):020d}"


class EventReader:
    """Runs' events, each read once across looks: the reader keeps what it read and reads only new names.

    Event objects are write-once with names that sort in time order of their stamps; each look lists
    from :data:`LATE_S` before the newest name seen, so an event that landed late is not missed. A
    run not looked at for ``ttl_s`` is read again from its start (a run deleted and started over under
    the same name); at most ``size`` runs are kept. Safe to share between threads.
    """

    def __init__(self, size: int = 32, ttl_s: float = 300.0) -> None:
        self.size, self.ttl_s = size, ttl_s
        self._runs: OrderedDict[str, tuple[float, list[Event]]] = OrderedDict()  # uri -> (last look, events)
        self._lock = threading.Lock()

    def read(self, run_uri: str) -> list[Event]:
        """Every event of the run at ``run_uri`` so far, in order (each with its ``_key``)."""
        with self._lock:
            seen, kept = self._runs.get(run_uri, (time.monotonic(), []))
        if time.monotonic() - seen > self.ttl_s:
            kept = []
        log = EventLog(open_store(run_uri))
        floor = floor_key(kept[-1]["_key"]) if kept else None
        have = {e["_key"] for e in kept if floor is None or e["_key"] > floor}
        new = log.get([k for k in log.keys(floor) if k not in have])
        events = sorted(kept + new, key=lambda e: str(e["_key"])) if new else kept
        with self._lock:
            self._runs[run_uri] = (time.monotonic(), events)
            self._runs.move_to_end(run_uri)
            while len(self._runs) > self.size:
                self._runs.popitem(last=False)
        return events


class RunStatus(TypedDict, total=False):
    """``status.json``: the run's state as its job's leader (or the local slice, or a repair) last wrote it."""

    updated_at: float
    state: str  # a RunState
    phase: str
    run_uri: str
    job: str
    leader: str
    reason: str
    step: int
    steps_total: int
    loss: float | None
    tokens_per_s: float
    latest_committed: int
    failures: int
    hosts_alive: list[str]
    started_at: float
    workers: int
    mesh: dict[str, int]
    members: list[str]
    round: int
    available: int
    waiting_since: float


def write_status(store: Store, **fields: Any) -> RunStatus:
    import time

    state = fields.get("state")
    if state not in {s.value for s in RunState}:
        raise EventError(f"unknown state {state!r}")
    doc = {"updated_at": time.time(), **fields}
    store.put(STATUS, json.dumps(doc, sort_keys=True, indent=1, default=str).encode())
    return cast(RunStatus, doc)


def read_status(store: Store) -> RunStatus | None:
    import time

    for attempt in range(5):
        try:
            return cast(RunStatus, json.loads(store.get(STATUS)))
        except NotFound:
            return None
        except ValueError:  # caught mid-rewrite (an in-place write on a full disk): read again
            if attempt == 4:
                raise
            time.sleep(0.05)
    return None
