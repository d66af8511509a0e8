"""The GCS emulator the tests and the bench run: a write costs the same however many objects it holds, and object
generations and their preconditions hold as on GCS (uploads, downloads, deletes), for the run lock and for
tensorstore (Orbax's OCDBT)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from training.emulator import QUICKER

_WRITES = """
from gcp_storage_emulator.storage import Storage
for s in (Storage(use_memory_fs=True), Storage(use_memory_fs=False, data_dir=sys.argv[1])):
    s.create_bucket("b", {"name": "b"})
    for i in range(3):
        s.create_file("b", f"o{i}", b"x", {"name": f"o{i}"})
    try:
        meta = len(json.loads(s._store.read_bytes(".meta"))["objects"]["b"])
    except FileNotFoundError:
        meta = 0
    print(meta, sorted(s.objects["b"]))
"""


def test_the_in_memory_emulator_keeps_no_copy_of_every_object_s_metadata_per_write(tmp_path: Path) -> None:
    """Writing every object's metadata on each write made a write 190 ms at 2,000 objects held (Orbax's saves
    make hundreds a step): in memory nothing reads it back, so it is skipped; on disk it is kept."""
    code = "import json, sys\n" + QUICKER + _WRITES
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["0 ['o0', 'o1', 'o2']", "3 ['o0', 'o1', 'o2']"]
    unpatched = "import json, sys\n" + _WRITES
    out = subprocess.run([sys.executable, "-c", unpatched, str(tmp_path / "b")], capture_output=True, text=True)
    assert out.stdout.splitlines()[0] == "3 ['o0', 'o1', 'o2']"  # what the emulator does by itself


def test_an_upload_whose_generation_precondition_fails_is_refused_as_gcs_refuses_it(gcs_root: str) -> None:
    """The run lock's write-once generations rely on ``ifGenerationMatch``: unpatched, the emulator wrote both of two
    racing creates (two agents then both led one job).  Each upload path is checked: small (multipart) and
    resumable (chunked), a create of an object that exists, and a match on the wrong generation."""
    from google.api_core.exceptions import PreconditionFailed

    from training.storage import GCSStore, open_store

    store = open_store(gcs_root)
    assert isinstance(store, GCSStore)
    blob = store.bucket.blob(store._name("once"))
    blob.upload_from_string(b"first", if_generation_match=0)
    with pytest.raises(PreconditionFailed):
        blob.upload_from_string(b"second", if_generation_match=0)
    blob.reload()
    with pytest.raises(PreconditionFailed):
        blob.upload_from_string(b"third", if_generation_match=int(blob.generation) + 1)
    blob.upload_from_string(b"fourth", if_generation_match=int(blob.generation))
    assert store.get("once") == b"fourth"

    big = store.bucket.blob(store._name("big"), chunk_size=256 * 1024)  # a resumable upload in chunks
    big.upload_from_string(b"a" * 600_000, if_generation_match=0)
    with pytest.raises(PreconditionFailed):
        store.bucket.blob(store._name("big"), chunk_size=256 * 1024).upload_from_string(
            b"b" * 600_000, if_generation_match=0
        )
    assert store.get("big") == b"a" * 600_000


def test_of_racing_creates_of_one_object_exactly_one_wins(gcs_root: str) -> None:
    """Eight threads create the same write-once object at once, as the run lock's writers do: one wins, the others
    get AlreadyExists, and the object holds the winner's bytes."""
    from concurrent.futures import ThreadPoolExecutor

    from training.storage import AlreadyExists, open_store

    def create(i: int) -> int | None:
        store = open_store(gcs_root)  # a client each, as separate agents have
        try:
            store.create("lock/000000000001.json", f"{i}".encode())
        except AlreadyExists:
            return None
        return i

    for _ in range(5):
        with ThreadPoolExecutor(8) as pool:
            won = [i for i in pool.map(create, range(8)) if i is not None]
        assert len(won) == 1, won
        assert open_store(gcs_root).get("lock/000000000001.json") == f"{won[0]}".encode()
        open_store(gcs_root).delete("lock/000000000001.json")


