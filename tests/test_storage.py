"""The run-root store behaves the same on a local path and on gs:// (emulator)."""

from __future__ import annotations

import time

import pytest

from training.storage import AlreadyExists, NotFound, open_store, scheme


@pytest.fixture(params=["local", "gcs"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "root"))
    return open_store(request.getfixturevalue("gcs_root"))


def test_put_get_list_delete(store):
    store.put("a/x.json", b"1")
    store.put("a/y.json", b"2")
    store.put("b/z.json", b"3")
    store.put("a/x.json", b"4")  # put replaces
    assert store.get("a/x.json") == b"4"
    assert store.list("a/") == ["a/x.json", "a/y.json"]
    assert store.list() == ["a/x.json", "a/y.json", "b/z.json"]
    store.delete("a/")
    assert store.list() == ["b/z.json"]
    with pytest.raises(NotFound):
        store.get("a/x.json")


def test_an_object_is_written_from_parts_and_read_back_by_ranges(store):
    parts = [bytes([i]) * (100_000 + i) for i in range(5)]  # not chunk-aligned
    store.put_parts("big/x.bin", (memoryview(p) for p in parts))
    whole = b"".join(parts)
    assert store.get("big/x.bin") == whole
    for start, size in [(0, 10), (99_999, 3), (len(whole) - 7, 7), (250_000, 100_000)]:
        assert store.get_range("big/x.bin", start, size) == whole[start : start + size]
    assert store.get_range("big/x.bin", 5, 0) == b""
    with pytest.raises(NotFound):
        store.get_range("big/nope.bin", 0, 1)


def test_usage_counts_the_bytes_and_newest_write_under_a_prefix_only(store):
    before = time.time() - 5  # a GCS emulator's clock and this one may differ a little
    store.put("checkpoints/5/state/a", b"x" * 100)
    store.put("checkpoints/5/data/b", b"y" * 23)
    store.put("checkpoints/50/a", b"z" * 1000)
    size, newest = store.usage("checkpoints/5")
    assert size == 123 and newest is not None and newest >= before
    assert store.usage("checkpoints/7") in ((0, None), (0, 0.0))


def test_each_scheme_states_what_may_be_assumed_of_it(tmp_path, monkeypatch):
    local, gcs = scheme(str(tmp_path)), scheme("gs://bucket/runs")
    assert (local.name, local.filesystem, local.requests, local.atomic_rename) == ("file", True, False, True)
    assert (gcs.name, gcs.filesystem, gcs.requests, gcs.atomic_rename) == ("gs", False, True, False)
    assert gcs.cached_listings and not local.cached_listings
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9023")
    assert scheme("gs://bucket/runs") == gcs, "an emulator is GCS to the code above the store"


def test_create_is_write_once(store):
    store.create("events/0001.json", b"first")
    with pytest.raises(AlreadyExists):
        store.create("events/0001.json", b"second")
    assert store.get("events/0001.json") == b"first"


def test_keys_cannot_escape_the_root(store):
    with pytest.raises(ValueError):
        store.put("../outside", b"x")


def test_delete_of_a_prefix_spares_its_siblings(store):
    store.put("checkpoints/5/a", b"x")
    store.put("checkpoints/50/a", b"y")
    store.delete("checkpoints/5")
    assert store.list("checkpoints/") == ["checkpoints/50/a"]
    assert store.list("missing/") == []


def test_move_relocates_a_prefix(store):
    store.put("checkpoints/15/state/a", b"1")
    store.put("checkpoints/15/data/b", b"2")
    store.put("checkpoints/150/x", b"3")
    store.move("checkpoints/15", "quarantine/15-1")
    assert store.list("checkpoints/") == ["checkpoints/150/x"]
    assert store.list("quarantine/") == ["quarantine/15-1/data/b", "quarantine/15-1/state/a"]
    assert store.get("quarantine/15-1/state/a") == b"1"


