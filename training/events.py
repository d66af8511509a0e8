"""Typed event records and the status document of a run.

Events are write-once JSON objects under ``<run>/events/`` whose names sort in
time order (``<time_ns>-<source>-<nonce>.json``), so a log is built without
appends and reads the same on a local path and on GCS.  ``status.json`` is one
object replaced whole, so a reader never sees half of it.

Nothing downstream parses human log lines: sensors, the CLI, reports and the
benchmark read these records.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any

from training.storage import Store

# Every event type and the fields it must carry (more are allowed).
EVENT_TYPES: dict[str, tuple[str, ...]] = {
    "launch": ("attempt", "workers", "mesh"),
    "worker_started": ("attempt", "process_id"),
    "restore": ("step", "mesh", "seconds"),
    "init": ("step", "mesh"),
    "compiled": ("step", "seconds"),
    "resumed": ("step",),
    "resumed_with": ("step", "next_batch", "lr_scale"),
    "data_refreshed": ("step", "old", "new"),
    "guard": ("step", "metric", "value", "reason"),
    "progress": ("step", "loss"),
    "checkpoint": ("step", "committed"),
    "failure": ("attempt", "reason"),
    "resize": ("old_workers", "new_workers", "old_mesh", "new_mesh"),
    "capacity": ("available",),
    "waiting_for_capacity": ("available", "min_workers"),
    "chaos": ("action",),
    "finished": ("step",),
    "failed": ("reason",),
    "rescale_requested": ("step", "workers"),
    "validation": ("step", "verdict"),
    "rollback": ("from_step", "to_step", "reason"),
    "prune": ("deleted", "kept"),
    "lock": ("owner",),
}

STATES = ("pending", "starting", "running", "recovering", "waiting_for_capacity", "finished", "failed")


class EventError(ValueError):
    pass


def make_event(type_: str, source: str, **fields: Any) -> dict[str, Any]:
    required = EVENT_TYPES.get(type_)
    if required is None:
        raise EventError(f"unknown event type {type_!r}")
    missing = [f for f in required if f not in fields]
    if missing:
        raise EventError(f"event {type_!r} lacks {missing}")
    return {"type": type_, "time": time.time(), "source": source, **fields}


class EventLog:
    def __init__(self, store: Store, source: str | None = None) -> None:
        self.store = store
        self.source = source or f"{socket.gethostname()}-{os.getpid()}"

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = make_event(type_, self.source, **fields)
        key = f"events/{time.time_ns():020d}-{self.source}-{uuid.uuid4().hex[:8]}.json"
        self.store.create(key, json.dumps(event, sort_keys=True).encode())
        return event

    def read(self, types: tuple[str, ...] | None = None, after_key: str | None = None) -> list[dict[str, Any]]:
        events = []
        for key in self.store.list("events/"):
            if not key.endswith(".json") or (after_key is not None and key <= after_key):
                continue
            ev = json.loads(self.store.get(key))
            ev["_key"] = key
            if types is None or ev["type"] in types:
                events.append(ev)
        return events


def write_status(store: Store, **fields: Any) -> dict[str, Any]:
    state = fields.get("state")
    if state not in STATES:
        raise EventError(f"unknown state {state!r}")
    doc = {"updated_at": time.time(), **fields}
    store.put("status.json", json.dumps(doc, sort_keys=True, indent=1).encode())
    return doc


def read_status(store: Store) -> dict[str, Any] | None:
    from training.storage import NotFound

    try:
        return dict(json.loads(store.get("status.json")))
    except NotFound:
        return None