def test_a_client_stalled_mid_request_holds_up_no_other(gcs_root: str) -> None:
    """A client stopped between its headers and its body (a job's process suspended, or one that died), and one
    connected that sent nothing: everyone else is still answered at once, and the stalled upload, once finished,
    lands whole."""
    import json
    import os
    import socket
    import urllib.request
    from urllib.parse import urlparse

    url = os.environ["STORAGE_EMULATOR_HOST"]
    bucket, _, prefix = gcs_root.removeprefix("gs://").partition("/")
    name = f"{prefix}/late"
    body = b"x" * 1000
    head = (
        f"POST /upload/storage/v1/b/{bucket}/o?uploadType=media&name={name} HTTP/1.1\r\n"
        f"Host: {urlparse(url).netloc}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    address = (urlparse(url).hostname, urlparse(url).port)
    with socket.create_connection(address) as silent, socket.create_connection(address) as stalled:
        stalled.sendall(head + body[:10])
        for _ in range(3):
            with urllib.request.urlopen(f"{url}/storage/v1/b/{bucket}/o?prefix={prefix}/", timeout=10) as answer:
                assert json.load(answer).get("items", []) == []
        stalled.sendall(body[10:])
        stalled.settimeout(10)
        assert stalled.recv(4096).startswith(b"HTTP/1.0 200"), "the stalled upload is answered once its body is in"
        silent.close()
    with urllib.request.urlopen(f"{url}/storage/v1/b/{bucket}/o?prefix={prefix}/", timeout=10) as answer:
        assert [(o["name"], o["size"]) for o in json.load(answer)["items"]] == [(name, str(len(body)))]


def _kvstore(gcs_root: str) -> tuple[Any, str]:
    """A tensorstore GCS kvstore on the emulator's bucket (as Orbax opens one), and the root's prefix in it."""
    import tensorstore as ts

    bucket, _, prefix = gcs_root.removeprefix("gs://").partition("/")
    return ts.KvStore.open({"driver": "gcs", "bucket": bucket}, context=ts.Context()).result(), prefix + "/"


def test_tensorstore_reads_an_object_s_generation_and_its_conditional_writes_hold(gcs_root: str) -> None:
    """tensorstore takes an object's generation from a download's ``x-goog-generation`` and conditions its next
    write on it.  Unpatched, it read generation 0 and refused that write itself ("Malformed StorageGeneration"),
    a read conditioned on the current generation sent the bytes again, and a delete on a stale one deleted."""
    kv, at = _kvstore(gcs_root)
    first = kv.write(at + "x", b"one").result().generation
    read = kv.read(at + "x").result()
    assert (read.value, read.stamp.generation) == (b"one", first)
    second = kv.write(at + "x", b"two", if_equal=first).result().generation
    assert second not in (b"", first)
    assert kv.write(at + "x", b"stale", if_equal=first).result().generation == b"", "a stale write must not win"
    unchanged = kv.read(at + "x", if_not_equal=second).result()
    assert (unchanged.state, unchanged.value) == ("unspecified", b""), "not modified: no bytes sent again"
    assert kv.write(at + "x", None, if_equal=first).result().generation == b"", "a stale delete must not win"
    assert kv.read(at + "x").result().value == b"two"
    assert kv.write(at + "x", None, if_equal=second).result().generation != b""
    assert kv.read(at + "x").result().state == "missing"


def test_google_cloud_storage_s_conditional_downloads_and_deletes_hold(gcs_root: str) -> None:
    """The same preconditions through google-cloud-storage: a download carries its generation; one that must not
    match the current generation gets 304, one that must match a stale one 412, and so does a stale delete."""
    from google.api_core.exceptions import NotModified, PreconditionFailed

    from training.storage import GCSStore, open_store

    store = open_store(gcs_root)
    assert isinstance(store, GCSStore)
    blob = store.bucket.blob(store._name("obj"))
    blob.upload_from_string(b"old")
    old = int(blob.generation)
    blob.upload_from_string(b"new")
    new = int(blob.generation)
    reader = store.bucket.blob(store._name("obj"))
    assert reader.download_as_bytes() == b"new" and reader.generation == new, "the download's x-goog-generation"
    with pytest.raises(NotModified):
        reader.download_as_bytes(if_generation_not_match=new)
    with pytest.raises(PreconditionFailed):
        reader.download_as_bytes(if_generation_match=old)
    with pytest.raises(PreconditionFailed):
        store.bucket.get_blob(store._name("obj"), if_generation_match=old)
    with pytest.raises(PreconditionFailed):
        reader.delete(if_generation_match=old)
    assert store.get("obj") == b"new"
    reader.delete(if_generation_match=new)
    assert not store.exists("obj")


def test_two_openers_of_one_ocdbt_database_on_gs_both_commit(gcs_root: str) -> None:
    """OCDBT's manifest is rewritten on the generation its writer read: a second opener of a database (another
    process, or a restore followed by a save) failed to commit on the emulator ("Malformed StorageGeneration")."""
    import tensorstore as ts

    spec = {"driver": "ocdbt", "base": f"{gcs_root}/db/"}
    ts.KvStore.open(spec, context=ts.Context()).result().write("k1", b"one").result()
    second = ts.KvStore.open(spec, context=ts.Context()).result()
    second.write("k2", b"two").result()
    third = ts.KvStore.open(spec, context=ts.Context()).result()
    assert sorted(third.list().result()) == [b"k1", b"k2"]
    assert third.read("k1").result().value == b"one"
