"""Token datasets: preparation into ArrayRecord shards (``rtrain prepare``).

``prepare`` reads documents (text files, JSONL, Parquet or a saved Hugging
Face dataset: :mod:`training.data.formats`), tokenizes them
(:mod:`training.data.tokenizer`), packs the token stream of each split into
fixed-length records and writes them as ArrayRecord shards into a directory
(local or ``gs://``).  The ``manifest.json`` is written last and names every
shard with its checksum, so a dataset is complete exactly when it has a
manifest: a crash mid-write leaves nothing that looks usable, and re-running
the same preparation finishes the job.  Its readers find the shards through
the manifest (:mod:`training.data.shards`).

With the default ``bytes`` tokenizer, tokens are the input's bytes (vocab 256,
byte 0 ends a document, format 1): no tokenizer to ship, version or download,
and any text on any machine is a valid corpus.  Another tokenizer gives format
2: ids as uint16 or uint32, its end-of-document id, and its definition stored
beside the shards.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from training.data.errors import DatasetError as DatasetError
from training.data.formats import Source, open_source
from training.data.shards import (
    FORMAT,
    MANIFEST,
    TOKENIZED_FORMAT,
    Manifest,
    ShardEntry,
    SplitEntry,
    read_manifest,
)
from training.data.tokenizer import HF_FILE, SPM_FILE, BPETrainer, Tokenizer, TokenizerEntry, resolve
from training.storage import Store, open_store

VOCAB_SIZE = 256
SEPARATOR = 0  # Byte that ends every document of a byte-level dataset.
SPLITS = ("train", "validation")
TOKENIZER_FILES = (HF_FILE, SPM_FILE)
# One record per chunk: grain reads records in a random order, and a larger
# group would decompress a whole group to return one record.
SHARD_OPTIONS = "group_size:1"
ENCODE_BATCH_BYTES = 1 << 20  # Documents are tokenized in batches of about this much text.

log = logging.getLogger(__name__)


class DatasetExistsError(DatasetError):
    """The output already holds a different prepared dataset."""


class _Written(TypedDict):
    """What writing a dataset counted: its input files, bytes and tokens, and its splits."""

    input_files: int
    input_bytes: int
    input_tokens: int
    splits: dict[str, SplitEntry]


# ----------------------------------------------------------------------------
# Inputs.
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _File:
    """An input document as used: the bytes taken from it and their hash."""

    name: str
    nbytes: int
    sha256: str
    split: str = "train"


def _unit_hash(name: str) -> float:
    """A stable number in [0, 1) for a document name: the split does not move when documents are added."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64


def _assign_splits(
    files: list[_File], val_fraction: float, seq_len: int, lengths: dict[str, int] | None = None
) -> list[_File]:
    """Validation is a fraction of whole documents, so no document leaks into both splits.

    If the hash gives validation less than one record (small corpora, tiny
    fractions), documents are moved over in hash order until it has one:
    evaluation must always have something to evaluate.  ``lengths`` are each
    document's tokens with its separator (default: its bytes + 1, the byte-level
    stream); documents already in validation stay there.
    """
    val = {f.name for f in files if f.split == "validation" or _unit_hash(f.name) < val_fraction}
    record = seq_len + 1
    stream = lengths if lengths is not None else {f.name: f.nbytes + 1 for f in files}
    if sum(stream.values()) >= record:
        for f in sorted(files, key=lambda f: _unit_hash(f.name)):
            if sum(stream[n] for n in val) >= record:
                break
            val.add(f.name)
    return [replace(f, split="validation" if f.name in val else "train") for f in files]


