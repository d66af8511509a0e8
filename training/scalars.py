"""Step-indexed training scalars as TensorBoard event files under the run root.

The host agent (the one writer) calls :meth:`ScalarLog.add` each step and :meth:`ScalarLog.flush`
every few seconds; each flush writes one new file (GCS objects cannot be appended to), named
``<run>/tensorboard/<subdir>/events.out.tfevents.<s>.<ns>.<host>.<nonce>`` (zero-padded stamps).
TensorBoard reads them in name order, which is write order: the stamp increases within a process,
and a new writer stays past the newest name it lists, even on a slower clock.  Each start (a new
log's first step, a resume by :meth:`ScalarLog.restart`, a step going back) writes a START
``session_log`` at its step S, and TensorBoard's accumulators drop every value at steps >= S.
Its fast data server (``--load_fast``) ignores that and drops a tag's later values only when the
tag is logged again, so a tag that never comes back past S keeps stale points there, on that path
only.

The ``tensorboard`` package writes without TensorFlow (the tests read with the UI's purge rules, so they
check what people see); it is imported on first flush.  No JAX: the agent imports this module.
"""

from __future__ import annotations

import io
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from training.records import nonce, stamp
from training.storage import AlreadyExists, LocalStore, Store, join, open_store

TENSORBOARD = "tensorboard"  # <run>/tensorboard/<subdir>/: one TensorBoard run per subdir
FILE_VERSION = "brain.Event:2"  # turns on TensorBoard's SessionLog.START purge (event_accumulator.py)
_PREFIX = "events.out.tfevents."
_NAME = re.compile(r"events\.out\.tfevents\.(\d{10})\.(\d{9})\.")
_SUBDIR = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass
class _Start:
    """A session (re)starts at ``step``: the readers drop what was written at steps >= it."""

    step: int
    wall_time: float


@dataclass
class _Scalars:
    step: int
    wall_time: float
    values: dict[str, float] = field(default_factory=dict)


def logdir(run_uri: str) -> str:
    """What to give ``tensorboard --logdir``: ``<run>/tensorboard`` (a local path or ``gs://``)."""
    return join(run_uri, TENSORBOARD)


def _check_subdir(subdir: str) -> str:
    if not _SUBDIR.fullmatch(subdir) or subdir.startswith(".."):
        raise ValueError(f"invalid TensorBoard subdir {subdir!r}")
    return subdir


def _safe(host: str | int) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", str(host)) or "host"


