"""The ledger of a run: each checkpoint's state, the resume pointer, the run lock and pins.

Everything here is made of write-once objects (``Store.create``) with names
that sort in time order, because GCS has neither an atomic rename nor an
append (DESIGN.md §4).  A local root and a gs:// root therefore behave the same.

Layout under the run root::

    ledger/steps/<step:012d>/<time_ns:020d>-<state>-<nonce>.json   one record per state change
    ledger/pointer/<time_ns:020d>-<nonce>.json                     one record per pointer move
    ledger/pins/<step:012d>-<time_ns:020d>-<kind>-<nonce>.json     a job reading/writing a step
    lock/<generation:012d>.json                                    the run lock, one object per lease change

The current state of a step is its newest record; the pointer is the newest
pointer record.  Time order comes from the writer's wall clock (nanoseconds,
made strictly increasing within a process): writers on different machines are
ordered only as well as their clocks agree, which is plenty for state changes
that are minutes apart.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Literal

from training.events import EventLog
from training.retention import USABLE_STATES, VALIDATED_STATES
from training.storage import AlreadyExists, NotFound, Store

# The states a checkpoint moves through.  "pruned" is written by prune() just
# before it deletes a step, so the ledger never claims a deleted step is usable.
STATES: tuple[str, ...] = ("committed", "validated", "rejected", "quarantined", "promoted", "pruned")

__all__ = [
    "STATES",
    "USABLE_STATES",
    "VALIDATED_STATES",
    "Ledger",
    "RunLock",
    "LockHeld",
    "LockLost",
    "pin",
    "unpin",
    "pinned",
    "pinned_steps",
]

STEPS_PREFIX = "ledger/steps/"
POINTER_PREFIX = "ledger/pointer/"
PINS_PREFIX = "ledger/pins/"
LOCK_PREFIX = "lock/"

PinKind = Literal["save", "restore"]

_clock_lock = threading.Lock()
_last_ns = 0


def _stamp() -> int:
    """Wall-clock nanoseconds, strictly increasing within this process.

    Two records written back to back must not tie: their order *is* the ledger.
    """
    global _last_ns
    with _clock_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return _last_ns


def _nonce() -> str:
    return uuid.uuid4().hex[:8]


def _whoami() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _dead_local_holder(rec: dict[str, Any]) -> bool:
    """A holder on this very host whose process is gone cannot refresh: its lease is void.

    (An agent killed with SIGKILL would otherwise block its own Airflow retry for a lease.)
    """
    if rec.get("host") != socket.gethostname() or not rec.get("pid") or int(rec["pid"]) == os.getpid():
        return False
    try:
        os.kill(int(rec["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _check_step(step: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a step is a non-negative int, not {step!r}")


class Ledger:
    """Checkpoint states and the resume pointer of one run (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # -- checkpoint states ------------------------------------------------------------

    def record(self, step: int, state: str, **info: Any) -> dict[str, Any]:
        """Append a state change for ``step`` (a new write-once object; nothing is overwritten).

        ``validated`` takes ``metrics={...}``; ``rejected`` takes ``reason=...``.
        Extra keyword arguments are stored as they are (they must be JSON).
        """
        _check_step(step)
        if state not in STATES:
            raise ValueError(f"unknown checkpoint state {state!r}; one of {STATES}")
        if state == "validated" and not isinstance(info.get("metrics"), dict):
            raise ValueError("a 'validated' record needs metrics={...}")
        if state == "rejected" and not info.get("reason"):
            raise ValueError("a 'rejected' record needs reason=...")
        ns = _stamp()
        rec = {**info, "step": step, "state": state, "time": ns / 1e9, **_whoami()}
        key = f"{STEPS_PREFIX}{step:012d}/{ns:020d}-{state}-{_nonce()}.json"
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

    def _fold(self, keys: list[str]) -> dict[str, Any] | None:
        """The newest record, carrying the newest metrics seen (a promotion keeps its validation metrics)."""
        if not keys:
            return None
        newest = json.loads(self.store.get(keys[-1]))
        if "metrics" not in newest:
            for key in reversed(keys[:-1]):
                rec = json.loads(self.store.get(key))
                if "metrics" in rec:
                    newest["metrics"] = rec["metrics"]
                    break
        newest["history"] = [k.rsplit("/", 1)[1].split("-")[1] for k in keys]
        return dict(newest)

    def state(self, step: int) -> dict[str, Any] | None:
        """The current record of ``step`` (keys: step, state, time, history, metrics?, reason?...), or None."""
        _check_step(step)
        keys = sorted(self.store.list(f"{STEPS_PREFIX}{step:012d}/"), key=lambda k: k.rsplit("/", 1)[1])
        return self._fold([k for k in keys if k.endswith(".json")])

    def states(self, steps: Iterable[int] | None = None) -> dict[int, dict[str, Any]]:
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

    def set_pointer(self, step: int, reason: str, **info: Any) -> dict[str, Any]:
        """Move the resume pointer (a new record; the old ones stay as history).

        ``info`` may carry how to resume (e.g. ``resume={"skip_to_batch": N, "lr_scale": F}``).
        """
        _check_step(step)
        ns = _stamp()
        rec = {**info, "step": step, "reason": reason, "time": ns / 1e9, **_whoami()}
        self.store.create(f"{POINTER_PREFIX}{ns:020d}-{_nonce()}.json", json.dumps(rec, sort_keys=True).encode())
        return rec

    def pointer_record(self) -> dict[str, Any] | None:
        keys = [k for k in self.store.list(POINTER_PREFIX) if k.endswith(".json")]
        if not keys:
            return None
        return dict(json.loads(self.store.get(max(keys))))

    def pointer(self) -> int | None:
        """The step a (re)started job should resume from, or None when never set."""
        rec = self.pointer_record()
        return None if rec is None else int(rec["step"])


# -- run lock ------------------------------------------------------------------------------


class LockHeld(RuntimeError):
    """Another owner holds an unexpired lease on the run."""


class LockLost(RuntimeError):
    """We believed we held the lock, but someone else has it now (our lease ran out)."""


class RunLock:
    """One writer per run, as a lease, built from write-once generation objects.

    ``lock/<gen>.json`` records each change (acquire, refresh, takeover, release);
    the newest generation is the lock's state.  Taking or changing the lock means
    creating generation ``g+1``: ``create`` is exclusive (``link(2)`` on a local
    root, ``ifGenerationMatch=0`` on GCS), so of two writers racing for a free
    lock exactly one creates it.  After each write the writer re-lists and checks
    that the newest generation is its own; that also makes it safe to delete old
    generations (we keep the newest two) without a late writer reusing a freed name.

    The lease is wall-clock time on the holder's machine: keep ``lease_s`` well
    above the clock skew between machines, and call ``refresh`` every
    ``lease_s / 3`` or so.  An expired lease may be taken over; the takeover
    record names the previous holder.

    Emulator caveat: gcp-storage-emulator ignores ``ifGenerationMatch``, so on it
    ``create`` is only an exists-check followed by an upload, and two writers
    racing within milliseconds could both believe they won.  The guarantee holds
    on a local root and on real GCS; tests race processes on a local root only.
    """

    def __init__(self, store: Store, owner: str, lease_s: float = 60.0, events: EventLog | None = None) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.store = store
        self.owner = owner
        self.lease_s = float(lease_s)
        self.events = events
        self.token = uuid.uuid4().hex
        self._gen: int | None = None  # the generation we last wrote while holding the lock
        self._acquired_at = 0.0

    # The generation objects, oldest first.
    def _generations(self) -> list[tuple[int, str]]:
        gens = []
        for key in self.store.list(LOCK_PREFIX):
            name = key[len(LOCK_PREFIX) :]
            if name.endswith(".json") and name[:-5].isdigit():
                gens.append((int(name[:-5]), key))
        return sorted(gens)

    def _newest(self) -> tuple[int, dict[str, Any] | None]:
        for _ in range(5):
            gens = self._generations()
            if not gens:
                return 0, None
            gen, key = gens[-1]
            try:
                return gen, dict(json.loads(self.store.get(key)))
            except NotFound:  # pruned by the holder between list and get: look again
                continue
        raise RuntimeError(f"could not read the lock of {self.store.uri}")

    @staticmethod
    def _active(rec: dict[str, Any] | None, now: float) -> bool:
        return (
            rec is not None
            and rec["action"] != "release"
            and float(rec["expires_at"]) > now
            and not _dead_local_holder(rec)
        )

    def held_by(self, now: float | None = None) -> dict[str, Any] | None:
        """The holder's record (owner, host, pid, acquired_at, expires_at, ...) while its lease runs, else None."""
        _gen, rec = self._newest()
        return rec if self._active(rec, time.time() if now is None else now) else None

    def _message(self, rec: dict[str, Any], now: float) -> str:
        left = float(rec["expires_at"]) - now
        return (
            f"run {self.store.uri} is locked by {rec['owner']!r} (host {rec['host']}, pid {rec['pid']}), "
            f"held since {_iso(float(rec['acquired_at']))}; its lease expires at {_iso(float(rec['expires_at']))} "
            f"(in {left:.0f}s) unless refreshed. Stop that job, or wait for the lease to expire and retry."
        )

    def _write(self, gen: int, action: str, previous: dict[str, Any] | None, acquired_at: float) -> dict[str, Any]:
        now = time.time()
        rec = {
            "gen": gen,
            "action": action,
            "owner": self.owner,
            "token": self.token,
            "acquired_at": acquired_at,
            "time": now,
            "expires_at": now if action == "release" else now + self.lease_s,
            **_whoami(),
        }
        if previous is not None:
            rec["previous"] = {k: previous.get(k) for k in ("owner", "host", "pid", "acquired_at", "expires_at")}
        self.store.create(f"{LOCK_PREFIX}{gen:012d}.json", json.dumps(rec, sort_keys=True).encode())
        return rec

    def _confirm(self, gen: int) -> bool:
        """Is generation ``gen`` still the newest, and ours?  Also drops generations older than gen-1."""
        gens = self._generations()
        if not gens or gens[-1][0] != gen:
            return False
        try:
            rec = json.loads(self.store.get(gens[-1][1]))
        except NotFound:
            return False
        if rec.get("token") != self.token:
            return False
        for old, key in gens:
            if old < gen - 1:
                self.store.delete(key)
        return True

    def _emit(self, action: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit("lock", owner=self.owner, action=action, **_whoami(), **fields)

    def acquire(self) -> dict[str, Any]:
        """Take the lock, or take over an expired lease; raise LockHeld if someone else holds it."""
        for _ in range(5):
            gen, rec = self._newest()
            now = time.time()
            if self._active(rec, now):
                assert rec is not None
                if rec.get("token") == self.token:
                    return self.refresh()
                raise LockHeld(self._message(rec, now))
            takeover = rec is not None and rec["action"] != "release"
            try:
                new = self._write(gen + 1, "takeover" if takeover else "acquire", rec if takeover else None, now)
            except AlreadyExists:
                continue  # someone else got generation gen+1 first; look at what they wrote
            if not self._confirm(gen + 1):
                continue
            self._gen, self._acquired_at = gen + 1, now
            if takeover:
                assert rec is not None
                self._emit("takeover", previous_owner=rec["owner"], previous_expires_at=rec["expires_at"])
            else:
                self._emit("acquire")
            return new
        gen, rec = self._newest()
        now = time.time()
        if self._active(rec, now):
            assert rec is not None
            raise LockHeld(self._message(rec, now))
        raise LockHeld(f"run {self.store.uri}: lost the race for its lock five times in a row; retry")

    def refresh(self) -> dict[str, Any]:
        """Extend our lease; raise LockLost if the lock has moved on without us."""
        if self._gen is None:
            raise LockLost(f"{self.owner!r} does not hold the lock of {self.store.uri}")
        try:
            rec = self._write(self._gen + 1, "refresh", None, self._acquired_at)
        except AlreadyExists:
            rec = None
        if rec is None or not self._confirm(self._gen + 1):
            self._gen = None
            holder = self.held_by()
            who = f"{holder['owner']!r} (host {holder['host']}, pid {holder['pid']})" if holder else "nobody now"
            raise LockLost(f"the lock of {self.store.uri} was taken over; it is held by {who}")
        self._gen += 1
        return rec

    def release(self) -> None:
        """Give the lock up (a no-op when we no longer hold it)."""
        if self._gen is None:
            return
        gen, self._gen = self._gen, None
        try:
            self._write(gen + 1, "release", None, time.time())
        except AlreadyExists:
            return  # it had already moved on: nothing of ours to release
        if self._confirm(gen + 1):
            self._emit("release")

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- pins ----------------------------------------------------------------------------------


def pin(store: Store, step: int, owner: str, kind: PinKind) -> str:
    """Mark ``step`` as in use by a running save or restore, so prune leaves it alone; returns the pin's key.

    The step and the time are in the key, so listing pins needs no reads.
    """
    _check_step(step)
    if kind not in ("save", "restore"):
        raise ValueError(f"a pin's kind is 'save' or 'restore', not {kind!r}")
    ns = _stamp()
    key = f"{PINS_PREFIX}{step:012d}-{ns:020d}-{kind}-{_nonce()}.json"
    rec = {"step": step, "owner": owner, "kind": kind, "time": ns / 1e9, **_whoami()}
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