def _used(src: Source, files: list[_File]) -> Iterator[tuple[_File, bytes]]:
    """The bytes of ``files`` read again from ``src``, each checked against its hash from the first pass."""
    docs = src.documents()
    try:
        for f in files:
            for doc in docs:
                if doc.name == f.name:
                    break
            else:
                raise DatasetError(f"input {f.name!r} disappeared while it was being prepared; run again")
            data = doc.read(f.nbytes)
            if len(data) != f.nbytes or hashlib.sha256(data).hexdigest() != f.sha256:
                raise DatasetError(f"input {f.name!r} changed while it was being prepared; run again")
            yield f, data
    finally:
        close = getattr(docs, "close", None)
        if close is not None:
            close()


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
        self.shards: list[ShardEntry] = []
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
        import google_crc32c

        self._writer.close()
        self._writer = None
        name = os.path.basename(self._path)
        data = Path(self._path).read_bytes()
        self.store.put(name, data)
        os.unlink(self._path)
        self.shards.append(
            ShardEntry(
                name=name,
                records=self._in_shard,
                bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                crc32c=google_crc32c.value(data),  # what GCS keeps of every object: checked without a read
            )
        )
        self._in_shard = 0
        self.progress(
            f"{self.split}: wrote {name} ({self.written}/{self.records} records)",
        )

    def finish(self) -> SplitEntry:
        if self._writer is not None:
            self._close_shard()
        if self.written != self.records or len(self.shards) != self.count:
            raise DatasetError(f"{self.split}: wrote {self.written} records, planned {self.records}")
        return SplitEntry(records=self.written, shards=self.shards)


def _describe_tokenizer(entry: TokenizerEntry | None) -> str:
    """A tokenizer as named in messages: its kind, vocabulary size and fingerprint."""
    if not entry or entry.get("kind") == "bytes":
        return "bytes"
    fp = str(entry.get("recipe") or entry.get("fingerprint") or "")[:12]
    return f"{entry.get('kind')} (vocab {entry.get('vocab_size')}, fingerprint {fp})"


def _encode(
    tok: Tokenizer, src: Source, files: list[_File], path: str, say: _Progress
) -> tuple[dict[str, int], dict[str, int]]:
    """Tokenize every used document into one local file of ids, each document followed by the eos id.

    Returns each document's offset and length (in tokens, its eos included):
    the split is settled on token counts, and the records of a split are its
    documents' ids concatenated in order.
    """
    dtype = np.dtype(tok.token_dtype)
    eos = np.asarray([tok.eos_id], dtype=dtype)
    offsets: dict[str, int] = {}
    lengths: dict[str, int] = {}
    position = 0
    batch: list[tuple[_File, bytes]] = []
    done = 0

    with open(path, "wb") as out:

        def flush() -> None:
            nonlocal position, done
            for (f, _), ids in zip(batch, tok.encode_documents([d for _, d in batch]), strict=True):
                out.write(ids.astype(dtype, copy=False).tobytes())
                out.write(eos.tobytes())
                offsets[f.name], lengths[f.name] = position, len(ids) + 1
                position += len(ids) + 1
            done += len(batch)
            batch.clear()
            say(f"tokenized {done}/{len(files)} documents, {position:,} tokens", force=False)

        size = 0
        for f, data in _used(src, files):
            batch.append((f, data))
            size += len(data)
            if size >= ENCODE_BATCH_BYTES:
                flush()
                size = 0
        flush()
    say(f"tokenized {len(files)} documents: {position:,} tokens ({tok.kind})")
    return offsets, lengths


