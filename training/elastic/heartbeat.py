"""One host's heartbeat: its record on the rendezvous, changed by its agent and written by a thread of its own."""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

from training.elastic.rendezvous import HostRecord, Rendezvous

log = logging.getLogger("rtrain.agent")


class Heartbeat:
    """A host's record (where it is, its state, its step) and the thread that writes it every ``every_s``.

    A change asked to be written now wakes the thread; a newer record is never overwritten by an older one.
    """

    def __init__(self, rdv: Rendezvous, record: HostRecord, every_s: float) -> None:
        self.rdv = rdv
        self.record = record
        self.every_s = every_s
        self._lock = threading.Lock()  # the record
        self._write_lock = threading.Lock()  # one write at a time
        self._wake = threading.Event()
        self._stop = threading.Event()

    def update(self, now: bool = True, **fields: Any) -> None:
        """Change the record; write it now (else with the next beat)."""
        with self._lock:
            for k, v in fields.items():
                setattr(self.record, k, v)
        if now:
            self._wake.set()

    def beat(self) -> None:
        """Write the record now; a store that fails is tried again at the next beat."""
        with self._write_lock:
            with self._lock:
                self.record.seq += 1
                self.record.time = time.time()
                rec = copy.copy(self.record)
            try:
                self.rdv.beat(rec)
            except Exception as e:  # noqa: BLE001 - a store hiccup: the next beat tries again
                log.warning("[%s] heartbeat failed: %s", rec.host, e)

    def start(self) -> None:
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.beat()
            self._wake.wait(self.every_s)
            self._wake.clear()

    def last(self, state: str) -> None:
        """Stop beating and write the record once more with its final ``state`` (``leaving``, ``gone``)."""
        self._stop.set()
        self._wake.set()
        self.update(now=False, state=state)
        self.beat()
