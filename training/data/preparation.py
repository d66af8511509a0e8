"""Byte-level text datasets: preparation into ArrayRecord shards, and the input pipeline.

Two halves, joined by a directory (local or ``gs://``) with one ``manifest.json``:

* ``prepare`` reads text files, packs their bytes into fixed-length records and
  writes them as ArrayRecord shards.  The manifest is written last and names
  every shard with its checksum, so a dataset is complete exactly when it has a
  manifest: a crash mid-write leaves nothing that looks usable, and re-running
  the same preparation finishes the job.
* ``make_batches`` serves the records to the training processes through grain.
  Its one promise is the *data position*: there is a single global stream of
  examples (seeded, reshuffled every epoch) and global batch ``k`` is always the
  same slice of it, however many processes share it.  A job that restarts on a
  different number of hosts at step ``k`` continues at exactly the next
  example: nothing skipped, nothing seen twice.

Tokens are bytes (vocab 256); byte 0 separates documents.  No tokenizer to ship,
version or download, and any text on any machine is a valid corpus.
"""

from __future__ import annotations

import datetime
import glob
import hashlib
import json
import logging
import os
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.storage import NotFound, Store, is_gcs, open_store

FORMAT = 1
VOCAB_SIZE = 256
SEPARATOR = 0  # Byte that ends every document.
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
# One record per chunk: grain reads records in a random order, and a larger
# group would decompress a whole group to return one record.
SHARD_OPTIONS = "group_size:1"

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A dataset that cannot be prepared or read, with a message that says why."""


class DatasetExistsError(DatasetError):
    """The output already holds a different prepared dataset."""


# ----------------------------------------------------------------------------
# Inputs.
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Input:
    """One input document: its relative name (which orders and splits it) and a reader."""

    name: str
    read: Callable[[int | None], bytes]  # At most n bytes (None: all of it).


@dataclass(frozen=True)
class _File:
    """An input document as used: the bytes taken from it and their hash."""

    name: str
    nbytes: int
    sha256: str
    split: str = "train"


def _local_reader(path: str) -> Callable[[int | None], bytes]:
    def read(limit: int | None) -> bytes:
        with open(path, "rb") as f:
            return f.read() if limit is None else f.read(limit)

    return read


def _store_reader(store: Store, key: str) -> Callable[[int | None], bytes]:
    def read(limit: int | None) -> bytes:
        data = store.get(key)
        return data if limit is None else data[:limit]

    return read


def _glob_base(pattern: str) -> str:
    """The directory part of a glob before its first wildcard: names are relative to it."""
    parts = Path(pattern).parts
    base: list[str] = []
    for part in parts[:-1]:
        if any(c in part for c in "*?["):
            break
        base.append(part)
    return str(Path(*base)) if base else "."


def _list_inputs(source: str | None) -> tuple[str, list[_Input]]:
    """The input documents of ``source``, sorted by relative name, and a description of it.

    Names are relative (to the stdlib directory, the glob's base or the gs://
    prefix) so that the same files prepared from a laptop and from a bucket get
    the same fingerprint, split and record order.
    """
    if source is None:
        root = sysconfig.get_paths()["stdlib"]
        paths = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
        # site-packages can live under the stdlib directory (pyenv, /usr/local):
        # it differs from machine to machine, the stdlib does not.
        inputs = [
            _Input(Path(os.path.relpath(p, root)).as_posix(), _local_reader(p))
            for p in paths
            if os.path.isfile(p) and not {"site-packages", "dist-packages"} & set(Path(p).parts)
        ]
        desc = f"stdlib:{root}"
    elif is_gcs(source):
        store = open_store(source)
        inputs = [_Input(key, _store_reader(store, key)) for key in store.list() if not key.endswith("/")]
        desc = source
    else:
        pattern = os.path.expanduser(source)
        if os.path.isdir(pattern):
            pattern = os.path.join(pattern, "**", "*")
        base = _glob_base(pattern)
        inputs = [
            _Input(Path(os.path.relpath(p, base)).as_posix(), _local_reader(p))
            for p in glob.glob(pattern, recursive=True)
            if os.path.isfile(p)
        ]
        desc = source
    return desc, sorted(inputs, key=lambda i: i.name)


def _unit_hash(name: str) -> float:
    """A stable number in [0, 1) for a file name: the split does not move when files are added."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64


