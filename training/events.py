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

import json
import os
import socket
from enum import StrEnum
from typing import Any, NotRequired, TypedDict

from training.layout import EVENTS, STATUS
from training.records import nonce, stamp
from training.storage import NotFound, Store


class RunState(StrEnum):
    """The state of a run as ``status.json`` says it."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    WAITING_FOR_CAPACITY = "waiting_for_capacity"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def alive(self) -> bool:
        return self not in (RunState.FINISHED, RunState.FAILED)


ALIVE_STATES: frozenset[str] = frozenset(s.value for s in RunState if s.alive)
FINAL_STATES: frozenset[str] = frozenset(s.value for s in RunState if not s.alive)


class EventType(StrEnum):
    LAUNCH = "launch"  # the leader opened a round: workers, mesh, members
    WORKER_STARTED = "worker_started"
    RESTORE = "restore"
    INIT = "init"
    COMPILED = "compiled"
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
    CHAOS = "chaos"
    FINISHED = "finished"
    FAILED = "failed"
    RESCALE_REQUESTED = "rescale_requested"
    VALIDATION = "validation"
    ROLLBACK = "rollback"
    PRUNE = "prune"
    LOCK = "lock"
    LEADER = "leader"  # an agent became the job's leader
    HOST_JOINED = "host_joined"
    HOST_LOST = "host_lost"
    CONFIG = "config"  # config.json written (by whom, what changed)


# Every event type and the fields it must carry (more are allowed).
REQUIRED: dict[EventType, tuple[str, ...]] = {
    EventType.LAUNCH: ("attempt", "workers", "mesh"),
    EventType.WORKER_STARTED: ("attempt", "process_id"),
    EventType.RESTORE: ("step", "mesh", "seconds"),
    EventType.INIT: ("step", "mesh"),
    EventType.COMPILED: ("step", "seconds"),
    EventType.RESUMED: ("step",),
    EventType.RESUMED_WITH: ("step", "next_batch", "lr_scale"),
    EventType.DATA_REFRESHED: ("step", "old", "new"),
    EventType.GUARD: ("step", "metric", "value", "reason"),
    EventType.PROGRESS: ("step", "loss"),
    EventType.CHECKPOINT: ("step", "committed"),
    EventType.CHECKPOINT_CORRUPT: ("step", "reason"),
    EventType.FAILURE: ("attempt", "reason"),
    EventType.RESIZE: ("old_workers", "new_workers", "old_mesh", "new_mesh"),
    EventType.CAPACITY: ("available",),
    EventType.WAITING_FOR_CAPACITY: ("available", "min_workers"),
    EventType.CHAOS: ("action",),
    EventType.FINISHED: ("step",),
    EventType.FAILED: ("reason",),
    EventType.RESCALE_REQUESTED: ("step", "workers"),
    EventType.VALIDATION: ("step", "verdict"),
    EventType.ROLLBACK: ("from_step", "to_step", "reason"),
    EventType.PRUNE: ("deleted", "kept"),
    EventType.LOCK: ("owner",),
    EventType.LEADER: ("host", "job"),
    EventType.HOST_JOINED: ("host",),
    EventType.HOST_LOST: ("host", "reason"),
    EventType.CONFIG: ("by",),
}
EVENT_TYPES: frozenset[str] = frozenset(t.value for t in EventType)


class Event(TypedDict):
    """What every event carries; the rest are the fields of its type (``REQUIRED`` and more)."""

    type: str
    time: float
    source: str
    _key: NotRequired[str]  # the object's name, added when read (a cursor for "events after this one")


class EventError(ValueError):
    pass


def make_event(type_: str, source: str, time_s: float, **fields: Any) -> dict[str, Any]:
    try:
        kind = EventType(type_)
    except ValueError:
        raise EventError(f"unknown event type {type_!r}") from None
    missing = [f for f in REQUIRED[kind] if f not in fields]
    if missing:
        raise EventError(f"event {type_!r} lacks {missing}")
    return {"type": kind.value, "time": time_s, "source": source, **fields}


class EventLog:
    """The run's events: ``emit`` writes one write-once object, ``read`` lists them in time order."""

    def __init__(self, store: Store, source: str | None = None) -> None:
        self.store = store
        self.source = source or f"{socket.gethostname()}-{os.getpid()}"

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        ns = stamp()
        event = make_event(type_, self.source, ns / 1e9, **fields)
        key = f"{EVENTS}{ns:020d}-{self.source}-{nonce()}.json"
        self.store.create(key, json.dumps(event, sort_keys=True, default=str).encode())
        return event

    def keys(self, after_key: str | None = None) -> list[str]:
        return [k for k in self.store.list(EVENTS) if k.endswith(".json") and (after_key is None or k > after_key)]

    def newest_key(self) -> str | None:
        keys = self.keys()
        return max(keys) if keys else None

    def read(self, types: tuple[str, ...] | None = None, after_key: str | None = None) -> list[dict[str, Any]]:
        events = []
        for key in self.keys(after_key):
            try:
                ev = json.loads(self.store.get(key))
            except NotFound:  # pruned between list and get
                continue
            ev["_key"] = key
            if types is None or ev["type"] in types:
                events.append(ev)
        return events