def test_a_root_that_is_not_there_lists_and_checksums_nothing(tmp_path):
    # Not its parent's files: a pruned checkpoint directory has no objects (and none "../" of it).
    (tmp_path / "beside.json").write_text("{}")
    gone = open_store(str(tmp_path / "pruned"))
    assert gone.list() == [] and gone.list("a/") == [] and gone.checksums() == {}


def test_create_in_writes_into_a_reserve_and_gives_it_up(store):
    store.put("r/reserve", bytes(4096))
    store.create_in("r/reserve", "events/last.json", b'{"type": "failed"}')
    assert store.get("events/last.json") == b'{"type": "failed"}'
    assert not store.exists("r/reserve")
    store.put("r/reserve", bytes(4096))
    with pytest.raises(AlreadyExists):
        store.create_in("r/reserve", "events/last.json", b"again")
    assert store.get("events/last.json") == b'{"type": "failed"}'


def test_a_full_disk_still_takes_an_object_written_into_its_reserve(tiny_disk):
    mnt, fill = tiny_disk
    s = open_store(str(mnt))
    s.put("reserve", bytes(65536))
    s.create("events/first.json", b"{}")  # the run's events directory exists by then
    fill()
    with pytest.raises(OSError):
        s.create("events/x.json", b"{}" * 100)
    s.create_in("reserve", "events/x.json", b"{}" * 100)
    assert s.get("events/x.json") == b"{}" * 100


def test_what_fails_for_now_is_told_from_what_will_keep_failing() -> None:
    import errno

    from google.api_core.exceptions import NotFound as GNotFound
    from google.api_core.exceptions import RetryError, ServiceUnavailable

    from training.storage import is_transient

    assert is_transient(OSError(errno.ETIMEDOUT, "timed out")) and is_transient(ConnectionResetError())
    assert not is_transient(OSError(errno.ENOSPC, "full")) and not is_transient(OSError(errno.EROFS, "ro"))
    assert is_transient(ServiceUnavailable("503")) and is_transient(RetryError("deadline", None))
    assert not is_transient(GNotFound("404")) and not is_transient(ValueError("bad json"))


def test_an_injected_outage_fails_only_the_stores_under_its_root_as_their_kind_fails(tmp_path, gcs_root) -> None:
    import errno

    from google.api_core.exceptions import RetryError

    from training import storage

    run, other = open_store(str(tmp_path / "run")), open_store(str(tmp_path / "local-tier"))
    gcs = open_store(gcs_root)
    try:
        storage.disturb(str(tmp_path / "run"), 30)
        with pytest.raises(OSError) as e:
            run.put("status.json", b"{}")
        assert e.value.errno == errno.ETIMEDOUT
        other.put("x", b"1")  # another root (the local tier) is not touched
        assert other.get("x") == b"1"
        storage.disturb(gcs_root, 30)
        with pytest.raises(RetryError):
            gcs.get("status.json")
        run.put("status.json", b"{}")  # one disturbance at a time: the local run root is back
    finally:
        storage.disturb("", 0)
    gcs.put("status.json", b"{}")


def test_a_gs_root_whose_bucket_is_deleted_raises_root_gone_on_writes_and_listings(gcs_emulator) -> None:
    """Once its bucket is deleted, a gs:// root's writes and listings fail for good, naming the root and the bucket;
    a read of one object is still just "not found"."""
    import uuid

    from training.storage import RootGone, gcs_client, is_transient

    name = f"gone-{uuid.uuid4().hex[:8]}"
    bucket = gcs_client().create_bucket(name)  # type: ignore[attr-defined]
    store = open_store(f"gs://{name}/runs/r")
    store.put("status.json", b"{}")
    store.delete("status.json")
    bucket.delete()
    said = f"the run root gs://{name}/runs/r is gone \\(bucket {name} not found\\)"
    for call in (
        lambda: store.put("status.json", b"{}"),
        lambda: store.create("lock/000000000001.json", b"{}"),
        lambda: store.put_parts("shards.bin", [memoryview(b"ab")]),
        lambda: store.list("lock/"),
    ):
        with pytest.raises(RootGone, match=said) as gone:
            call()
        assert not is_transient(gone.value)
    with pytest.raises(NotFound):
        store.get("status.json")