def _assign_splits(files: list[_File], val_fraction: float, seq_len: int) -> list[_File]:
    """Validation is a fraction of whole files, so no document leaks into both splits.

    If the hash gives validation less than one record (small corpora, tiny
    fractions), files are moved over in hash order until it has one: evaluation
    must always have something to evaluate.
    """
    val = {f.name for f in files if _unit_hash(f.name) < val_fraction}
    record = seq_len + 1
    stream = {f.name: f.nbytes + 1 for f in files}  # +1: the separator.
    if sum(stream.values()) >= record:
        for f in sorted(files, key=lambda f: _unit_hash(f.name)):
            if sum(stream[n] for n in val) >= record:
                break
            val.add(f.name)
    return [_File(f.name, f.nbytes, f.sha256, "validation" if f.name in val else "train") for f in files]


# ----------------------------------------------------------------------------
# Preparation.
# ----------------------------------------------------------------------------


class _Progress:
    """Rate-limited progress messages: long scans speak every few seconds, not per file."""

    def __init__(self, fn: Callable[[str], None] | None, every_s: float = 2.0) -> None:
        self.fn = fn or log.info
        self.every_s = every_s
        self.last = 0.0

    def __call__(self, msg: str, *, force: bool = True) -> None:
        now = time.monotonic()
        if force or now - self.last >= self.every_s:
            self.last = now
            self.fn(msg)


def _shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.array_record"


