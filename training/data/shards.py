"""A prepared token dataset as its readers find it: the manifest, and each split's shards checked against it.

:func:`training.data.preparation.prepare` writes what this module reads; the input pipeline
(:mod:`training.data.pipeline`) opens the paths :func:`shard_paths` returns.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Required, TypedDict, cast

from training.data.errors import DatasetError
from training.data.tokenizer import TokenizerEntry
from training.storage import NotFound, Store, mounted_path, open_store, scheme

FORMAT = 1  # Byte-level datasets (their fingerprint and manifest are unchanged since the first format).
TOKENIZED_FORMAT = 2  # Datasets of another tokenizer: token_dtype, eos_id and the tokenizer in the manifest.
READABLE_FORMATS = (FORMAT, TOKENIZED_FORMAT)
MANIFEST = "manifest.json"
# How a host reads a gs:// dataset: in place (each record a ranged read), downloaded whole into a cache, or by
# size ("auto": in place when a split's shards hold more than DIRECT_READ_BYTES).
READS = ("auto", "direct", "download")
DIRECT_READ_BYTES = 1 << 30


class ShardEntry(TypedDict, total=False):
    """One shard of a split in the manifest: its object's name, its records, its size and checksums."""

    name: Required[str]
    records: Required[int]
    bytes: Required[int]
    sha256: Required[str]
    crc32c: int  # what GCS keeps of every object (absent from manifests written before it was kept)


class SplitEntry(TypedDict):
    """A split in the manifest: its records, and its shards in record order."""

    records: int
    shards: list[ShardEntry]


class Manifest(TypedDict, total=False):
    """A prepared dataset's ``manifest.json``: its format, shapes, tokenizer, fingerprint, source and splits.

    A byte-level dataset (``FORMAT``) may lack the token dtype, eos id and tokenizer: readers default them.
    """

    format: Required[int]
    seq_len: Required[int]
    vocab_size: int
    token_dtype: str
    eos_id: int
    tokenizer: TokenizerEntry
    fingerprint: Required[str]
    source: str
    input_format: str
    input_files: int
    input_bytes: int
    input_tokens: int
    val_fraction: float
    max_bytes: int | None
    splits: Required[dict[str, SplitEntry]]
    created_at: str


def read_manifest(store: Store) -> Manifest | None:
    try:
        raw = store.get(MANIFEST)
    except NotFound:
        return None
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{store.child(MANIFEST)} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
        raise DatasetError(f"{store.child(MANIFEST)}: unsupported manifest format {manifest.get('format')!r}")
    return cast(Manifest, manifest)  # a readable format's: the fields its readers default are optional


def load_manifest(dataset_uri: str) -> Manifest:
    """The manifest of a prepared dataset; an error if preparation never finished."""
    manifest = read_manifest(open_store(dataset_uri))
    if manifest is None:
        raise DatasetError(
            f"{dataset_uri} has no {MANIFEST}: it is not a prepared dataset, or its preparation did not finish "
            "(run `rtrain prepare` again to complete it)"
        )
    return manifest


def _split_info(manifest: Manifest, dataset_uri: str, split: str) -> SplitEntry:
    if split not in manifest["splits"]:
        raise DatasetError(f"{dataset_uri} has no split {split!r}; it has {sorted(manifest['splits'])}")
    entry = manifest["splits"][split]
    return SplitEntry(records=entry["records"], shards=entry["shards"])


