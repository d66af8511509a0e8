"""The run lock on a disk that has filled up: its holder still renews and gives it back."""

from __future__ import annotations

import pytest

from training.checkpoint.lock import RunLock
from training.storage import open_store


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
