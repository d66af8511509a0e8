"""Dataset preparation is idempotent and crash-safe; the input pipeline keeps the exact data position."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader

from training import data
from training.data import shards
from training.data.shards import Manifest
from training.storage import open_store

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 16
B = 8  # Global batch of the tiny dataset.
STDLIB = {"seq_len": 32, "max_bytes": 200_000, "records_per_shard": 1000}


def write_corpus(root: Path, n_files: int = 12) -> dict[str, bytes]:
    """Files made of one distinct letter each: a record's letters tell which files it came from."""
    files = {f"doc{i:02d}.txt": bytes([ord("A") + i]) * (40 + 7 * i) for i in range(n_files)}
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
    return files


def tiny_prepare(source: str, out: Path | str, **kw) -> Manifest:
    kw = {"val_fraction": 0.2, "records_per_shard": 16, **kw}
    return data.prepare(source, str(out), SEQ_LEN, **kw)


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(directory.iterdir())}


def without_time(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "created_at"}


def read_records(dataset: str, split: str) -> list[bytes]:
    out: list[bytes] = []
    for path in data.local_shards(dataset, split):
        reader = ArrayRecordReader(path)
        out.extend(reader.read_all())
        reader.close()
    return out


def process_batches(dataset: str, *, P: int, p: int, n: int, start: int = 0, seed: int = 0) -> list[dict]:
    it = data.make_batches(
        dataset, "train", seed=seed, global_batch=B, process_index=p, process_count=P, start_batch=start
    )
    return list(itertools.islice(it, n))


def global_stream(dataset: str, n_batches: int, seed: int = 0) -> np.ndarray:
    """The stream of record ids at P=1: position i is element i."""
    return np.concatenate([b["ids"] for b in process_batches(dataset, P=1, p=0, n=n_batches, seed=seed)])