def write_status(store: Store, **fields: Any) -> dict[str, Any]:
    import time

    state = fields.get("state")
    if state not in {s.value for s in RunState}:
        raise EventError(f"unknown state {state!r}")
    doc = {"updated_at": time.time(), **fields}
    store.put(STATUS, json.dumps(doc, sort_keys=True, indent=1, default=str).encode())
    return doc


def read_status(store: Store) -> dict[str, Any] | None:
    import time

    for attempt in range(5):
        try:
            return dict(json.loads(store.get(STATUS)))
        except NotFound:
            return None
        except ValueError:  # caught mid-rewrite (an in-place write on a full disk): read again
            if attempt == 4:
                raise
            time.sleep(0.05)
    return None


# --- one sentence per event type, for people --------------------------------------------------


def _mesh(m: Any) -> str:
    if not isinstance(m, dict) or not m:
        return "-"
    return " x ".join(f"{k}{v}" for k, v in m.items() if v != 1 or k == "data") or "-"


def _num(x: Any, fmt: str = ".4f") -> str:
    return format(x, fmt) if isinstance(x, int | float) else str(x)


def describe(ev: dict[str, Any]) -> str:
    """One readable sentence for any event (``rtrain events``, Airflow task logs)."""
    t = ev.get("type")
    g = ev.get
    if t == "launch":
        round_ = f"round {g('round')}: " if g("round") is not None else ""
        resume = g("resume")
        start = "from scratch" if resume in ("none",) else f"resuming from {resume}" if resume else ""
        return f"{round_}{g('workers')} hosts, mesh {_mesh(g('mesh'))} {start}".rstrip()
    if t == "worker_started":
        return f"worker {g('process_id')} of attempt {g('attempt')} started in {_num(g('seconds') or 0, '.2f')}s"
    if t == "restore":
        return f"restored step {g('step')} on mesh {_mesh(g('mesh'))} in {_num(g('seconds') or 0, '.2f')}s"
    if t == "init":
        return f"initialised a new model on mesh {_mesh(g('mesh'))}"
    if t == "compiled":
        return f"compiled the train step in {_num(g('seconds') or 0, '.2f')}s"
    if t == "resumed":
        return f"training at step {g('step')}"
    if t == "resumed_with":
        return f"resuming at batch {g('next_batch')} with learning-rate scale {_num(g('lr_scale'), 'g')}"
    if t == "data_refreshed":
        return f"dataset changed at step {g('step')}: the data position restarts on the new data"
    if t == "guard":
        return f"in-training guard at step {g('step')}: {g('reason')}"
    if t == "progress":
        tps = g("tokens_per_s")
        return f"step {g('step')}: loss {_num(g('loss'))}" + (
            f", {tps:.0f} tok/s" if isinstance(tps, int | float) else ""
        )
    if t == "checkpoint":
        return f"checkpoint {g('step')} " + ("committed" if g("committed") else "being saved")
    if t == "checkpoint_corrupt":
        return f"checkpoint {g('step')} is corrupt ({g('reason')}); stepped over"
    if t == "failure":
        det = g("detect_s")
        return f"failure: {g('reason')}" + (f" (detected in {det:.2f}s)" if isinstance(det, int | float) else "")
    if t == "resize":
        return (
            f"resized {g('old_workers')} -> {g('new_workers')} hosts: mesh {_mesh(g('old_mesh'))} -> "
            f"{_mesh(g('new_mesh'))}"
        )
    if t == "capacity":
        return f"capacity is {g('available')} hosts" + (f" ({g('reason')})" if g("reason") else "")
    if t == "waiting_for_capacity":
        return f"waiting for capacity: {g('available')} hosts, need {g('min_workers')}"
    if t == "chaos":
        where = f" worker {g('worker')}" if g("worker") is not None else ""
        at = f" at step {g('step')}" if g("step") is not None else ""
        return f"chaos: {g('action')}{where}{at} ({g('spec')})"
    if t == "finished":
        return f"finished at step {g('step')}"
    if t == "failed":
        return f"the job failed: {g('reason')}"
    if t == "rescale_requested":
        return f"stopped at checkpoint {g('step')} to resize"
    if t == "validation":
        m = g("metrics") or {}
        loss = m.get("loss") if isinstance(m, dict) else None
        return f"validation of step {g('step')}: {g('verdict')}" + (f" (loss {_num(loss)})" if loss is not None else "")
    if t == "rollback":
        return f"rollback ({g('kind') or 'manual'}): step {g('from_step')} -> {g('to_step')}: {g('reason')}"
    if t == "prune":
        return f"pruned steps {g('deleted')}; kept {g('kept')}"
    if t == "lock":
        return f"run lock {g('action')} by {g('owner')}"
    if t == "leader":
        return f"host {g('host')} leads job {g('job')}" + (f" ({g('reason')})" if g("reason") else "")
    if t == "host_joined":
        return f"host {g('host')} joined"
    if t == "host_lost":
        return f"host {g('host')} lost: {g('reason')}"
    if t == "config":
        changed = g("changed") or []
        return f"config written by {g('by')}" + (f"; changed: {', '.join(map(str, changed))}" if changed else "")
    fields = {k: v for k, v in ev.items() if k not in ("type", "time", "source", "_key")}
    return f"{t}: " + ", ".join(f"{k}={v}" for k, v in fields.items())