def shard_paths(dataset_uri: str, split: str, cache_dir: str | None = None, reads: str = "auto") -> list[str]:
    """Paths of a split's shards that ArrayRecord opens, in record order, each checked against the manifest.

    A ``gs://`` dataset whose bucket is not mounted is read in place (``reads="direct"``, or "auto" for a
    split above ``DIRECT_READ_BYTES``): each host then reads only the records it trains on, nothing is
    downloaded first, and each object's size and CRC32C (which GCS keeps) must be the manifest's.
    Otherwise the shards are local files, a mount or a downloaded copy (``local_shards``).
    """
    if reads not in READS:
        raise DatasetError(f"dataset reads {reads!r}: one of {', '.join(READS)}")
    if scheme(dataset_uri).filesystem or mounted_path(dataset_uri) is not None or reads == "download":
        return local_shards(dataset_uri, split, cache_dir)
    shards = _split_info(load_manifest(dataset_uri), dataset_uri, split)["shards"]
    unsummed = [s["name"] for s in shards if "crc32c" not in s]
    if reads == "auto" and (unsummed or sum(int(s["bytes"]) for s in shards) <= DIRECT_READ_BYTES):
        return local_shards(dataset_uri, split, cache_dir)
    if unsummed:
        raise DatasetError(
            f"{dataset_uri}: the manifest has no CRC32C of {unsummed[0]} (prepared by an older version), so it "
            "cannot be checked in place; prepare it again with --overwrite, or read it downloaded (dataset_reads: "
            "download)"
        )
    return _in_place(dataset_uri, shards)


def _in_place(dataset_uri: str, shards: list[ShardEntry]) -> list[str]:
    """The ``gs://`` URIs of the shards, once each object is the manifest's (size and CRC32C, from a listing)."""
    held = open_store(dataset_uri).checksums()
    for s in shards:
        got = held.get(s["name"])
        if got is None:
            raise DatasetError(f"{dataset_uri}: shard {s['name']} named in the manifest is missing")
        if got != [int(s["bytes"]), int(s["crc32c"])]:
            raise DatasetError(
                f"{dataset_uri}/{s['name']}: {got[0]} bytes with CRC32C {got[1]:08x} do not match the manifest's "
                f"{s['bytes']} bytes with CRC32C {int(s['crc32c']):08x}"
            )
    return [f"{dataset_uri.rstrip('/')}/{s['name']}" for s in shards]


def local_shards(dataset_uri: str, split: str, cache_dir: str | None = None) -> list[str]:
    """Local paths of a split's shards, in record order.

    ArrayRecord readers need local files, so a gs:// dataset is read where its
    bucket is mounted on this host (GCS FUSE, ``RTRAIN_GCS_MOUNTS``), else
    downloaded into ``cache_dir`` (default ``~/.cache/rtrain/datasets/<fingerprint>``).
    Every file is checked against the manifest's sha256, so a torn download or
    a stale file from another dataset is fetched again, never trained on.
    Downloads land under a temporary name and are renamed into place, so
    processes sharing the cache do not see each other's partial files.
    """
    manifest = load_manifest(dataset_uri)
    shards = _split_info(manifest, dataset_uri, split)["shards"]
    mounted = mounted_path(dataset_uri)
    if scheme(dataset_uri).filesystem or mounted is not None:
        root = Path(mounted or dataset_uri).expanduser().resolve()
        paths = [root / s["name"] for s in shards]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise DatasetError(f"{dataset_uri}: shards named in the manifest are missing: {missing[:3]}")
        # A mount is read-only: what was verified is remembered in this host's cache instead.
        verified = None if mounted is None else _cache_root(cache_dir, manifest) / VERIFIED
        _verify_local(root, shards, verified)
        return [str(p) for p in paths]

    cache = _cache_root(cache_dir, manifest)
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


def _cache_root(cache_dir: str | None, manifest: Manifest) -> Path:
    return Path(cache_dir or Path.home() / ".cache" / "rtrain" / "datasets" / manifest["fingerprint"]).expanduser()


VERIFIED = ".verified.json"  # shard -> [size, mtime_ns] of the copy whose sha256 matched the manifest
_verified_here: dict[str, tuple[int, int]] = {}


def _verify_local(root: Path, shards: list[ShardEntry], cache_path: Path | None = None) -> None:
    """Check each shard's size and sha256 against the manifest before it is trained on.

    A shard is hashed once per (size, mtime): the result is remembered in this
    process and in ``cache_path`` (default ``<dataset>/.verified.json``), so a
    relaunch does not hash again unless the file changed.  A mismatch names the
    shard and both checksums.
    """
    cache_path = cache_path or root / VERIFIED
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
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache_path.parent, prefix=f"{VERIFIED}.")
            with os.fdopen(fd, "w") as f:
                json.dump(cache, f)
            os.replace(tmp, cache_path)
        except OSError:  # a read-only dataset: verified again next time, nothing lost
            pass


def _sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
