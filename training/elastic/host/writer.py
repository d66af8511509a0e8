"""The agent's writer: one thread that makes the agent's writes to the run root, in order.

The agent's main loop never waits for the store: reports, events, scalars and manifests go
through here.  A write the run root refuses for now is tried again (up to a bound) while the
agent runs; once it is closing, what is still queued is tried once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from training.storage import is_transient

log = logging.getLogger("rtrain.agent")

WRITE_RETRY_S = 120.0  # a write the run root refused for now is tried again this long


class Writer:
    """A queue of writes and the thread that makes them."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.closing = threading.Event()
        self._jobs: queue.Queue[Callable[[], object] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, job: Callable[[], object]) -> None:
        """Make ``job`` after every write queued before it."""
        self._jobs.put(job)

    def close(self, timeout: float = 30.0) -> None:
        """Make what is queued (each tried once more), then stop."""
        self.closing.set()
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    def until_written(self, write: Callable[[], object]) -> None:
        """Write; a run root that fails for now is tried again (up to WRITE_RETRY_S, unless closing)."""
        give_up = time.monotonic() + WRITE_RETRY_S
        while True:
            try:
                write()
                return
            except Exception as e:
                if not is_transient(e) or time.monotonic() > give_up or self.closing.is_set():
                    raise
                time.sleep(0.5)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception as e:  # noqa: BLE001 - logged; the next write goes on
                log.warning("[%s] a background write failed: %s", self.host, e)
