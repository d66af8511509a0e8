"""The run lock: one job owns a run at a time, as a lease built from write-once generations.

Each change (acquire, refresh, takeover, handoff, release) exclusively creates the next
``lock/<gen>.json``, so of two racing writers exactly one wins; the newest generation is the state.
The launcher holds the lock while it writes the run's config, then hands it off to its job, whose
leader keeps it alive with a :class:`LeaseKeeper` thread and fences each write with its ``check``.

Guarantees, with clocks that disagree by up to ``MAX_CLOCK_SKEW_S``: another owner takes a lease
over only once it has lapsed by its writer's clock and by the taker's own (:meth:`RunLock.lapses_in`);
the holder counts it lost ``lease_s`` after it began its last good refresh, before anyone may take
it.  The one exception: a generation whose holder's process is known to have exited (a connection
to its record's ``contact`` closed) may be taken at once (``acquire(holder_exited=gen)``).
It needs a store whose ``create`` is exclusive: GCS's ``ifGenerationMatch=0`` (the test emulator is
patched to honour it: ``training.emulator``), or a local file linked into place (``link(2)`` fails where it exists).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypedDict, cast

from training.layout import LOCK
from training.records import iso, whoami
from training.storage import AlreadyExists, NotFound, Store

log = logging.getLogger(__name__)

DEFAULT_MARGIN_S = 0.5
# How far the clocks of the machines sharing a run may disagree.  A lease that ran out longer ago than this
# by its writer's clock has lapsed for every reader; a more recent one is taken over only by a reader that
# watched it lapse on its own clock.
MAX_CLOCK_SKEW_S = 60.0
# Generations kept behind the newest: a reader that follows the lease by name (one look a heartbeat
# while the holder renews every lease_s / 4) finds the one it saw last still there.
KEEP_GENERATIONS = 8


class HostContact(TypedDict):
    """How others reach a lock's holder: its agent's host, start time and host-watch address."""

    host: str
    started: float
    watch: str  # host:port; a connection to it that closes says the holder exited


class PreviousHolder(TypedDict):
    """Who held the lease before a takeover."""

    owner: str
    job: str | None
    host: str
    pid: int
    acquired_at: float
    expires_at: float


class LockRecord(TypedDict, total=False):
    """One generation of the run lock."""

    gen: int
    action: str  # acquire | refresh | takeover | handoff | release
    owner: str
    job: str | None
    token: str  # the writer's: whose lease this is
    acquired_at: float
    time: float
    expires_at: float
    host: str
    pid: int
    contact: HostContact
    previous: PreviousHolder


class LockHeld(RuntimeError):
    """Another owner holds an unexpired lease on the run."""

    def __init__(self, message: str, holder: LockRecord | None = None) -> None:
        super().__init__(message)
        self.holder = holder


class LockLost(RuntimeError):
    """We believed we held the lock, but someone else has it now (our lease ran out)."""


class LockReader:
    """Reading a run lock: its newest generation, and whether a lease has lapsed for this process (see the module
    docstring).  :class:`RunLock` changes it."""

    store: Store
    margin_s: float
    _mu: threading.RLock
    _seen_gen: int  # the newest generation seen: the next look starts from it
    _first_read: dict[int, float]  # generation -> when this process first read it (monotonic)

    def _generations(self) -> list[tuple[int, str]]:
        return generations(self.store)

    def newest(self) -> tuple[int, LockRecord | None]:
        """(generation, record) of the lock's current state; (0, None) for a lock never taken.

        After the first look, the generation last seen and those after it are read by name
        (two reads while nothing moved); a listing only when that one is gone.
        """
        with self._mu:
            return self._newest()

    def _newest(self) -> tuple[int, LockRecord | None]:
        if self._seen_gen:
            found = self._read_from(self._seen_gen)
            if found is not None:
                return self._dated(*found)
        for _ in range(5):
            gens = self._generations()
            if not gens:
                return 0, None
            gen, key = gens[-1]
            try:
                rec = cast(LockRecord, json.loads(self.store.get(key)))
            except NotFound:  # dropped by the holder between list and get: look again
                continue
            self._seen_gen = gen
            return self._dated(gen, rec)
        raise RuntimeError(f"could not read the lock of {self.store.uri}")

    def _dated(self, gen: int, rec: LockRecord) -> tuple[int, LockRecord]:
        """Note when this process first read generation ``gen`` (its own clock: see :meth:`lapses_in`)."""
        if gen not in self._first_read:
            self._first_read[gen] = time.monotonic()
            for old in [g for g in self._first_read if g < gen - KEEP_GENERATIONS]:
                del self._first_read[old]
        return gen, rec

    def _read_from(self, gen: int) -> tuple[int, LockRecord] | None:
        """Generation ``gen`` or the newest after it, read by name; None when ``gen`` is gone.

        Only generations ``KEEP_GENERATIONS`` behind the newest are deleted, so while
        ``gen`` is there every newer one is too, up to the first not found.
        """
        try:
            rec = cast(LockRecord, json.loads(self.store.get(f"{LOCK}{gen:012d}.json")))
        except NotFound:
            return None
        while True:
            try:
                rec_next = cast(LockRecord, json.loads(self.store.get(f"{LOCK}{gen + 1:012d}.json")))
            except NotFound:
                self._seen_gen = gen
                return gen, rec
            gen, rec = gen + 1, rec_next

    def active(self, rec: LockRecord | None, now: float) -> bool:
        """Does ``rec`` keep others out at ``now``, by its writer's clock?"""
        return rec is not None and rec["action"] != "release" and now < float(rec["expires_at"]) + self.margin_s

    def lapses_in(self, rec: LockRecord, now: float | None = None) -> float:
        """Seconds until ``rec``'s lease has lapsed for this process: by the writer's clock, and by its own.

        By its own: the lease's length since this process first read that generation, unless the
        lease ran out by the writer's clock more than ``MAX_CLOCK_SKEW_S`` ago.  0 once lapsed.
        """
        if rec["action"] == "release":
            return 0.0
        now = time.time() if now is None else now
        by_writer = float(rec["expires_at"]) + self.margin_s - now
        if by_writer <= -MAX_CLOCK_SKEW_S:
            return 0.0
        length = max(float(rec["expires_at"]) - float(rec.get("time", rec["expires_at"])), 0.0)
        first = self._first_read.get(int(rec.get("gen") or 0), time.monotonic())
        by_reader = first + length + self.margin_s - time.monotonic()
        return max(min(max(by_writer, by_reader), by_writer + MAX_CLOCK_SKEW_S), 0.0)

    def wait_lapse(self, rec: LockRecord, poll_s: float = 0.2) -> LockRecord | None:
        """Watch ``rec``'s generation until its lease lapses for this process (None), or until the lock
        moves on (the newer record: its holder renewed or released it, or another owner took it)."""
        gen = int(rec.get("gen") or 0)
        while self.lapses_in(rec) > 0:
            time.sleep(min(poll_s, max(self.lapses_in(rec), 0.01)))
            cur_gen, cur = self.newest()
            if cur_gen != gen:
                return cur
        return None

    def held_by(self, now: float | None = None) -> LockRecord | None:
        """The holder's record (owner, job, host, pid, acquired_at, expires_at, ...) while in force, else None."""
        _gen, rec = self.newest()
        return rec if self.active(rec, time.time() if now is None else now) else None

    def message(self, rec: LockRecord, now: float | None = None) -> str:
        left = self.lapses_in(rec, now)
        job = f" of job {rec['job']}" if rec.get("job") else ""
        return (
            f"run {self.store.uri} is locked by {rec['owner']!r}{job} (host {rec['host']}, pid {rec['pid']}), "
            f"held since {iso(float(rec['acquired_at']))}; its lease runs out in {max(left, 0):.0f}s unless "
            "refreshed. Stop that job (or wait for its lease to run out) and retry."
        )


