"""Names and stamps of write-once records.

Everything a run records (events, ledger entries, pins, lock generations,
rendezvous reports) is a write-once object whose name sorts in time order,
because GCS has neither an atomic rename nor an append.  These helpers make
the names: a wall-clock stamp that never repeats within a process, a short
nonce that keeps two processes' names apart, and who wrote the record.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any, Required, TypedDict

# A record's JSON object as read back, before its fields are checked (or a free-form one).
JSONObject = dict[str, Any]
# Metrics as a record keeps them, by name: a non-finite value as its text ("nan", "inf"), which JSON has no number for.
RecordedMetrics = dict[str, float | str]


class ResumeHow(TypedDict, total=False):
    """How the next launch resumes from a rollback's target: its learning-rate scale, and the batch it skips to."""

    lr_scale: Required[float]
    skip_to_batch: int


_clock_lock = threading.Lock()
_last_ns = 0


def stamp() -> int:
    """Wall-clock nanoseconds, strictly increasing within this process.

    Two records written back to back must not tie: their order *is* the log.
    """
    global _last_ns
    with _clock_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return _last_ns


def nonce() -> str:
    return uuid.uuid4().hex[:8]


class Writer(TypedDict):
    """Who wrote a record."""

    host: str
    pid: int


def whoami() -> Writer:
    """The writer of a record: host name and process id."""
    return Writer(host=socket.gethostname(), pid=os.getpid())


def iso(t: float) -> str:
    """A UTC time for messages people read."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