def prepare(
    source: str | None,
    output: str,
    seq_len: int,
    *,
    tokenizer: str | Tokenizer = "bytes",
    vocab_size: int | None = None,
    fmt: str | None = None,
    field: str | None = None,
    val_fraction: float = 0.02,
    max_bytes: int | None = None,
    records_per_shard: int = 4096,
    progress: Callable[[str], None] | None = None,
    overwrite: bool = False,
) -> Manifest:
    """Prepares a token dataset at ``output`` and returns its manifest.

    Args:
      source: None for the running Python's standard library (``**/*.py``:
        real text on every machine), a local file, glob or directory, or
        ``gs://bucket/prefix`` (every object under it).
      output: a local directory or ``gs://bucket/prefix``.
      seq_len: tokens per example; records hold ``seq_len + 1`` ids so that
        inputs and targets are the same record shifted by one.
      tokenizer: "bytes" (vocab 256), "bpe" (a byte-level BPE of
        ``vocab_size`` trained on the train split), or the path of a Hugging
        Face ``tokenizer.json`` or SentencePiece ``.model``.
      vocab_size: the BPE's vocabulary size (other tokenizers have their own).
      fmt: "text", "jsonl", "parquet", "hf" (a saved Hugging Face dataset), or
        None / "auto" to detect it from the source.
      field: the JSONL field or Parquet / Hugging Face column of the text
        (default "text").
      val_fraction: fraction of documents (by a stable hash of their names)
        held out for validation; at least one validation record is guaranteed.
      max_bytes: cap on the input bytes (of UTF-8 text) read, documents taken in
        order (the last one possibly cut), so tests and smoke runs stay small.
      records_per_shard: records per ArrayRecord shard (layout only: it is not
        part of the fingerprint).
      progress: called with human-readable progress lines (default: logging).
      overwrite: replace a dataset with a different fingerprint at ``output``.

    Idempotent: with a manifest of the same fingerprint already in place nothing
    is read twice, trained or written.  The inputs are read again to write
    (and to train a BPE) rather than held in memory; the fingerprint is what
    makes "same dataset" decidable before any write.
    """
    _check_args(seq_len, val_fraction, max_bytes, records_per_shard)
    say = _Progress(progress)
    spec: Tokenizer | BPETrainer = resolve(tokenizer, vocab_size) if isinstance(tokenizer, str) else tokenizer

    # Pass 1: hash what will be used.  The fingerprint decides, before anything is
    # written, whether the output is already this dataset, another one, or nothing.
    src = open_source(source, fmt, field)
    say(f"reading {src.files} {src.fmt} file{'' if src.files == 1 else 's'} from {src.desc}")
    files, used = _hash_documents(src, max_bytes, say)
    files = _assign_splits(files, val_fraction, seq_len)
    fingerprint = _fingerprint(spec, files, seq_len, val_fraction, max_bytes)

    store = open_store(output)
    existing = _prepared_already(store, output, fingerprint, spec, overwrite, say)
    if existing is not None:
        return existing

    tok, files, lengths, splits = _write_shards(store, spec, src, files, val_fraction, seq_len, records_per_shard, say)
    written = _Written(input_files=len(files), input_bytes=used, input_tokens=sum(lengths.values()), splits=splits)
    manifest = _manifest(spec, tok, src, fingerprint, seq_len, val_fraction, max_bytes, written)
    _publish(store, output, manifest, say)
    return manifest


def _prepared_already(
    store: Store, output: str, fingerprint: str, spec: Tokenizer | BPETrainer, overwrite: bool, say: _Progress
) -> Manifest | None:
    """The dataset at ``output`` when it is this preparation's already (nothing to do); else None, once the output
    may be written: it holds no dataset, or another one that ``overwrite`` lets this one replace."""
    existing = read_manifest(store)
    if existing is None:
        return None
    if existing.get("fingerprint") == fingerprint:
        say(f"{output} is already prepared (fingerprint {fingerprint[:12]}); nothing to do")
        return existing
    _replace_existing(store, existing, output, fingerprint, _describe_spec(spec), overwrite)
    return None