class RunLock(LockReader):
    """One owner per run (see the module docstring).

    :param owner: who we are, for messages (``agent h1 of job J``).
    :param job: the job we belong to; a handoff to this job may be claimed at once.
    :param lease_s: how long a refresh keeps the lease.
    :param margin_s: how long after its expiry a lease still keeps others out.
    :param contact: written into every record: how others reach the holder (an agent: its host-watch address).
    """

    def __init__(
        self,
        store: Store,
        owner: str,
        lease_s: float = 60.0,
        *,
        job: str | None = None,
        margin_s: float = DEFAULT_MARGIN_S,
        on_event: Callable[..., Any] | None = None,
        contact: HostContact | None = None,
    ) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.store = store
        self.owner = owner
        self.job = job
        self.lease_s = float(lease_s)
        self.margin_s = float(margin_s)
        self.on_event = on_event
        self.contact = contact
        self.token = uuid.uuid4().hex
        self.gen: int | None = None  # the generation we last wrote while holding the lock
        # One change of the lock at a time (a LeaseKeeper's refresh against the holder's release or handoff),
        # and one reader of the views below: a release waits for a refresh under way, then writes after it.
        self._mu = threading.RLock()
        self._state = threading.Lock()  # forget() against a change's last step
        self._forgotten = 0  # how many times forget() was called: a refresh under way then keeps the lock forgotten
        self._seen_gen = 0  # the newest generation seen: the next look starts from it
        self._first_read: dict[int, float] = {}  # generation -> when this process first read it (monotonic)
        self._acquired_at = 0.0

    # -- writing ---------------------------------------------------------------------------

    def _write(
        self, gen: int, action: str, previous: LockRecord | None, acquired_at: float, lease_s: float | None = None
    ) -> LockRecord:
        now, writer = time.time(), whoami()
        rec: LockRecord = {
            "gen": gen,
            "action": action,
            "owner": self.owner,
            "job": self.job,
            "token": self.token,
            "acquired_at": acquired_at,
            "time": now,
            "expires_at": now if action == "release" else now + (lease_s or self.lease_s),
            "host": writer["host"],
            "pid": writer["pid"],
        }
        if self.contact is not None:
            rec["contact"] = self.contact
        if previous is not None:
            rec["previous"] = cast(PreviousHolder, {k: previous.get(k) for k in PreviousHolder.__required_keys__})
        data = json.dumps(rec, sort_keys=True).encode()
        try:
            self.store.create(f"{LOCK}{gen:012d}.json", data)
        except OSError as e:
            if e.errno != errno.ENOSPC or not drop_history(self.store, gen):
                raise
            self.store.create(f"{LOCK}{gen:012d}.json", data)
        return rec

    def _confirm(self, gen: int) -> bool:
        """Is generation ``gen`` still the newest, and ours?  Also drops generations older than the kept ones.

        A generation we wrote where the others were dropped already (a holder that slept
        through its lease and renewed late) is dropped too, so that no reader takes it for
        a holder.
        """
        gens = self._generations()
        if not gens or gens[-1][0] != gen:
            if gens and gens[-1][0] - gen >= KEEP_GENERATIONS:
                self._drop_ours(gen)
            return False
        try:
            rec = json.loads(self.store.get(gens[-1][1]))
        except NotFound:
            return False
        if rec.get("token") != self.token:
            return False
        for old, key in gens:
            if old <= gen - KEEP_GENERATIONS:
                self.store.delete(key)
        return True

    def _drop_ours(self, gen: int) -> None:
        key = f"{LOCK}{gen:012d}.json"
        try:
            if json.loads(self.store.get(key)).get("token") == self.token:
                self.store.delete(key)
        except (NotFound, ValueError):
            pass

    def _emit(self, action: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event("lock", owner=self.owner, action=action, job=self.job, **whoami(), **fields)

    def _claimable(self, rec: LockRecord | None, now: float, holder_exited: int | None = None) -> bool:
        if rec is None or rec["action"] == "release":
            return True
        if rec["action"] == "handoff" and self.job is not None and rec.get("job") == self.job:
            return True
        if holder_exited is not None and rec.get("gen") == holder_exited:
            return True
        return self.lapses_in(rec, now) <= 0

    def acquire(self, holder_exited: int | None = None) -> LockRecord:
        """Take the lock (a free one, a lapsed lease, or a handoff to our job); else raise LockHeld.

        ``holder_exited``: a generation whose holder's process is known to have exited; while it is
        the newest, it is taken over at once (see the module docstring).
        """
        with self._mu:
            return self._acquire(holder_exited)

    def _acquire(self, holder_exited: int | None) -> LockRecord:
        self._seen_gen = 0  # a taker lists: it must not write on a view read by name
        for _ in range(5):
            gen, rec = self.newest()
            now = time.time()
            if rec is not None and rec.get("token") == self.token and self.active(rec, now):
                return self.refresh()
            if not self._claimable(rec, now, holder_exited):
                assert rec is not None
                raise LockHeld(self.message(rec, now), rec)
            takeover = rec is not None and rec["action"] != "release"
            try:
                new = self._write(gen + 1, "takeover" if takeover else "acquire", rec if takeover else None, now)
            except AlreadyExists:
                continue  # someone else got generation gen+1 first; look at what they wrote
            if not self._confirm(gen + 1):
                continue
            self.gen, self._acquired_at = gen + 1, now
            if takeover:
                assert rec is not None
                self._emit(
                    "takeover",
                    previous_owner=rec["owner"],
                    previous_job=rec.get("job"),
                    previous_expires_at=rec["expires_at"],
                    previous_pid=rec.get("pid"),
                    handoff=rec["action"] == "handoff",
                    holder_exited=rec.get("gen") == holder_exited,
                )
            else:
                self._emit("acquire")
            return new
        gen, rec = self.newest()
        now = time.time()
        if rec is not None and not self._claimable(rec, now):
            raise LockHeld(self.message(rec, now), rec)
        raise LockHeld(f"run {self.store.uri}: lost the race for its lock five times in a row; retry")

    def refresh(self) -> LockRecord:
        """Extend our lease; raise LockLost if the lock has moved on without us."""
        return self._advance("refresh")

    def handoff(self, job: str, lease_s: float) -> LockRecord:
        """Keep the lock for ``job`` for ``lease_s``: its agents may claim it at once, others are kept out."""
        with self._mu:
            self.job = job
            rec = self._advance("handoff", lease_s)
            self.forget()  # it is the job's now
            return rec

    def forget(self) -> None:
        """Count the lock as no longer ours, writing nothing (its lease was lost): a change under way is not undone,
        but leaves the lock forgotten too."""
        with self._state:
            self._forgotten += 1
            self.gen = None

    def _advance(self, action: str, lease_s: float | None = None) -> LockRecord:
        with self._mu:
            gen, forgotten = self.gen, self._forgotten
            if gen is None:
                raise LockLost(f"{self.owner!r} does not hold the lock of {self.store.uri}")
            try:
                rec: LockRecord | None = self._write(gen + 1, action, None, self._acquired_at, lease_s)
            except AlreadyExists:
                rec = None
            if rec is None or not self._confirm(gen + 1):
                self.gen = None
                holder = self.held_by()
                who = f"{holder['owner']!r} (host {holder['host']}, pid {holder['pid']})" if holder else "nobody now"
                raise LockLost(f"the lock of {self.store.uri} was taken over; it is held by {who}")
            with self._state:
                if forgotten == self._forgotten:
                    self.gen = gen + 1
            return rec

    def release(self) -> None:
        """Give the lock up (a no-op when we no longer hold it); a change under way (a refresh) ends first."""
        with self._mu:
            if self.gen is None:
                return
            gen, self.gen = self.gen, None
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


def generations(store: Store) -> list[tuple[int, str]]:
    """The lock's generations in ``store``: (number, object key), oldest first."""
    gens = []
    for key in store.list(LOCK):
        name = key[len(LOCK) :]
        if name.endswith(".json") and name[:-5].isdigit():
            gens.append((int(name[:-5]), key))
    return sorted(gens)


def drop_history(store: Store, gen: int) -> bool:
    """A full disk: drop the generations before the current one (``gen - 1``) to make room for ``gen``.

    They are history: a reader following one by name lists again when it is gone, and the
    newest stays, so every generation after one still there is there too.  False: none to drop.
    """
    dropped = False
    for old, key in generations(store):
        if old < gen - 1:
            with contextlib.suppress(NotFound):
                store.delete(key)
                dropped = True
    if dropped:
        log.warning("the disk of %s is full: dropped the lock's history to write its next generation", store.uri)
    return dropped


class LeaseKeeper:
    """Keeps a held lock's lease alive from a thread of its own, and says when it is no longer ours.

    Refreshes every ``lease_s / 4``.  :meth:`valid` turns false ``lease_s`` after
    the start of the last successful refresh (monotonic clock), or at once when a
    refresh finds the lock taken over; ``on_lost`` is called then (once).
    """

    def __init__(
        self,
        lock: RunLock,
        on_lost: Callable[[str], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        if lock.gen is None:
            raise LockLost(f"{lock.owner!r} does not hold the lock of {lock.store.uri}")
        self.lock = lock
        self.on_lost = on_lost
        self.on_error = on_error
        self._valid_until = time.monotonic() + lock.lease_s
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def valid(self) -> bool:
        return self._lost is None and time.monotonic() < self._valid_until

    def check(self) -> None:
        """Raise LockLost unless the lease is still ours (call before each write of the holder)."""
        if not self.valid():
            raise LockLost(self._lost or f"the lease of {self.lock.store.uri} ran out before it could be refreshed")

    def _lose(self, why: str) -> None:
        if self._lost is None:
            self._lost = why
            if self.on_lost is not None:
                self.on_lost(why)

    def _run(self) -> None:
        period = self.lock.lease_s / 4
        while not self._stop.wait(period):
            if not self._run_once():
                return

    def _run_once(self) -> bool:
        """One refresh; False when the lease is lost for good."""
        t0 = time.monotonic()
        try:
            self.lock.refresh()
        except LockLost as e:
            self._lose(str(e))
            return False
        except Exception as e:  # noqa: BLE001 - a store hiccup: try again; the lease runs out if it lasts
            log.warning("refreshing the lease of %s failed: %s", self.lock.store.uri, e)
            if self.on_error is not None:
                self.on_error(e)  # e.g. a full disk: the holder makes room and ends the job
            if time.monotonic() >= self._valid_until:
                self._lose(f"the lease of {self.lock.store.uri} could not be refreshed: {e}")
                return False
            return True
        self._valid_until = t0 + self.lock.lease_s
        return True
