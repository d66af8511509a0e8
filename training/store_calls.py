"""What every store call goes through first: this process's tally of them, and trouble injected by chaos.

The tally (``RTRAIN_STORE_OPS``) is what ``rtrain bench`` counts the control plane's requests with; a
disturbance (``training.storage.disturb``) makes the calls under one root wait, or fail as that storage
fails when it cannot be reached.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OPS_ENV = "RTRAIN_STORE_OPS"  # a directory: every process counts its store calls there (``rtrain bench``)


class OpTally:
    """This process's store calls, by operation and by the key's first part, kept in one file.

    The file (``<dir>/<pid>.json``: ``{"role": program, "time": when, "counts": {"op area": n}}``,
    cumulative) is replaced by a call that comes a second or more after the last
    replacement, and at the process's normal exit. A tally that cannot be written
    is given up quietly: counting never fails a store call.
    """

    def __init__(self, sink: Path) -> None:
        self.pid = os.getpid()
        self.path = sink / f"{self.pid}.json"
        self.role = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "python"
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._written = 0.0
        atexit.register(self.write)

    def count(self, op: str, key: str) -> None:
        area = key.strip("/").split("/", 1)[0] or "."
        with self._lock:
            name = f"{op} {area}"
            self.counts[name] = self.counts.get(name, 0) + 1
            due = time.monotonic() - self._written >= 1.0
        if due:
            self.write()

    def write(self) -> None:
        with self._lock:
            self._written = time.monotonic()
            doc = json.dumps({"role": self.role, "time": time.time(), "counts": self.counts})
            tmp = self.path.with_name(f".{self.path.name}.{threading.get_ident()}.tmp")
            try:
                tmp.write_text(doc)
                os.replace(tmp, self.path)
            except OSError:
                pass


_TALLY: OpTally | None = None


def _tally() -> OpTally | None:
    """This process's tally when ``RTRAIN_STORE_OPS`` names a directory (read once per process: a fork counts anew)."""
    global _TALLY
    if _TALLY is None or _TALLY.pid != os.getpid():
        sink = os.environ.get(OPS_ENV)
        if not sink:
            return None
        Path(sink).mkdir(parents=True, exist_ok=True)
        _TALLY = OpTally(Path(sink))
    return _TALLY


@dataclass
class _Disturbance:
    """Injected trouble with a store root (chaos): until when, and how (a delay, else its storage's failure)."""

    root: str = ""
    until: float = 0.0
    latency_s: float = 0.0
    unreachable: Callable[[str, str], Exception] | None = None  # the error a call under the root raises


_DISTURBANCE = _Disturbance()


def disturb_calls(root: str, for_s: float, latency_s: float, unreachable: Callable[[str, str], Exception]) -> None:
    """For ``for_s`` seconds, every call of this process to a store at or under ``root`` (a root URI as stores
    name theirs) waits ``latency_s``, or without one raises ``unreachable(op, key)``."""
    _DISTURBANCE.root = root
    _DISTURBANCE.until = time.monotonic() + for_s
    _DISTURBANCE.latency_s = latency_s
    _DISTURBANCE.unreachable = unreachable


def before_call(op: str, key: str, uri: str) -> None:
    """Before each call to the store at ``uri``: count it (``RTRAIN_STORE_OPS``), and carry out an injected
    disturbance."""
    tally = _tally()
    if tally is not None:
        tally.count(op, key)
    d = _DISTURBANCE
    if d.until and time.monotonic() < d.until and (uri == d.root or uri.startswith(d.root + "/")):
        if d.latency_s:
            time.sleep(d.latency_s)
        elif d.unreachable is not None:
            raise d.unreachable(op, key)