class ScalarLog:
    """One writer of one TensorBoard run (``<run>/tensorboard/<subdir>``).

    ``add``/``restart`` only append to memory; ``flush`` encodes what is pending
    into one new event file.  Thread-safe: steps may be added while another
    thread flushes.  Values are stored as TensorBoard scalars (``simple_value``,
    float32), which every TensorBoard-reading tool understands.
    """

    def __init__(self, run_uri: str, host: str | int, subdir: str = "train", *, store: Store | None = None) -> None:
        self.run_uri = run_uri
        self.subdir = _check_subdir(subdir)
        self.host = _safe(host)
        self._store = store
        self._dir = f"{TENSORBOARD}/{self.subdir}/"
        self._nonce = nonce()
        self._lock = threading.Lock()  # the pending records and the step bookkeeping
        self._flush_lock = threading.Lock()  # one flush at a time, so files keep their order
        self._pending: list[_Start | _Scalars] = []
        self._started = False
        self._floor = 0  # a step below this rewinds (a restart)
        self._last_step: int | None = None  # the latest step recorded, and all its values
        self._last_values: dict[str, float] = {}
        self._last_written = False  # part of the latest step is in a file already
        self._last_ns: int | None = None  # the stamp of the newest file name (None: not listed yet)
        self.files_written = 0

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self.run_uri)
        return self._store

    def add(self, step: int, values: Mapping[str, float], wall_time: float | None = None) -> None:
        """Record ``values`` (tag -> number) for ``step``; nothing is written until :meth:`flush`.

        Another ``add`` for the same step merges into it (new tags join it; a tag
        given again replaces its value).  A step below the previous one is a
        restart there (see :meth:`restart`).
        """
        if step < 0:
            raise ValueError(f"negative step {step}")
        vals = {str(k): float(v) for k, v in values.items()}
        if not vals:
            return
        wt = time.time() if wall_time is None else float(wall_time)
        with self._lock:
            if not self._started or (step < self._floor and step != self._last_step):
                self._restart(step, wt)
            if step == self._last_step:
                merged = {**self._last_values, **vals}
                last = self._pending[-1] if self._pending else None
                if not self._last_written and isinstance(last, _Scalars) and last.step == step:
                    last.values.update(vals)
                elif self._last_values.keys() & vals.keys():
                    # A value already in a file is replaced: restart at this step, write the step whole.
                    self._restart(step, wt)
                    self._pending.append(_Scalars(step, wt, dict(merged)))
                else:
                    self._pending.append(_Scalars(step, wt, vals))
                self._last_step, self._last_values = step, merged
            else:
                self._pending.append(_Scalars(step, wt, dict(vals)))
                self._last_step, self._last_values, self._last_written = step, dict(vals), False
            self._floor = step + 1

    def restart(self, step: int) -> None:
        """Training (re)starts at ``step``: every value written for steps >= ``step`` is superseded.

        Call it on each resume (a restart, a resize, a rollback to an older
        checkpoint).  Pending values at those steps are dropped at once; those
        already written are dropped by TensorBoard when it reads the START event.
        """
        if step < 0:
            raise ValueError(f"negative step {step}")
        with self._lock:
            self._restart(step, time.time())

    def _restart(self, step: int, wall_time: float) -> None:
        self._pending = [r for r in self._pending if r.step < step]
        self._pending.append(_Start(step, wall_time))
        self._started = True
        self._floor = step
        self._last_step, self._last_values, self._last_written = None, {}, False

    @property
    def pending(self) -> int:
        """How many records (steps and restarts) wait for the next flush."""
        with self._lock:
            return len(self._pending)

    def flush(self) -> int:
        """Write what is pending as one new event file; return the number of objects written (0 or 1)."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, []
                if not batch:
                    return 0
                if any(isinstance(r, _Scalars) and r.step == self._last_step for r in batch):
                    self._last_written = True
            try:
                self._write(_encode(batch))
            except BaseException:
                with self._lock:  # keep them for the next flush, ahead of what came since
                    self._pending = batch + self._pending
                raise
            self.files_written += 1
            return 1

    def _write(self, data: bytes) -> None:
        store = self.store
        if self._last_ns is None:
            self._last_ns = max((_stamp_of(k) for k in store.list(self._dir)), default=0)
        for _ in range(5):
            ns = max(stamp(), self._last_ns + 1)
            self._last_ns = ns
            name = f"{_PREFIX}{ns // 10**9:010d}.{ns % 10**9:09d}.{self.host}.{self._nonce}"
            try:
                if isinstance(store, LocalStore):
                    if store.exists(self._dir + name):
                        continue
                    # LocalStore writes through a temporary ".<name>.XXXX" file, which TensorBoard would
                    # read too (it takes any name containing "tfevents"): stage under a name it skips.
                    staging = f"{self._dir}.staging-{self._nonce}-{ns}"
                    store.put(staging, data)
                    store.move(staging, self._dir + name)
                else:
                    store.create(self._dir + name, data)  # one upload: atomic, write-once
                return
            except AlreadyExists:
                continue
        raise AlreadyExists(f"no free event file name under {store.child(self._dir)}")


def _stamp_of(key: str) -> int:
    m = _NAME.match(key.rsplit("/", 1)[-1])
    return int(m.group(1)) * 10**9 + int(m.group(2)) if m else 0


def _encode(batch: list[_Start | _Scalars]) -> bytes:
    """One event file: the file_version event, then each record, TFRecord-framed by TensorBoard's writer."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    buf = io.BytesIO()
    writer = RecordWriter(buf)
    writer.write(event_pb2.Event(wall_time=batch[0].wall_time, file_version=FILE_VERSION).SerializeToString())
    for r in batch:
        if isinstance(r, _Start):
            event = event_pb2.Event(
                wall_time=r.wall_time, step=r.step, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            )
        else:
            summary = summary_pb2.Summary(
                value=[summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in sorted(r.values.items())]
            )
            event = event_pb2.Event(wall_time=r.wall_time, step=r.step, summary=summary)
        writer.write(event.SerializeToString())
    return buf.getvalue()