def _publish(store: Store, output: str, manifest: Manifest, say: _Progress) -> None:
    """Write the dataset's manifest, last: its presence is what makes the dataset exist."""
    store.put(MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    splits, tokenizer = manifest["splits"], manifest["tokenizer"]
    say(
        f"prepared {output}: {splits['train']['records']} train / {splits['validation']['records']} validation "
        f"records of {manifest['seq_len']} tokens, {tokenizer['kind']} tokenizer, vocab {manifest['vocab_size']} "
        f"(fingerprint {manifest['fingerprint'][:12]})"
    )


def _describe_spec(spec: Tokenizer | BPETrainer) -> str:
    """The tokenizer a preparation would use, in words (to compare with an existing dataset's)."""
    if spec.kind == "bytes":
        return _describe_tokenizer(None)
    return _describe_tokenizer({"kind": spec.kind, "vocab_size": spec.vocab_size, "fingerprint": spec.fingerprint})


def _manifest(
    spec: Tokenizer | BPETrainer,
    tok: Tokenizer,
    src: Source,
    fingerprint: str,
    seq_len: int,
    val_fraction: float,
    max_bytes: int | None,
    written: _Written,
) -> Manifest:
    """A dataset's manifest: its format, tokenizer, fingerprint, source and what writing it counted (``written``)."""
    return {
        "format": FORMAT if spec.kind == "bytes" else TOKENIZED_FORMAT,
        "seq_len": seq_len,
        "vocab_size": tok.vocab_size,
        "token_dtype": tok.token_dtype,
        "eos_id": tok.eos_id,
        "tokenizer": tok.manifest_entry() | ({"recipe": spec.fingerprint} if isinstance(spec, BPETrainer) else {}),
        "fingerprint": fingerprint,
        "source": src.desc,
        "input_format": src.fmt,
        "input_files": written["input_files"],
        "input_bytes": written["input_bytes"],
        "input_tokens": written["input_tokens"],
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
        "splits": written["splits"],
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _write_shards(
    store: Store,
    spec: Tokenizer | BPETrainer,
    src: Source,
    files: list[_File],
    val_fraction: float,
    seq_len: int,
    records_per_shard: int,
    say: _Progress,
) -> tuple[Tokenizer, list[_File], dict[str, int], dict[str, SplitEntry]]:
    """Passes 2 and 3: train the tokenizer if asked, tokenize every document, settle the split on token counts,
    and pack each split's stream into shards.  Returns the tokenizer, the files (their splits settled), each
    file's token count and each split's entry of the manifest."""
    record_len = seq_len + 1
    with tempfile.TemporaryDirectory(prefix="rtrain-prepare-") as tmp:
        tok = _train_tokenizer(spec, src, files, say) if isinstance(spec, BPETrainer) else spec
        tokens_path = os.path.join(tmp, "tokens.bin")
        offsets, lengths = _encode(tok, src, files, tokens_path, say)
        files = _assign_splits(files, val_fraction, seq_len, lengths)
        plan = {s: sum(lengths[f.name] for f in files if f.split == s) // record_len for s in SPLITS}
        counts = {s: -(-plan[s] // records_per_shard) for s in SPLITS}
        # Shards of an interrupted or replaced preparation that this one will not
        # overwrite (another shard count), and a tokenizer file it does not use,
        # would otherwise lie about the dataset.
        _remove_stale(store, {_shard_name(s, i, counts[s]) for s in SPLITS for i in range(counts[s])}, tok)
        raw = tok.definition()
        if tok.file is not None and raw is not None:
            store.put(tok.file, raw)
        writers = {s: _ShardedWriter(store, tmp, s, plan[s], records_per_shard, say) for s in SPLITS}
        _pack(tokens_path, np.dtype(tok.token_dtype), record_len, files, offsets, lengths, writers, say)
        return tok, files, lengths, {s: writers[s].finish() for s in SPLITS}


def _fingerprint(
    spec: Tokenizer | BPETrainer, files: list[_File], seq_len: int, val_fraction: float, max_bytes: int | None
) -> str:
    """What makes two preparations the same dataset: its documents, their split, the tokenizer, the shapes."""
    definition: dict[str, object] = {  # hashed as JSON
        "format": FORMAT,
        "seq_len": seq_len,
        "separator": SEPARATOR,
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
        "files": [[f.name, f.nbytes, f.sha256] for f in files],
    }
    if spec.kind != "bytes":  # (a byte-level definition is unchanged, so datasets prepared before still match)
        definition.update(
            format=TOKENIZED_FORMAT, separator=None, tokenizer={"kind": spec.kind, "fingerprint": spec.fingerprint}
        )
    return hashlib.sha256(json.dumps(definition, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _train_tokenizer(spec: BPETrainer, src: Source, files: list[_File], say: _Progress) -> Tokenizer:
    """Pass 2 (bpe only): train the tokenizer on the train split's documents."""
    train = [f for f in files if f.split == "train"]
    say(f"training a byte-level BPE of vocab {spec.vocab_size} on {len(train)} train documents")
    tok = spec.train(data.decode("utf-8", errors="replace") for _, data in _used(src, train))
    say(f"trained the BPE: vocab {tok.vocab_size}, eos id {tok.eos_id}, fingerprint {tok.fingerprint[:12]}")
    return tok


def _check_args(seq_len: int, val_fraction: float, max_bytes: int | None, records_per_shard: int) -> None:
    if seq_len < 1:
        raise DatasetError(f"seq_len must be >= 1, got {seq_len}")
    if not 0.0 <= val_fraction < 1.0:
        raise DatasetError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_bytes is not None and max_bytes < 1:
        raise DatasetError(f"max_bytes must be >= 1 or None, got {max_bytes}")
    if records_per_shard < 1:
        raise DatasetError(f"records_per_shard must be >= 1, got {records_per_shard}")


def _hash_documents(src: Source, max_bytes: int | None, say: _Progress) -> tuple[list[_File], int]:
    """Pass 1: each document that will be used, with its size and SHA-256; the bytes used in all."""
    files: list[_File] = []
    used = 0
    for i, doc in enumerate(src.documents()):
        if max_bytes is not None and used >= max_bytes:
            break
        data = doc.read(None if max_bytes is None else max_bytes - used)
        if data:
            files.append(_File(doc.name, len(data), hashlib.sha256(data).hexdigest()))
            used += len(data)
        say(f"hashed {i + 1} documents, {used:,} bytes", force=False)
    say(f"hashed {len(files)} documents, {used:,} bytes")
    if not files:
        raise DatasetError(f"no input data in {src.desc}")
    return files, used


def _replace_existing(
    store: Store, existing: Manifest, output: str, fingerprint: str, this_tokenizer: str, overwrite: bool
) -> None:
    """Refuse to replace another dataset at ``output`` unless told to; then make it visibly incomplete."""
    if not overwrite:
        raise DatasetExistsError(
            f"{output} already holds a different dataset (fingerprint {str(existing.get('fingerprint'))[:12]}, "
            f"from {existing.get('source')!r}, seq_len {existing.get('seq_len')}, tokenizer "
            f"{_describe_tokenizer(existing.get('tokenizer'))}); this preparation's fingerprint is "
            f"{fingerprint[:12]} (tokenizer {this_tokenizer}). Choose another output or pass overwrite=True."
        )
    # The manifest goes first: from here on the output is visibly incomplete.
    store.delete(MANIFEST)


def _remove_stale(store: Store, planned: set[str], tok: Tokenizer) -> None:
    """Remove shards this preparation will not overwrite and a tokenizer file it does not use.

    (Left by an interrupted or replaced preparation of another shard count, they would lie about the dataset.)
    """
    for key in store.list():
        if "/" in key:
            continue
        stale_shard = key.endswith(".array_record") and key.split("-")[0] in SPLITS and key not in planned
        if stale_shard or (key in TOKENIZER_FILES and key != tok.file):
            store.delete(key)


def _pack(
    tokens_path: str,
    dtype: np.dtype[Any],
    record_len: int,
    files: list[_File],
    offsets: dict[str, int],
    lengths: dict[str, int],
    writers: dict[str, _ShardedWriter],
    say: _Progress,
) -> None:
    """Pack each split's documents, in order, as one stream of token ids cut into records."""
    # (an empty file cannot be mapped)
    size = os.path.getsize(tokens_path)
    stream = np.memmap(tokens_path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
    record_bytes = record_len * dtype.itemsize
    buffers = {s: bytearray() for s in SPLITS}
    for i, f in enumerate(files):
        buf = buffers[f.split]
        buf += stream[offsets[f.name] : offsets[f.name] + lengths[f.name]].tobytes()
        n = len(buf) // record_bytes
        for r in range(n):
            writers[f.split].write(bytes(buf[r * record_bytes : (r + 1) * record_bytes]))
        del buf[: n * record_bytes]
        say(f"packed {i + 1}/{len(files)} documents", force=False)
    del stream
