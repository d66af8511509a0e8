"""The ledger of a run: each checkpoint's state, the resume pointer and pins.

Everything here is made of write-once objects (``Store.create``) with names
that sort in time order, because GCS has neither an atomic rename nor an
append (docs/architecture.md).  A local root and a gs:// root therefore behave
the same.  The run lock is in :mod:`training.checkpoint.lock`.

Layout under the run root::

    ledger/steps/<step:012d>/<time_ns:020d>-<state>-<nonce>.json   one record per state change
    ledger/pointer/<time_ns:020d>-<nonce>.json                     one record per pointer move
    ledger/pins/<step:012d>-<time_ns:020d>-<kind>-<nonce>.json     a job reading/writing a step

The current state of a step is its newest record; the pointer is the newest
pointer record.  Time order comes from the writer's wall clock (nanoseconds,
made strictly increasing within a process): writers on different machines are
ordered only as well as their clocks agree, which is plenty for state changes
that are minutes apart.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, Required, TypedDict, cast

from training.checkpoint.retention import USABLE_STATES, VALIDATED_STATES
from training.layout import LEDGER_PINS, LEDGER_POINTER, LEDGER_STEPS
from training.records import RecordedMetrics, ResumeHow, nonce, stamp, whoami
from training.storage import Store

# The states a checkpoint moves through.  "pruned" is written by prune() just
# before it deletes a step, so the ledger never claims a deleted step is usable;
# "corrupt" marks a step that failed its integrity check or its restore.
STATES: tuple[str, ...] = ("committed", "validated", "rejected", "quarantined", "promoted", "pruned", "corrupt")

__all__ = [
    "STATES",
    "USABLE_STATES",
    "VALIDATED_STATES",
    "Ledger",
    "CheckpointRecord",
    "PointerRecord",
    "pin",
    "unpin",
    "pinned",
    "pinned_steps",
]

STEPS_PREFIX = LEDGER_STEPS
POINTER_PREFIX = LEDGER_POINTER
PINS_PREFIX = LEDGER_PINS

PinKind = Literal["save", "restore"]


class CheckpointRecord(TypedDict, total=False):
    """A step's state change as the ledger keeps it; read back, the newest one with its history."""

    step: Required[int]
    state: Required[str]  # one of STATES
    time: Required[float]
    host: str  # the writer
    pid: int
    metrics: RecordedMetrics  # a validation's figures (carried forward by a promotion)
    reason: str  # why it was rejected, quarantined, corrupt, or recorded by someone else
    attempt: int | None  # the round that saved it
    files: dict[str, list[int]]  # its files' [size, crc32c] by name (the integrity record)
    policy: str  # the retention policy that pruned it
    location: str  # where a quarantined or promoted step went
    history: list[str]  # every state it went through, oldest first (added when read)


class PointerRecord(TypedDict, total=False):
    """A move of the resume pointer."""

    step: Required[int]
    reason: Required[str]
    time: Required[float]
    host: str
    pid: int
    resume: ResumeHow  # a rollback's


RECORD_FIELDS = CheckpointRecord.__optional_keys__ - {"history", "host", "pid"}


