"""The run lock on a disk that has filled up, and changed from two threads: its holder still renews and gives it back."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, cast

import pytest

from training.checkpoint.lock import RunLock
from training.storage import Store, open_store


def test_a_holder_on_a_full_disk_renews_and_releases_the_lock_by_dropping_its_history(tiny_disk) -> None:
    mnt, fill = tiny_disk
    lock = RunLock(open_store(str(mnt)), owner="agent h0", lease_s=30)
    lock.acquire()
    for _ in range(4):
        lock.refresh()
    before = lock.gen
    assert before is not None
    fill()
    with pytest.raises(OSError):  # the disk is full indeed: a new object finds no room
        open_store(str(mnt)).create("events/x.json", b"{}" * 100)
    lock.refresh()  # room made from the lock's own history: the lease is kept
    assert lock.gen == before + 1
    lock.release()
    other = RunLock(open_store(str(mnt)), owner="test")
    assert other.held_by() is None
    gen, rec = other.newest()
    assert rec is not None and rec["action"] == "release" and gen == before + 2
    assert other.acquire()["action"] == "acquire"  # the next owner takes it at once, from the history left


def test_a_full_disk_with_no_history_to_drop_still_refuses_the_write(tiny_disk) -> None:
    mnt, fill = tiny_disk
    lock = RunLock(open_store(str(mnt)), owner="agent h0", lease_s=30)
    lock.acquire()
    fill()
    with pytest.raises(OSError):  # generation 1 is the current state: nothing before it to drop
        lock.refresh()
    assert lock.gen == 1 and RunLock(open_store(str(mnt)), owner="test").held_by() is not None


class PausingStore:
    """A real store whose next create() by the thread named ``refresher`` stops once written, until ``go``."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.armed = threading.Event()
        self.written = threading.Event()
        self.go = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def create(self, key: str, data: bytes) -> None:
        self.store.create(key, data)
        if self.armed.is_set() and threading.current_thread().name == "refresher":
            self.armed.clear()
            self.written.set()
            self.go.wait(10)


def _refresh_paused(tmp_path: Path) -> tuple[RunLock, PausingStore, threading.Thread, list[Exception]]:
    """A held lock whose refresh, in a thread, has written generation 2 and is stopped before counting it."""
    store = PausingStore(open_store(str(tmp_path)))
    lock = RunLock(cast(Store, store), owner="agent h0", lease_s=30)
    lock.acquire()
    errors: list[Exception] = []

    def refresh() -> None:
        try:
            lock.refresh()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            errors.append(e)

    store.armed.set()
    refresher = threading.Thread(target=refresh, name="refresher")
    refresher.start()
    assert store.written.wait(10)
    return lock, store, refresher, errors


def test_a_release_during_a_refresh_waits_for_it_then_gives_the_lease_back(tmp_path: Path) -> None:
    lock, store, refresher, errors = _refresh_paused(tmp_path)
    releaser = threading.Thread(target=lock.release)
    releaser.start()
    releaser.join(1.0)  # a release not waiting for the refresh ends here: its generation 2 was taken
    store.go.set()
    refresher.join(10)
    releaser.join(10)
    assert errors == [] and lock.gen is None
    gen, rec = RunLock(open_store(str(tmp_path)), owner="test").newest()
    assert rec is not None and (gen, rec["action"]) == (3, "release")  # not the refresh's lease left held


def test_a_lock_forgotten_during_a_refresh_stays_forgotten(tmp_path: Path) -> None:
    lock, store, refresher, errors = _refresh_paused(tmp_path)
    lock.forget()  # a leader stepping down while its stopped keeper's refresh is still under way
    store.go.set()
    refresher.join(10)
    assert errors == [] and lock.gen is None
    lock.release()  # nothing of ours: nothing written
    gen, rec = RunLock(open_store(str(tmp_path)), owner="test").newest()
    assert rec is not None and (gen, rec["action"]) == (2, "refresh")
