"""One host's heartbeat: its record on the rendezvous, changed by its agent and written by a thread of its own."""

from __future__ import annotations

import copy
import logging
import os
import re
import socket
import threading
import time
from typing import Any

from training.elastic.rendezvous import HostRecord, Rendezvous

log = logging.getLogger("rtrain.agent")

HOST_RE = re.compile(r"^(?:s(?P<slice>\d+)-)?h(?P<index>\d+)$")


def slice_and_index(host: str, hosts_per_slice: int) -> tuple[int, int]:
    """``h5`` -> (5 // hosts_per_slice, 5 % hosts_per_slice); ``s2-h1`` -> (2, 1)."""
    m = HOST_RE.match(host)
    if not m:
        raise ValueError(f"host id {host!r} is not h<N> or s<slice>-h<N>")
    i = int(m["index"])
    if m["slice"] is not None:
        return int(m["slice"]), i
    return i // hosts_per_slice, i % hosts_per_slice


def first_record(host: str, job: str, hosts_per_slice: int, coordinator: str, started: float, watch: str) -> HostRecord:
    """An agent's heartbeat record before its first beat: where it is, how to reach it."""
    slice_, index = slice_and_index(host, hosts_per_slice)
    return HostRecord(
        host=host,
        job=job,
        slice=slice_,
        index=index,
        seq=0,
        time=time.time(),
        pid=os.getpid(),
        node=socket.gethostname(),
        coordinator=coordinator,
        started=started,
        watch=watch,
    )


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