def _check_step(step: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a step is a non-negative int, not {step!r}")


class Ledger:
    """Checkpoint states and the resume pointer of one run (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # -- checkpoint states ------------------------------------------------------------

    def record(self, step: int, state: str, **info: Any) -> CheckpointRecord:
        """Append a state change for ``step`` (a new write-once object; nothing is overwritten).

        ``validated`` takes ``metrics={...}``; ``rejected`` takes ``reason=...``; the other
        fields :class:`CheckpointRecord` declares are stored as they are (they must be JSON).
        """
        _check_step(step)
        if state not in STATES:
            raise ValueError(f"unknown checkpoint state {state!r}; one of {STATES}")
        if set(info) - RECORD_FIELDS:
            raise ValueError(f"a checkpoint record has no field {sorted(set(info) - RECORD_FIELDS)}")
        if state == "validated" and not isinstance(info.get("metrics"), dict):
            raise ValueError("a 'validated' record needs metrics={...}")
        if state == "rejected" and not info.get("reason"):
            raise ValueError("a 'rejected' record needs reason=...")
        ns = stamp()
        rec = cast(CheckpointRecord, {**info, "step": step, "state": state, "time": ns / 1e9, **whoami()})
        key = f"{STEPS_PREFIX}{step:012d}/{ns:020d}-{state}-{nonce()}.json"
        self.store.create(key, json.dumps(rec, sort_keys=True).encode())
        return rec

    def _keys_by_step(self) -> dict[int, list[str]]:
        by_step: dict[int, list[str]] = {}
        for key in self.store.list(STEPS_PREFIX):
            parts = key[len(STEPS_PREFIX) :].split("/")
            if len(parts) != 2 or not parts[0].isdigit() or not parts[1].endswith(".json"):
                continue
            by_step.setdefault(int(parts[0]), []).append(key)
        for keys in by_step.values():
            keys.sort(key=lambda k: k.rsplit("/", 1)[1])
        return by_step

    def _fold(self, keys: list[str]) -> CheckpointRecord | None:
        """The newest record, carrying the newest metrics seen (a promotion keeps its validation metrics)."""
        if not keys:
            return None
        newest = cast(CheckpointRecord, json.loads(self.store.get(keys[-1])))
        if "metrics" not in newest:
            for key in reversed(keys[:-1]):
                rec = json.loads(self.store.get(key))
                if "metrics" in rec:
                    newest["metrics"] = rec["metrics"]
                    break
        newest["history"] = [k.rsplit("/", 1)[1].split("-")[1] for k in keys]
        return newest

    def state(self, step: int) -> CheckpointRecord | None:
        """The current record of ``step``, or None."""
        _check_step(step)
        keys = sorted(self.store.list(f"{STEPS_PREFIX}{step:012d}/"), key=lambda k: k.rsplit("/", 1)[1])
        return self._fold([k for k in keys if k.endswith(".json")])

    def states(self, steps: Iterable[int] | None = None) -> dict[int, CheckpointRecord]:
        """The current record of every step the ledger knows (or of those in ``steps``), by step.

        One listing, then one read per step (two when the metrics are in an older record).
        """
        wanted = None if steps is None else set(steps)
        out = {}
        for step, keys in sorted(self._keys_by_step().items()):
            if wanted is not None and step not in wanted:
                continue
            rec = self._fold(keys)
            if rec is not None:
                out[step] = rec
        return out

    def validated_steps(self) -> list[int]:
        """Steps whose current state passed validation (validated or promoted), ascending."""
        return [s for s, r in self.states().items() if r["state"] in VALIDATED_STATES]

    def newest_validated(self) -> int | None:
        steps = self.validated_steps()
        return steps[-1] if steps else None

    def best(self, metric: str, n: int = 1, mode: Literal["min", "max"] = "min") -> list[int]:
        """The ``n`` validated steps with the best finite ``metric``, best first (ties: the newer step)."""
        if mode not in ("min", "max"):
            raise ValueError(f"mode is 'min' or 'max', not {mode!r}")
        sign = 1.0 if mode == "min" else -1.0
        scored = []
        for step, rec in self.states().items():
            value = (rec.get("metrics") or {}).get(metric)
            if rec["state"] in VALIDATED_STATES and isinstance(value, int | float) and math.isfinite(value):
                scored.append((sign * float(value), -step))
        return [-neg_step for _v, neg_step in sorted(scored)[:n]]

    # -- resume pointer -------------------------------------------------------------------

    def set_pointer(self, step: int, reason: str, *, resume: ResumeHow | None = None) -> PointerRecord:
        """Move the resume pointer (a new record; the old ones stay as history).

        ``info`` may carry how to resume (e.g. ``resume={"skip_to_batch": N, "lr_scale": F}``).
        """
        _check_step(step)
        ns = stamp()
        rec = cast(PointerRecord, {"step": step, "reason": reason, "time": ns / 1e9, **whoami()})
        if resume is not None:
            rec["resume"] = resume
        self.store.create(f"{POINTER_PREFIX}{ns:020d}-{nonce()}.json", json.dumps(rec, sort_keys=True).encode())
        return rec

    def pointer_record(self) -> PointerRecord | None:
        keys = [k for k in self.store.list(POINTER_PREFIX) if k.endswith(".json")]
        if not keys:
            return None
        return cast(PointerRecord, json.loads(self.store.get(max(keys))))

    def pointer(self) -> int | None:
        """The step a (re)started job should resume from, or None when never set."""
        rec = self.pointer_record()
        return None if rec is None else int(rec["step"])


# -- pins ----------------------------------------------------------------------------------


def pin(store: Store, step: int, owner: str, kind: PinKind) -> str:
    """Mark ``step`` as in use by a running save or restore, so prune leaves it alone; returns the pin's key.

    The step and the time are in the key, so listing pins needs no reads.
    """
    _check_step(step)
    if kind not in ("save", "restore"):
        raise ValueError(f"a pin's kind is 'save' or 'restore', not {kind!r}")
    ns = stamp()
    key = f"{PINS_PREFIX}{step:012d}-{ns:020d}-{kind}-{nonce()}.json"
    rec = {"step": step, "owner": owner, "kind": kind, "time": ns / 1e9, **whoami()}
    store.create(key, json.dumps(rec, sort_keys=True).encode())
    return key


def unpin(store: Store, key: str) -> None:
    if not key.startswith(PINS_PREFIX):
        raise ValueError(f"{key!r} is not a pin")
    store.delete(key)


def pinned_steps(store: Store, max_age_s: float = 3600.0, now: float | None = None) -> set[int]:
    """Steps pinned within the last ``max_age_s``; older pins are a crashed job's and are ignored."""
    now = time.time() if now is None else now
    steps = set()
    for key in store.list(PINS_PREFIX):
        parts = key[len(PINS_PREFIX) :].split("-")
        if len(parts) < 3 or not parts[0].isdigit() or not parts[1].isdigit():
            continue
        if now - int(parts[1]) / 1e9 <= max_age_s:
            steps.add(int(parts[0]))
    return steps


@contextmanager
def pinned(store: Store, step: int, owner: str, kind: PinKind) -> Iterator[str]:
    """``with pinned(store, step, owner, "restore"): ...`` pins for the duration of the block."""
    key = pin(store, step, owner, kind)
    try:
        yield key
    finally:
        unpin(store, key)