@pytest.fixture(scope="module")
def stdlib_ds(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("stdlib") / "ds"
    data.prepare(None, str(out), **STDLIB)
    return str(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("tiny")
    write_corpus(root / "src")
    tiny_prepare(f"{root}/src/*.txt", root / "ds")
    return str(root / "ds")


# ----------------------------------------------------------------------------
# Preparation.
# ----------------------------------------------------------------------------


def test_prepare_is_deterministic_and_a_rerun_writes_nothing(stdlib_ds: str, tmp_path: Path) -> None:
    messages: list[str] = []
    out = tmp_path / "ds"
    manifest = data.prepare(None, str(out), **STDLIB, progress=messages.append)

    reference = data.load_manifest(stdlib_ds)
    assert without_time(manifest) == without_time(reference)
    for name in [s["name"] for split in data.SPLITS for s in manifest["splits"][split]["shards"]]:
        assert (out / name).read_bytes() == (Path(stdlib_ds) / name).read_bytes()
    assert manifest["input_bytes"] == STDLIB["max_bytes"]
    assert manifest["vocab_size"] == 256 and manifest["format"] == 1
    assert len(manifest["splits"]["train"]["shards"]) > 1
    assert any("hashed" in m for m in messages) and any("wrote train-00000" in m for m in messages)

    before = snapshot(out)
    messages.clear()
    again = data.prepare(None, str(out), **STDLIB, progress=messages.append)
    assert again == manifest  # created_at included: the manifest was not rewritten
    assert snapshot(out) == before
    assert any("nothing to do" in m for m in messages)


CRASH = """
import glob, os, signal, sys
from training import data
out = sys.argv[1]
def progress(msg):
    # Die (no cleanup, no finally) as soon as the first shard is in place.
    if glob.glob(os.path.join(out, "*.array_record")):
        os.kill(os.getpid(), signal.SIGKILL)
data.prepare(None, out, 32, max_bytes=200_000, records_per_shard=1000, progress=progress)
"""


def test_a_crash_mid_write_leaves_no_manifest_and_a_rerun_completes(stdlib_ds: str, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    proc = subprocess.run([sys.executable, "-c", CRASH, str(out)], cwd=REPO, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    shards = sorted(p.name for p in out.glob("*.array_record"))
    assert shards and len(shards) < len(data.load_manifest(stdlib_ds)["splits"]["train"]["shards"])
    assert not (out / data.MANIFEST).exists()
    with pytest.raises(data.DatasetError, match="did not finish"):
        data.load_manifest(str(out))

    manifest = data.prepare(None, str(out), **STDLIB)
    assert without_time(manifest) == without_time(data.load_manifest(stdlib_ds))
    for split in data.SPLITS:
        for s in manifest["splits"][split]["shards"]:
            assert (out / s["name"]).read_bytes() == (Path(stdlib_ds) / s["name"]).read_bytes()


def test_a_different_dataset_in_the_output_is_refused_unless_overwrite(tmp_path: Path) -> None:
    write_corpus(tmp_path / "src")
    out = tmp_path / "ds"
    first = tiny_prepare(f"{tmp_path}/src/*.txt", out)
    (tmp_path / "src" / "doc03.txt").write_bytes(b"changed content " * 20)

    with pytest.raises(data.DatasetExistsError, match=r"different dataset.*overwrite=True"):
        tiny_prepare(f"{tmp_path}/src/*.txt", out, records_per_shard=8)
    assert data.load_manifest(str(out)) == first

    second = tiny_prepare(f"{tmp_path}/src/*.txt", out, records_per_shard=8, overwrite=True)
    assert second["fingerprint"] != first["fingerprint"]
    named = {s["name"] for split in data.SPLITS for s in second["splits"][split]["shards"]}
    # The first dataset's shards (another shard count, other names) are gone.
    assert {p.name for p in out.glob("*.array_record")} == named


def test_splits_are_whole_files_and_validation_is_never_empty(tmp_path: Path) -> None:
    write_corpus(tmp_path / "src")
    for fraction in (0.0, 0.3):
        out = tmp_path / f"ds-{fraction}"
        manifest = tiny_prepare(f"{tmp_path}/src/*.txt", out, val_fraction=fraction)
        assert manifest["splits"]["validation"]["records"] >= 1
        assert manifest["splits"]["train"]["records"] >= 1
        letters = {s: set(b"".join(read_records(str(out), s))) - {data.SEPARATOR} for s in data.SPLITS}
        assert letters["train"] and letters["validation"]
        assert not letters["train"] & letters["validation"], "a document leaked into both splits"


# ----------------------------------------------------------------------------
# The input pipeline.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 2, 4])
def test_each_global_batch_is_partitioned_across_processes(tiny: str, P: int) -> None:
    n = data.load_manifest(tiny)["splits"]["train"]["records"]
    assert n % B, "the tiny dataset should have a batch that straddles an epoch boundary"
    n_batches = 3 * n // B + 2  # Three epochs and a bit.
    per_process = [process_batches(tiny, P=P, p=p, n=n_batches) for p in range(P)]
    for k in range(n_batches):
        parts = [per_process[p][k]["ids"] for p in range(P)]
        assert all(len(part) == B // P for part in parts)
        expected = data.global_batch_ids(tiny, seed=0, global_batch=B, batch_index=k)
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), expected, err_msg=f"batch {k}")
        if k * B // n == ((k + 1) * B - 1) // n:  # Inside one epoch: every record at most once.
            assert len(set(expected.tolist())) == B


def test_epochs_are_permutations_in_a_different_order(tiny: str) -> None:
    n = data.load_manifest(tiny)["splits"]["train"]["records"]
    stream = global_stream(tiny, -(-3 * n // B))
    epochs = [stream[e * n : (e + 1) * n] for e in range(3)]
    for e in epochs:
        np.testing.assert_array_equal(np.sort(e), np.arange(n))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    assert not np.array_equal(global_stream(tiny, 4, seed=1), stream[: 4 * B])


def test_starting_at_batch_k_equals_skipping_k_batches(tiny: str) -> None:
    k = 7
    skipped = process_batches(tiny, P=2, p=1, n=k + 3)[k:]
    resumed = process_batches(tiny, P=2, p=1, n=3, start=k)
    for a, b in zip(skipped, resumed, strict=True):
        for key in ("inputs", "targets", "ids"):
            np.testing.assert_array_equal(a[key], b[key])


def test_changing_the_process_count_continues_the_stream_exactly(tiny: str) -> None:
    k, m = 5, 6
    stream = global_stream(tiny, k + m)
    seen = np.full(len(stream), -1)
    for P, start, count in ((2, 0, k), (4, k, m)):
        for p in range(P):
            for i, batch in enumerate(process_batches(tiny, P=P, p=p, n=count, start=start)):
                positions = (start + i) * B + np.arange(B // P) * P + p
                assert (seen[positions] == -1).all(), "a stream position was served twice"
                seen[positions] = batch["ids"]
    np.testing.assert_array_equal(seen, stream)  # Nothing skipped, nothing repeated, same order.


def test_inputs_and_targets_are_one_record_shifted_by_one(tiny: str) -> None:
    records = read_records(tiny, "train")
    assert all(len(r) == SEQ_LEN + 1 for r in records)
    for batch in process_batches(tiny, P=2, p=0, n=3):
        assert batch["inputs"].dtype == np.int32 and batch["targets"].dtype == np.int32
        assert batch["ids"].dtype == np.int64 and batch["inputs"].shape == (B // 2, SEQ_LEN)
        for i, rid in enumerate(batch["ids"]):
            record = np.frombuffer(records[rid], np.uint8)
            np.testing.assert_array_equal(batch["inputs"][i], record[:-1])
            np.testing.assert_array_equal(batch["targets"][i], record[1:])


def test_eval_batches_are_fixed_in_order_and_independent_of_process_count(tiny: str) -> None:
    n = data.load_manifest(tiny)["splits"]["validation"]["records"]
    one = data.eval_batches(tiny, batch=4, max_batches=100)
    assert len(one) == -(-n // 4)
    np.testing.assert_array_equal(np.concatenate([b["ids"] for b in one])[:n], np.arange(n))
    again = data.eval_batches(tiny, batch=4, max_batches=100)
    for a, b in zip(one, again, strict=True):
        for key in ("inputs", "targets", "ids"):
            np.testing.assert_array_equal(a[key], b[key])
    halves = [data.eval_batches(tiny, batch=4, max_batches=100, process_index=p, process_count=2) for p in range(2)]
    for k, batch in enumerate(one):
        np.testing.assert_array_equal(np.sort(np.concatenate([h[k]["ids"] for h in halves])), np.sort(batch["ids"]))
    assert len(data.eval_batches(tiny, batch=4, max_batches=1)) == 1


def test_global_batch_must_divide_among_processes(tiny: str) -> None:
    with pytest.raises(ValueError, match="divisible by process_count"):
        data.make_batches(tiny, "train", seed=0, global_batch=6, process_index=0, process_count=4)


# ----------------------------------------------------------------------------
# gs://
# ----------------------------------------------------------------------------


@pytest.mark.gcs
def test_gcs_round_trip_matches_a_local_preparation(tiny: str, gcs_root: str, tmp_path: Path) -> None:
    src = open_store(f"{gcs_root}/src")
    for name, content in write_corpus(tmp_path / "local").items():
        src.put(name, content)
    dataset = f"{gcs_root}/ds"
    manifest = tiny_prepare(f"{gcs_root}/src", dataset)
    assert manifest["fingerprint"] == data.load_manifest(tiny)["fingerprint"]
    assert json.loads(open_store(dataset).get(data.MANIFEST)) == manifest
    assert tiny_prepare(f"{gcs_root}/src", dataset) == manifest  # Nothing rewritten.

    cache = tmp_path / "cache"
    remote = data.make_batches(
        dataset, "train", seed=3, global_batch=B, process_index=1, process_count=2, cache_dir=str(cache)
    )
    local = data.make_batches(tiny, "train", seed=3, global_batch=B, process_index=1, process_count=2)
    for a, b in itertools.islice(zip(remote, local, strict=False), 12):  # Both are infinite.
        np.testing.assert_array_equal(a["ids"], b["ids"])
        np.testing.assert_array_equal(a["inputs"], b["inputs"])

    # Cached shards are reused when intact and fetched again when not.
    paths = data.local_shards(dataset, "train", str(cache))
    before = {p: os.stat(p).st_mtime_ns for p in paths}
    assert data.local_shards(dataset, "train", str(cache)) == paths
    assert {p: os.stat(p).st_mtime_ns for p in paths} == before
    Path(paths[0]).write_bytes(b"torn download")
    data.local_shards(dataset, "train", str(cache))
    assert Path(paths[0]).read_bytes() == (Path(tiny) / Path(paths[0]).name).read_bytes()


@pytest.mark.gcs
def test_a_gcs_dataset_whose_bucket_is_mounted_is_read_there_not_downloaded(
    tiny: str, gcs_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GCS FUSE on GKE: the bucket mounted read-only at a path the pod spec names (RTRAIN_GCS_MOUNTS)."""
    bucket, prefix = gcs_root[len("gs://") :].split("/", 1)
    dataset = f"{gcs_root}/ds"
    store = open_store(dataset)
    mount = tmp_path / "mnt" / bucket
    for f in sorted(Path(tiny).iterdir()):
        if f.is_file() and not f.name.startswith("."):
            store.put(f.name, f.read_bytes())
            (mount / prefix / "ds").mkdir(parents=True, exist_ok=True)
            (mount / prefix / "ds" / f.name).write_bytes(f.read_bytes())
    (mount / prefix / "ds").chmod(0o555)  # read-only, as the mount is
    monkeypatch.setenv("RTRAIN_GCS_MOUNTS", f"other=/nowhere,{bucket}={mount}")
    cache = tmp_path / "cache"
    paths = data.local_shards(dataset, "train", str(cache))
    assert paths and all(p.startswith(str(mount / prefix / "ds")) for p in paths)
    assert not [p for p in cache.rglob("*") if p.name != shards.VERIFIED], "nothing downloaded"
    assert (cache / shards.VERIFIED).exists(), "what was verified is remembered off the mount"
    batches = data.make_batches(
        dataset, "train", seed=3, global_batch=B, process_index=0, process_count=1, cache_dir=str(cache)
    )
    local = data.make_batches(tiny, "train", seed=3, global_batch=B, process_index=0, process_count=1)
    for a, b in itertools.islice(zip(batches, local, strict=False), 4):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    # A shard that differs from the manifest on the mount is refused, naming it.
    (mount / prefix / "ds").chmod(0o755)
    Path(paths[0]).write_bytes(b"changed")
    shards._verified_here.clear()
    with pytest.raises(data.DatasetError, match=Path(paths[0]).name):
        data.local_shards(dataset, "train", str(cache))


def _upload(tiny: str, dataset: str) -> None:
    store = open_store(dataset)
    for f in sorted(Path(tiny).iterdir()):
        if f.is_file() and not f.name.startswith("."):
            store.put(f.name, f.read_bytes())


@pytest.mark.gcs
def test_a_gcs_dataset_is_read_in_place_each_host_its_own_records_checked_without_a_download(
    tiny: str, gcs_root: str, tmp_path: Path
) -> None:
    dataset = f"{gcs_root}/in-place"
    _upload(tiny, dataset)
    cache = tmp_path / "cache"
    paths = data.shard_paths(dataset, "train", str(cache), reads="direct")
    assert paths and all(p.startswith(f"{dataset}/train-") for p in paths)
    # Each of two hosts reads its half of every global batch, from any batch on: the local dataset's records.
    for host in (0, 1):
        for start in (0, 5):
            remote = data.make_batches(
                dataset,
                "train",
                seed=3,
                global_batch=B,
                process_index=host,
                process_count=2,
                start_batch=start,
                cache_dir=str(cache),
                reads="direct",
            )
            local = data.make_batches(
                tiny, "train", seed=3, global_batch=B, process_index=host, process_count=2, start_batch=start
            )
            for a, b in itertools.islice(zip(remote, local, strict=False), 6):
                np.testing.assert_array_equal(a["ids"], b["ids"])
                np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not cache.exists(), "nothing was downloaded"
    # "auto" reads a split this small downloaded; "download" always does.
    assert all(p.startswith(str(cache)) for p in data.shard_paths(dataset, "train", str(cache)))
    with pytest.raises(data.DatasetError, match="one of auto, direct, download"):
        data.shard_paths(dataset, "train", reads="stream")


@pytest.mark.gcs
def test_a_gcs_dataset_read_in_place_refuses_a_replaced_shard_and_a_manifest_without_crc32c(
    tiny: str, gcs_root: str
) -> None:
    dataset = f"{gcs_root}/replaced"
    _upload(tiny, dataset)
    store = open_store(dataset)
    manifest = json.loads(store.get(data.MANIFEST))
    shard = manifest["splits"]["validation"]["shards"][0]
    store.put(shard["name"], store.get(shard["name"])[:-1] + b"x")  # same size, other bytes
    with pytest.raises(data.DatasetError, match=f"{shard['name']}.*CRC32C"):
        data.shard_paths(dataset, "validation", reads="direct")
    store.delete(shard["name"])
    with pytest.raises(data.DatasetError, match=f"shard {shard['name']} named in the manifest is missing"):
        data.shard_paths(dataset, "validation", reads="direct")
    # A dataset prepared before the manifest held CRC32Cs cannot be checked in place: it says what to do.
    old = f"{gcs_root}/old"
    _upload(tiny, old)
    for split in manifest["splits"].values():
        for s in split["shards"]:
            s.pop("crc32c")
    open_store(old).put(data.MANIFEST, json.dumps(manifest).encode())
    with pytest.raises(data.DatasetError, match="no CRC32C.*--overwrite"):
        data.shard_paths(old, "train", reads="direct")


def test_a_changed_shard_is_refused_at_load_naming_the_shard_and_its_checksum(tmp_path: Path, monkeypatch) -> None:
    write_corpus(tmp_path / "src")
    out = tmp_path / "ds"
    manifest = tiny_prepare(str(tmp_path / "src" / "*.txt"), out)
    shard = manifest["splits"]["train"]["shards"][0]
    data.local_shards(str(out), "train")  # verified once ...
    hashed: list[str] = []
    real = shards._sha256_file

    def counting(p: Path) -> str:
        hashed.append(str(p))
        return real(p)

    monkeypatch.setattr(shards, "_sha256_file", counting)
    shards._verified_here.clear()  # (as a new process would start)
    data.local_shards(str(out), "train")
    assert hashed == [], "an unchanged shard is not hashed again: its size and mtime are remembered"

    path = out / shard["name"]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte, same size
    path.write_bytes(bytes(raw))
    with pytest.raises(data.DatasetError) as err:
        data.local_shards(str(out), "train")
    msg = str(err.value)
    assert str(path) in msg and shard["sha256"][:16] in msg and "does not match the manifest" in msg

    path.write_bytes(bytes(raw[:-10]))  # truncated
    with pytest.raises(data.DatasetError, match="bytes, the manifest says"):
        data.local_shards(str(out), "train")