def _sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _ShardedWriter:
    """Writes one split's records into numbered shards, uploading each one as it is closed.

    Shards are built in a local temporary directory (ArrayRecord writes local
    files) and handed to the Store whole, so an object in the output is either
    a complete shard or absent.
    """

    def __init__(
        self,
        store: Store,
        tmp: str,
        split: str,
        records: int,
        per_shard: int,
        progress: _Progress,
    ) -> None:
        self.store, self.tmp, self.split, self.progress = store, tmp, split, progress
        self.per_shard = per_shard
        self.count = -(-records // per_shard)
        self.records = records
        self.written = 0
        self.shards: list[dict[str, Any]] = []
        self._writer: Any = None
        self._path = ""
        self._in_shard = 0

    def write(self, record: bytes) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        if self._writer is None:
            self._path = os.path.join(self.tmp, _shard_name(self.split, len(self.shards), self.count))
            self._writer = ArrayRecordWriter(self._path, SHARD_OPTIONS)
        self._writer.write(record)
        self._in_shard += 1
        self.written += 1
        if self._in_shard == self.per_shard:
            self._close_shard()

    def _close_shard(self) -> None:
        self._writer.close()
        self._writer = None
        name = os.path.basename(self._path)
        data = Path(self._path).read_bytes()
        self.store.put(name, data)
        os.unlink(self._path)
        self.shards.append(
            {"name": name, "records": self._in_shard, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        )
        self._in_shard = 0
        self.progress(
            f"{self.split}: wrote {name} ({self.written}/{self.records} records)",
        )

    def finish(self) -> dict[str, Any]:
        if self._writer is not None:
            self._close_shard()
        if self.written != self.records or len(self.shards) != self.count:
            raise DatasetError(f"{self.split}: wrote {self.written} records, planned {self.records}")
        return {"records": self.written, "shards": self.shards}


def prepare(
    source: str | None,
    output: str,
    seq_len: int,
    *,
    val_fraction: float = 0.02,
    max_bytes: int | None = None,
    records_per_shard: int = 4096,
    progress: Callable[[str], None] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Prepares a byte-level dataset at ``output`` and returns its manifest.

    Args:
      source: None for the running Python's standard library (``**/*.py``:
        real text on every machine), a local glob or directory, or
        ``gs://bucket/prefix`` (every object under it).
      output: a local directory or ``gs://bucket/prefix``.
      seq_len: tokens per example; records hold ``seq_len + 1`` bytes so that
        inputs and targets are the same record shifted by one.
      val_fraction: fraction of files (by a stable hash of their names) held out
        for validation; at least one validation record is guaranteed.
      max_bytes: cap on the input bytes read, files taken in name order (the
        last one possibly cut), so tests and smoke runs stay small.
      records_per_shard: records per ArrayRecord shard (layout only: it is not
        part of the fingerprint).
      progress: called with human-readable progress lines (default: logging).
      overwrite: replace a dataset with a different fingerprint at ``output``.

    Idempotent: with a manifest of the same fingerprint already in place nothing
    is written.  The inputs are read twice (hash, then write) rather than held in
    memory; the fingerprint is what makes "same dataset" decidable before any write.
    """
    if seq_len < 1:
        raise DatasetError(f"seq_len must be >= 1, got {seq_len}")
    if not 0.0 <= val_fraction < 1.0:
        raise DatasetError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_bytes is not None and max_bytes < 1:
        raise DatasetError(f"max_bytes must be >= 1 or None, got {max_bytes}")
    if records_per_shard < 1:
        raise DatasetError(f"records_per_shard must be >= 1, got {records_per_shard}")
    say = _Progress(progress)
    record_len = seq_len + 1

    # Pass 1: hash what will be used.  The fingerprint decides, before anything is
    # written, whether the output is already this dataset, another one, or nothing.
    desc, inputs = _list_inputs(source)
    say(f"reading {len(inputs)} files from {desc}")
    files: list[_File] = []
    used = 0
    for i, inp in enumerate(inputs):
        if max_bytes is not None and used >= max_bytes:
            break
        data = inp.read(None if max_bytes is None else max_bytes - used)
        if data:
            files.append(_File(inp.name, len(data), hashlib.sha256(data).hexdigest()))
            used += len(data)
        say(f"hashed {i + 1}/{len(inputs)} files, {used:,} bytes", force=False)
    say(f"hashed {len(files)} files, {used:,} bytes")
    if not files:
        raise DatasetError(f"no input data in {desc}")
    files = _assign_splits(files, val_fraction, seq_len)
    fingerprint = hashlib.sha256(
        json.dumps(
            {
                "format": FORMAT,
                "seq_len": seq_len,
                "separator": SEPARATOR,
                "val_fraction": val_fraction,
                "max_bytes": max_bytes,
                "files": [[f.name, f.nbytes, f.sha256] for f in files],
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
    ).hexdigest()

    store = open_store(output)
    existing = _read_manifest(store)
    if existing is not None:
        if existing.get("fingerprint") == fingerprint:
            say(f"{output} is already prepared (fingerprint {fingerprint[:12]}); nothing to do")
            return existing
        if not overwrite:
            raise DatasetExistsError(
                f"{output} already holds a different dataset (fingerprint {str(existing.get('fingerprint'))[:12]}, "
                f"from {existing.get('source')!r}, seq_len {existing.get('seq_len')}); this preparation's "
                f"fingerprint is {fingerprint[:12]}. Choose another output or pass overwrite=True."
            )
        # The manifest goes first: from here on the output is visibly incomplete.
        store.delete(MANIFEST)

    plan = {split: sum(f.nbytes + 1 for f in files if f.split == split) // record_len for split in SPLITS}
    counts = {split: -(-plan[split] // records_per_shard) for split in SPLITS}
    # Shards of an interrupted or replaced preparation that this one will not
    # overwrite (another shard count) would otherwise lie about the dataset.
    planned = {_shard_name(s, i, counts[s]) for s in SPLITS for i in range(counts[s])}
    for key in store.list():
        if "/" not in key and key.endswith(".array_record") and key.split("-")[0] in SPLITS and key not in planned:
            store.delete(key)

    # Pass 2: pack the byte stream of each split into records, shard by shard.
    with tempfile.TemporaryDirectory(prefix="rtrain-prepare-") as tmp:
        writers = {s: _ShardedWriter(store, tmp, s, plan[s], records_per_shard, say) for s in SPLITS}
        buffers = {s: bytearray() for s in SPLITS}
        by_name = {inp.name: inp for inp in inputs}
        for i, f in enumerate(files):
            data = by_name[f.name].read(f.nbytes)
            if len(data) != f.nbytes or hashlib.sha256(data).hexdigest() != f.sha256:
                raise DatasetError(f"input {f.name!r} changed while it was being prepared; run again")
            buf = buffers[f.split]
            buf += data
            buf.append(SEPARATOR)
            n = len(buf) // record_len
            for r in range(n):
                writers[f.split].write(bytes(buf[r * record_len : (r + 1) * record_len]))
            del buf[: n * record_len]
            say(f"packed {i + 1}/{len(files)} files", force=False)
        splits = {s: writers[s].finish() for s in SPLITS}

    manifest = {
        "format": FORMAT,
        "seq_len": seq_len,
        "vocab_size": VOCAB_SIZE,
        "fingerprint": fingerprint,
        "source": desc,
        "input_files": len(files),
        "input_bytes": used,
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
        "splits": splits,
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    # Last: its presence is what makes the dataset exist.
    store.put(MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    say(
        f"prepared {output}: {splits['train']['records']} train / {splits['validation']['records']} validation "
        f"records of {seq_len} tokens (fingerprint {fingerprint[:12]})"
    )
    return manifest


def _read_manifest(store: Store) -> dict[str, Any] | None:
    try:
        raw = store.get(MANIFEST)
    except NotFound:
        return None
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{store.child(MANIFEST)} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetError(f"{store.child(MANIFEST)}: unsupported manifest format {manifest.get('format')!r}")
    return manifest


def load_manifest(dataset_uri: str) -> dict[str, Any]:
    """The manifest of a prepared dataset; an error if preparation never finished."""
    manifest = _read_manifest(open_store(dataset_uri))
    if manifest is None:
        raise DatasetError(
            f"{dataset_uri} has no {MANIFEST}: it is not a prepared dataset, or its preparation did not finish "
            "(run `rtrain prepare` again to complete it)"
        )
    return manifest


def _split_info(manifest: dict[str, Any], dataset_uri: str, split: str) -> dict[str, Any]:
    if split not in manifest["splits"]:
        raise DatasetError(f"{dataset_uri} has no split {split!r}; it has {sorted(manifest['splits'])}")
    return dict(manifest["splits"][split])


def local_shards(dataset_uri: str, split: str, cache_dir: str | None = None) -> list[str]:
    """Local paths of a split's shards, in record order.

    ArrayRecord readers need local files, so a gs:// dataset is downloaded into
    ``cache_dir`` (default ``~/.cache/rtrain/datasets/<fingerprint>``).  Every
    cached file is checked against the manifest's sha256, so a torn download or
    a stale file from another dataset is fetched again, never trained on.
    Downloads land under a temporary name and are renamed into place, so
    processes sharing the cache do not see each other's partial files.
    """
    manifest = load_manifest(dataset_uri)
    shards = _split_info(manifest, dataset_uri, split)["shards"]
    if not is_gcs(dataset_uri):
        root = Path(dataset_uri).expanduser().resolve()
        paths = [root / s["name"] for s in shards]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise DatasetError(f"{dataset_uri}: shards named in the manifest are missing: {missing[:3]}")
        _verify_local(root, shards)
        return [str(p) for p in paths]

    cache = Path(cache_dir or Path.home() / ".cache" / "rtrain" / "datasets" / manifest["fingerprint"]).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    store = open_store(dataset_uri)
    out = []
    for s in shards:
        path = cache / s["name"]
        if not (path.is_file() and path.stat().st_size == s["bytes"] and _sha256_file(path) == s["sha256"]):
            data = store.get(s["name"])
            digest = hashlib.sha256(data).hexdigest()
            if digest != s["sha256"]:
                raise DatasetError(
                    f"{dataset_uri}/{s['name']}: sha256 {digest[:12]} does not match the manifest's {s['sha256'][:12]}"
                )
            fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{s['name']}.")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        out.append(str(path))
    return out


VERIFIED = ".verified.json"  # shard -> [size, mtime_ns] of the copy whose sha256 matched the manifest
_verified_here: dict[str, tuple[int, int]] = {}


def _verify_local(root: Path, shards: list[dict[str, Any]]) -> None:
    """Check each shard's size and sha256 against the manifest before it is trained on.

    A shard is hashed once per (size, mtime): the result is remembered in this
    process and in ``<dataset>/.verified.json``, so a relaunch does not hash again
    unless the file changed.  A mismatch names the shard and both checksums.
    """
    cache_path = root / VERIFIED
    try:
        cache: dict[str, list[int]] = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    changed = False
    for s in shards:
        path = root / s["name"]
        st = path.stat()
        key = (st.st_size, st.st_mtime_ns)
        if _verified_here.get(str(path)) == key or cache.get(s["name"]) == list(key):
            _verified_here[str(path)] = key
            continue
        if st.st_size != s["bytes"]:
            raise DatasetError(
                f"{path}: {st.st_size} bytes, the manifest says {s['bytes']} (a truncated or replaced shard); "
                "prepare the dataset again"
            )
        digest = _sha256_file(path)
        if digest != s["sha256"]:
            raise DatasetError(
                f"{path}: sha256 {digest[:16]}... does not match the manifest's {s['sha256'][:16]}... "
                "(the shard changed after it was prepared); prepare the dataset again"
            )
        _verified_here[str(path)] = key
        cache[s["name"]] = list(key)
        changed = True
    if changed:
        try:
            fd, tmp = tempfile.mkstemp(dir=root, prefix=f"{VERIFIED}.")
            with os.fdopen(fd, "w") as f:
                json.dump(cache, f)
            os.replace(tmp, cache_path)
        except OSError:  # a read-only dataset: verified again next time, nothing lost
            pass
