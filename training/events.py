"""Typed event records, the run's states and its status document.

Events are write-once JSON objects under ``<run>/events/`` whose names sort in
time order (``<time_ns>-<source>-<nonce>.json``), so a log is built without
appends and reads the same on a local path and on GCS.  ``status.json`` is one
object replaced whole, so a reader never sees half of it; its one writer is
the job's leader.

Nothing downstream parses human log lines: sensors, the CLI, reports and the
benchmark read these records.  :func:`describe` gives each event type one
sentence for people (task logs, ``rtrain events``).
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
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Required, TypedDict, cast

from training.layout import EVENTS, RDV_EVENT_RESERVE, STATUS
from training.records import RecordedMetrics, nonce, stamp
from training.storage import NotFound, Store, open_store

if TYPE_CHECKING:
    from training.checkpoint.ledger import ResumeHow

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


# --- one sentence per event type, for people --------------------------------------------------


def mesh_text(m: Any) -> str:
    """A mesh by the axes that split something: ``data4 x fsdp2``."""
    if not isinstance(m, Mapping) or not m:
        return "-"
    return " x ".join(f"{k}{v}" for k, v in m.items() if v != 1 or k == "data") or "-"


def _num(x: Any, fmt: str = ".4f") -> str:
    return format(x, fmt) if isinstance(x, int | float) and not isinstance(x, bool) else str(x)


def duration(x: Any) -> str:
    """A duration people read: ``0.42s``, ``12.3s``, ``3m12s``, ``1h05m`` (``-`` for none)."""
    if x is None:
        return "-"
    if not isinstance(x, int | float) or isinstance(x, bool):
        return str(x)
    if x < 10:
        return f"{x:.2f}s"
    if x < 60:
        return f"{x:.1f}s"
    s = round(x)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _steps(x: Any) -> str:
    """A list of steps (``10, 20``) or ``none``."""
    if isinstance(x, list | tuple):
        return ", ".join(str(s) for s in x) if x else "none"
    return str(x)


def _plural(n: Any, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def readable(value: Any, sep: str = "; ") -> str:
    """Any value as text people read (no Python reprs).

    Mappings as ``key value`` pairs (underscores as spaces) joined by ``sep``, nested ones by ``", "``;
    lists joined by ``", "``; floats to 4 significant digits.
    """
    if isinstance(value, Mapping):
        return sep.join(f"{str(k).replace('_', ' ')} {readable(v, ', ')}" for k, v in value.items()) or "-"
    if isinstance(value, list | tuple):
        return ", ".join(readable(v, ", ") for v in value) or "none"
    if isinstance(value, float):
        return format(value, ".4g")
    return "-" if value is None else str(value)


def _launch(g: Any) -> str:
    rnd = g("round") if g("round") is not None else g("attempt")
    why = f" ({g('reason')})" if g("reason") else ""
    resume = str(g("resume") or "")
    start = {
        "": "",
        "none": ", from scratch",
        "latest": ", from the newest committed checkpoint (if any)",
    }.get(resume, f", from step {resume}")
    return f"round {rnd}{why}: {_plural(g('workers'), 'host')}, mesh {mesh_text(g('mesh'))}{start}"


def _worker_started(g: Any) -> str:
    on = f" on host {g('host')}" if g("host") else ""
    took = f" in {duration(g('seconds'))}" if g("seconds") is not None else ""
    return f"worker {g('process_id')} of round {g('attempt')} started{on}{took}"


def _restore(g: Any) -> str:
    hosts = f" ({_plural(g('workers'), 'host')})" if g("workers") is not None else ""
    return f"restored checkpoint {g('step')} onto mesh {mesh_text(g('mesh'))}{hosts} in {duration(g('seconds'))}"


def _init(g: Any) -> str:
    took = f" in {duration(g('seconds'))}" if g("seconds") is not None else ""
    return f"initialised a new model on mesh {mesh_text(g('mesh'))}{took}"


def _compiled(g: Any) -> str:
    if g("compile_s") is None:  # compiled after the restore, not alongside it
        return f"compiled the train step in {duration(g('seconds'))}"
    return f"compiled the train step in {duration(g('compile_s'))}, {duration(g('seconds'))} of it after the restore"


def _resumed(g: Any) -> str:
    step = g("step")
    into = f", {duration(g('seconds'))} into the round" if g("seconds") is not None else ""
    if isinstance(step, int) and step <= 1:
        return f"training started: step {step} done{into}"
    return f"training resumed: step {step} done{into}"


def _resumed_with(g: Any) -> str:
    skipped = g("skipped") or []
    ranges = ", ".join(f"{r[0]}-{r[1]}" for r in skipped if isinstance(r, list | tuple) and len(r) == 2)
    return (
        f"resuming at step {g('step')} from batch {g('next_batch')} with learning-rate scale {_num(g('lr_scale'), 'g')}"
        + (f"; batches {ranges} skipped" if ranges else "")
    )


def _data_refreshed(g: Any) -> str:
    old, new = (str(g(k) or "-")[:12] for k in ("old", "new"))
    return f"dataset changed at step {g('step')} ({old} -> {new}): the data position restarts on the new data"


def _progress(g: Any) -> str:
    """``step 120/300 (40%), loss 2.3141, 5400 tok/s, ETA 3m12s, 4 workers, mesh data4 x fsdp2``.

    A progress event carries step, loss and tokens_per_s; ``steps_total``, ``eta_s``, ``workers`` and
    ``mesh`` are added by a watcher that knows them (the run's status, its launches).
    """
    step, total = g("step"), g("steps_total")
    parts = [f"step {step}"]
    if isinstance(step, int) and isinstance(total, int) and total > 0:
        parts[0] += f"/{total} ({min(step / total, 1.0):.0%})"
    if g("loss") is not None:
        parts.append(f"loss {_num(g('loss'))}")
    tps = g("tokens_per_s")
    if isinstance(tps, int | float):
        parts.append(f"{tps:.0f} tok/s")
    if isinstance(g("eta_s"), int | float):
        parts.append(f"ETA {duration(g('eta_s'))}")
    if g("workers") is not None:
        parts.append(_plural(g("workers"), "worker"))
    if g("mesh"):
        parts.append(f"mesh {mesh_text(g('mesh'))}")
    return ", ".join(parts)


def _checkpoint(g: Any) -> str:
    if g("committed"):
        took = f" ({duration(g('write_s'))} after the save began)" if g("write_s") is not None else ""
        return f"checkpoint {g('step')} committed{took}"
    blocked = f" (training paused {duration(g('blocking_s'))})" if g("blocking_s") is not None else ""
    return f"saving checkpoint {g('step')}{blocked}"


LOST_PHASES = ("detect", "relaunch", "restore", "compile", "first_step", "replay")


def _lost(g: Any) -> str:
    """``; 5 steps lost, 15.2s out of training (detect 1.20s, relaunch 3.00s, ...)`` when the event says so."""
    out = f"; {_plural(g('steps_lost'), 'step')} lost" if g("steps_lost") is not None else ""
    lost = g("lost_s") if isinstance(g("lost_s"), dict) else {}
    if lost:
        phases = [p for p in LOST_PHASES if p in lost] + sorted(set(lost) - set(LOST_PHASES))
        total = g("seconds") if isinstance(g("seconds"), int | float) else None
        if total is None:
            total = sum(v for v in lost.values() if isinstance(v, int | float))
        out += (
            f"{', ' if out else '; '}{duration(total)} out of training ("
            + ", ".join(f"{p.replace('_', ' ')} {duration(lost[p])}" for p in phases)
            + ")"
        )
    return out


def _failure(g: Any) -> str:
    det, by = g("detect_s"), g("detected_by")
    how = (f" in {duration(det)}" if isinstance(det, int | float) else "") + (f" by the {by}" if by else "")
    return f"failure: {g('reason')}" + (f" (detected{how})" if how else "") + _lost(g)


def _recovered(g: Any) -> str:
    """The engine's account of a recovery (the first step after a failure or a preemption notice)."""
    out = f"recovered from {g('cause') or 'a failure'}"
    if g("step") is not None:
        out += f": training again at step {g('step')}"
    if g("tier"):
        out += f" (from the {g('tier')} checkpoint" + (f" {g('resume_step')})" if g("resume_step") is not None else ")")
    return out + _lost(g)


def _chaos(g: Any) -> str:
    where = f" worker {g('worker')}" if g("worker") is not None else ""
    to = f" to {_plural(g('to'), 'host')}" if g("to") is not None else ""
    at = f" at step {g('step')}" if g("step") is not None else ""
    spec = f" ({g('spec')})" if g("spec") else ""
    return f"chaos: {g('action')}{where}{to}{at}{spec}"


def _finished(g: Any) -> str:
    extra = []
    if g("failures") is not None:
        extra.append(f"{_plural(g('failures'), 'failure')} absorbed")
    if isinstance(g("seconds"), int | float):
        extra.append(f"{duration(g('seconds'))} in all")
    return f"finished at step {g('step')}" + (f" ({', '.join(extra)})" if extra else "")


def _validation(g: Any) -> str:
    if g("verdict") == "promoted":
        return f"checkpoint {g('step')} promoted"
    m = g("metrics") or {}
    loss = m.get("loss") if isinstance(m, dict) else None
    out = f"validation of step {g('step')}: {g('verdict')}" + (f" (loss {_num(loss)})" if loss is not None else "")
    return out + (f": {g('reason')}" if g("reason") else "")


def _rollback(g: Any) -> str:
    quarantined = g("quarantined") or []
    return f"rollback ({g('kind') or 'manual'}): step {g('from_step')} -> {g('to_step')}: {g('reason')}" + (
        f"; quarantined {_steps(quarantined)}" if quarantined else ""
    )


def _prune(g: Any) -> str:
    freed = g("bytes_freed")
    return f"pruned steps {_steps(g('deleted'))}; kept {_steps(g('kept'))}" + (
        f" ({freed / 2**20:.1f} MiB freed)" if isinstance(freed, int | float) and freed else ""
    )


def _lock(g: Any) -> str:
    action = g("action")
    if action == "takeover":
        how = " (handed over)" if g("handoff") else ""
        return f"run lock taken over by {g('owner')} from {g('previous_owner')}{how}"
    verb = {"acquire": "taken", "release": "released", None: "held"}.get(action, str(action))
    return f"run lock {verb} by {g('owner')}"


def _config(g: Any) -> str:
    changed = g("changed") or []
    job = f" for job {g('job')}" if g("job") else ""
    return f"config written by {g('by')}{job}" + (f"; changed: {', '.join(map(str, changed))}" if changed else "")


def _preemption_notice(g: Any) -> str:
    who = f"host {g('host')}" if g("host") else "a host"
    after = f" {duration(g('seconds'))} after the notice" if isinstance(g("seconds"), int | float) else ""
    if g("committed"):
        return f"{who} got a preemption notice: stopped at step {g('step')} and committed it{after}"
    at = f" at step {g('step')}" if g("step") is not None else ""
    return f"{who} got a preemption notice{at}: no checkpoint committed" + (
        f" ({g('reason')})" if g("reason") else after
    )


# An event's sentence, made from its fields (given the event's ``get``).
Sentence = Callable[[Callable[[str], Any]], str]
# Every event type the engine writes (``EventType``), and the ones being added, with its sentence.
SENTENCES: dict[str, Sentence] = {
    "launch": _launch,
    "worker_started": _worker_started,
    "restore": _restore,
    "init": _init,
    "compiled": _compiled,
    "compiled_ahead": lambda g: (
        f"the train step for {_plural(g('workers'), 'host')} is in the compilation cache already"
        if g("already")
        else f"compiled the train step for {_plural(g('workers'), 'host')} ahead, in {duration(g('seconds'))}"
    ),
    "resumed": _resumed,
    "resumed_with": _resumed_with,
    "data_refreshed": _data_refreshed,
    "guard": lambda g: f"in-training guard at step {g('step')}: {g('reason')}",
    "progress": _progress,
    "checkpoint": _checkpoint,
    "checkpoint_corrupt": lambda g: f"checkpoint {g('step')} is corrupt ({g('reason')}); stepped over",
    "failure": _failure,
    "resize": lambda g: (
        f"resized {g('old_workers')} -> {g('new_workers')} hosts: mesh {mesh_text(g('old_mesh'))} -> {mesh_text(g('new_mesh'))}"
    ),
    "capacity": lambda g: (
        f"capacity is {_plural(g('available'), 'host')}" + (f" ({g('reason')})" if g("reason") else "")
    ),
    "waiting_for_capacity": lambda g: (
        f"waiting for capacity: {_plural(g('available'), 'host')} available, at least {g('min_workers')} needed"
    ),
    "pods_waiting": lambda g: f"pods waiting: {g('reason')}" if g("reason") else "no pod waits any more",
    "chaos": _chaos,
    "finished": _finished,
    "failed": lambda g: f"the job failed: {g('reason')}" + (f" (at step {g('step')})" if g("step") is not None else ""),
    "stopped": lambda g: (
        f"the job was stopped: {g('reason')}"
        + (f" (at step {g('step')})" if g("step") is not None else "")
        + "; resumable from the newest committed checkpoint"
    ),
    "cancelled": lambda g: f"the run was cancelled before it started: {g('reason')}",
    "rescale_requested": lambda g: (
        f"stopped at checkpoint {g('step')} to resize"
        + (f" (on {_plural(g('workers'), 'host')})" if g("workers") else "")
    ),
    "validation": _validation,
    "evaluated": lambda g: (
        f"evaluated step {g('step')} on the job's mesh in {duration(g('seconds'))}: "
        + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, int | float) else f"{k} {v}" for k, v in (g("metrics") or {}).items()
        )
    ),
    "rollback": _rollback,
    "prune": _prune,
    "lock": _lock,
    "leader": lambda g: f"host {g('host')} leads job {g('job')}" + (f" ({g('reason')})" if g("reason") else ""),
    "host_joined": lambda g: f"host {g('host')} joined",
    "host_lost": lambda g: f"host {g('host')} lost: {g('reason')}",
    "config": _config,
    "preemption_notice": _preemption_notice,
    "recovered": _recovered,
    "local_tier_off": lambda g: (
        "local checkpoint tier off" + (f" on host {g('host')}" if g("host") else "") + f": {g('reason')}"
    ),
    "local_checkpoint": lambda g: f"host {g('host')} saved local checkpoint {g('step')} in {duration(g('seconds'))}",
    "local_checkpoint_skipped": lambda g: f"host {g('host')} skipped local checkpoint {g('step')}: {g('reason')}",
}


def describe(ev: Mapping[str, Any]) -> str:
    """One readable sentence for any event (``rtrain events``, Airflow task logs)."""
    t = ev.get("type")
    sentence = SENTENCES.get(str(t))
    if sentence is not None:
        return str(sentence(ev.get))
    fields = {k: v for k, v in ev.items() if k not in ("type", "time", "source", "_key")}
    return f"{t}: " + (readable(fields) if fields else "")
