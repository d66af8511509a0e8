"""The ledger, the run lock and pins behave the same on a local root and on gs:// (emulator)."""

from __future__ import annotations

import math
import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest

from training.checkpoint.ledger import Ledger, pin, pinned, pinned_steps, unpin
from training.checkpoint.lock import KEEP_GENERATIONS, LeaseKeeper, LockHeld, LockLost, RunLock
from training.events import EventLog
from training.storage import Store, open_store


@pytest.fixture(params=["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return open_store(str(tmp_path / "run"))
    return open_store(request.getfixturevalue("gcs_root"))


# -- checkpoint states and the pointer ---------------------------------------------------


def test_the_current_state_is_the_newest_record(store: Store) -> None:
    ledger = Ledger(store)
    assert ledger.state(10) is None and ledger.states() == {}
    ledger.record(10, "committed")
    ledger.record(20, "committed")
    ledger.record(10, "validated", metrics={"loss": 0.5})
    ledger.record(20, "rejected", reason="loss is NaN")
    ledger.record(30, "committed")
    ledger.record(10, "promoted", location="gs://models/x")

    s10 = ledger.state(10)
    assert s10 is not None
    assert s10["state"] == "promoted" and s10["location"] == "gs://models/x"
    assert s10["metrics"] == {"loss": 0.5}  # a promotion keeps its validation metrics
    assert s10["history"] == ["committed", "validated", "promoted"]
    states = ledger.states()
    assert {s: r["state"] for s, r in states.items()} == {10: "promoted", 20: "rejected", 30: "committed"}
    assert states[20]["reason"] == "loss is NaN"
    assert set(ledger.states([10, 30, 99])) == {10, 30}
    assert ledger.validated_steps() == [10]
    assert ledger.newest_validated() == 10
    # Every record is its own write-once object: nothing was overwritten.
    assert len(store.list("ledger/steps/")) == 6


def test_best_ranks_validated_steps_by_a_finite_metric(store: Store) -> None:
    ledger = Ledger(store)
    for step, loss in [(1, 0.9), (2, 0.3), (3, 0.5), (4, math.nan), (5, 0.3)]:
        ledger.record(step, "validated", metrics={"loss": loss})
    ledger.record(6, "committed")
    ledger.record(3, "rejected", reason="regressed on eval")
    assert ledger.best("loss", 2) == [5, 2]  # tie at 0.3: the newer first
    assert ledger.best("loss", 10, mode="max") == [1, 5, 2]
    assert ledger.best("accuracy") == []


def test_resume_pointer_is_the_newest_pointer_record(store: Store) -> None:
    ledger = Ledger(store)
    assert ledger.pointer() is None
    ledger.set_pointer(200, "checkpoint committed")
    ledger.set_pointer(100, "rollback: 200 rejected")
    assert ledger.pointer() == 100
    rec = ledger.pointer_record()
    assert rec is not None and rec["reason"] == "rollback: 200 rejected"
    assert len(store.list("ledger/pointer/")) == 2


@pytest.mark.parametrize(
    "call",
    [
        lambda led: led.record(1, "exploded"),
        lambda led: led.record(1, "validated"),
        lambda led: led.record(1, "rejected"),
        lambda led: led.record(-1, "committed"),
        lambda led: led.set_pointer("7", "typo"),
    ],
)
def test_bad_records_are_refused(tmp_path: Path, call) -> None:
    with pytest.raises(ValueError):
        call(Ledger(open_store(str(tmp_path))))


# -- the run lock ------------------------------------------------------------------------


def test_a_held_lock_is_refused_with_a_clear_message(store: Store) -> None:
    a = RunLock(store, "trainer-a", lease_s=60)
    a.acquire()
    b = RunLock(store, "trainer-b", lease_s=60)
    with pytest.raises(LockHeld) as err:
        b.acquire()
    msg = str(err.value)
    assert "'trainer-a'" in msg and socket.gethostname() in msg and f"pid {os.getpid()}" in msg
    assert "lease runs out in" in msg and store.uri in msg
    holder = b.held_by()
    assert holder is not None and holder["owner"] == "trainer-a"

    a.release()
    assert b.held_by() is None
    assert b.acquire()["action"] == "acquire"
    assert b.held_by()["owner"] == "trainer-b"  # type: ignore[index]


def test_an_expired_lease_is_taken_over_after_its_margin_and_recorded(store: Store) -> None:
    events = EventLog(store, source="test")
    a = RunLock(store, "trainer-a", lease_s=1.0, margin_s=0.5, on_event=events.emit)
    a.acquire()
    time.sleep(1.2)
    b = RunLock(store, "trainer-b", lease_s=60, margin_s=0.5, on_event=events.emit)
    with pytest.raises(LockHeld):  # lapsed, but not by the margin yet: a takeover could overlap a slow holder
        b.acquire()
    time.sleep(0.6)
    assert a.held_by() is None  # lapsed by more than the margin, by the writer's clock
    with pytest.raises(LockHeld):  # not yet by b's: b first read it 0.6 s ago, and the lease is 1.0 s + 0.5 s
        b.acquire()
    time.sleep(1.1)
    rec = b.acquire()
    assert rec["action"] == "takeover" and rec["previous"]["owner"] == "trainer-a"
    with pytest.raises(LockLost, match="trainer-b"):
        a.refresh()  # a woke up: it must learn it lost the lock, not write over b
    assert b.held_by()["owner"] == "trainer-b"  # type: ignore[index]
    assert [(e["action"], e["owner"]) for e in events.read(("lock",))] == [
        ("acquire", "trainer-a"),
        ("takeover", "trainer-b"),
    ]


def test_a_holder_known_to_have_exited_is_taken_over_at_once_and_only_its_own_generation(store: Store) -> None:
    contact = {"host": "h0", "started": 1.0, "watch": "127.0.0.1:1"}
    a = RunLock(store, "agent h0", lease_s=60, job="j", contact=contact)
    first = a.acquire()
    assert first["contact"] == contact  # every record says how to reach its holder
    a.refresh()
    b = RunLock(store, "agent h1", lease_s=60, job="j")
    with pytest.raises(LockHeld):  # the generation b was told exited is not the newest: the holder renewed since
        b.acquire(holder_exited=int(first["gen"]))
    held = b.held_by()
    assert held is not None and held["contact"] == contact
    rec = b.acquire(holder_exited=int(held["gen"]))  # its 60 s lease is not waited out
    assert rec["action"] == "takeover" and rec["previous"]["owner"] == "agent h0"
    with pytest.raises(LockLost):
        a.refresh()


def test_a_handoff_is_claimed_at_once_by_the_job_and_keeps_everyone_else_out(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    launcher = RunLock(store, "launcher", lease_s=60)
    launcher.acquire()
    launcher.handoff("job-1", lease_s=60)
    with pytest.raises(LockHeld, match="job-1"):
        RunLock(store, "agent of another job", job="job-2").acquire()
    with pytest.raises(LockHeld):
        RunLock(store, "someone").acquire()
    agent = RunLock(store, "agent h0", job="job-1")
    rec = agent.acquire()
    assert rec["action"] == "takeover" and rec["previous"]["owner"] == "launcher" and rec["job"] == "job-1"
    with pytest.raises(LockHeld):  # held now, not a handoff any more: not even the job's other agents take it
        RunLock(store, "agent h1", job="job-1").acquire()


def test_the_lease_keeper_keeps_a_busy_holder_s_lease_and_fences_a_holder_that_lost_it(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    lock = RunLock(store, "leader", lease_s=0.4, margin_s=0.1)
    lock.acquire()
    keeper = LeaseKeeper(lock).start()
    time.sleep(1.5)  # the holder's main loop is busy (waiting for capacity, restoring): the thread refreshes
    other = RunLock(store, "other", lease_s=0.3, margin_s=0.1)
    with pytest.raises(LockHeld):
        other.acquire()
    assert keeper.valid()
    keeper.check()
    keeper.stop()
    time.sleep(0.6)  # no more refreshes: the lease lapses (and the holder knows before anyone may take it)
    assert not keeper.valid()
    with pytest.raises(LockLost):
        keeper.check()
    assert other.wait_lapse(other.newest()[1]) is None  # watched lapsing on its own clock too
    other.acquire()
    with pytest.raises(LockLost):
        LeaseKeeper(RunLock(store, "leader-2", lease_s=0.4))  # nothing to keep: it does not hold the lock
    # A keeper whose lock was taken over learns it at its next refresh, stops being valid, and says so.
    lost: list[str] = []
    other_keeper = LeaseKeeper(other, on_lost=lost.append)
    intruder = RunLock(store, "intruder", lease_s=60, margin_s=0.1)
    assert intruder.wait_lapse(intruder.newest()[1]) is None
    intruder.acquire()
    other_keeper._run_once()
    assert not other_keeper.valid() and lost


def test_refresh_extends_the_lease_and_keeps_few_objects(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    lock = RunLock(store, "trainer", lease_s=30)
    first = lock.acquire()
    for _ in range(12):
        rec = lock.refresh()
    assert rec["expires_at"] >= first["expires_at"] and rec["acquired_at"] == first["acquired_at"]
    assert lock.acquire()["action"] == "refresh"  # re-acquiring our own lock just refreshes it
    assert len(store.list("lock/")) == KEEP_GENERATIONS  # older generations are dropped
    with pytest.raises(LockHeld):
        RunLock(store, "other").acquire()


def test_the_lock_context_manager_releases(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    with RunLock(store, "job-1"):
        assert RunLock(store, "x").held_by()["owner"] == "job-1"  # type: ignore[index]
    assert RunLock(store, "x").held_by() is None


def _race(root: str, rounds: int, barrier, results) -> None:  # runs in a child process
    me = f"racer-{os.getpid()}"
    for r in range(rounds):
        barrier.wait()
        try:
            RunLock(open_store(f"{root}/round-{r}"), me).acquire()
            results.put((r, me))
        except LockHeld:
            pass


def test_two_processes_racing_for_a_free_lock_exactly_one_wins(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    n, rounds = 3, 8
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), rounds, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    winners: dict[int, list[str]] = {}
    while not results.empty():
        r, who = results.get()
        winners.setdefault(r, []).append(who)
    assert {r: len(w) for r, w in winners.items()} == {r: 1 for r in range(rounds)}


# -- pins --------------------------------------------------------------------------------


def test_pins_mark_steps_in_use_until_unpinned_or_stale(store: Store) -> None:
    k5 = pin(store, 5, "trainer", "save")
    pin(store, 7, "validator", "restore")
    assert pinned_steps(store) == {5, 7}
    assert pinned_steps(store, max_age_s=3600, now=time.time() + 7200) == set()  # a crashed job's pins
    unpin(store, k5)
    assert pinned_steps(store) == {7}
    with pinned(store, 9, "rollback", "restore"):
        assert pinned_steps(store) == {7, 9}
    assert pinned_steps(store) == {7}
    with pytest.raises(ValueError):
        pin(store, 1, "x", "read")  # type: ignore[arg-type]
