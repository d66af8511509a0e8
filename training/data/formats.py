"""Input formats for dataset preparation: text files, JSONL, Parquet and saved Hugging Face datasets.

Every format gives the same thing, a stable sequence of documents, each a name
and its text as UTF-8 bytes.  The name is relative to the source (a file's path
under the directory, glob base or gs:// prefix; ``file#row`` for a row of a
JSONL, Parquet or Arrow file), so the same data read from a laptop or a bucket
orders, splits and fingerprints the same way.  Text files keep their raw bytes
(the byte-level tokenizer packs them unchanged); the other formats hold text,
which is encoded as UTF-8.
"""

from __future__ import annotations

import glob
import importlib.util
import io
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from training.data.errors import DatasetError
from training.storage import NotFound, Store, open_store, scheme

FORMATS = ("text", "jsonl", "parquet", "hf")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
HF_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")
DEFAULT_FIELD = "text"


@dataclass(frozen=True)
class Document:
    """One input document: its relative name (which orders and splits it) and a reader of its UTF-8 bytes."""

    name: str
    read: Callable[[int | None], bytes]  # At most n bytes (None: all of it).

    def text(self) -> str:
        """The document as text (bytes that are not UTF-8 become U+FFFD)."""
        return self.read(None).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Source:
    """A described input: its format, how many files it has, and its documents (a fresh pass per call)."""

    desc: str
    fmt: str
    files: int
    documents: Callable[[], Iterator[Document]]


@dataclass(frozen=True)
class _Entry:
    """One input file: its relative name and an opener of its bytes."""

    name: str
    open: Callable[[], IO[bytes]]


# ----------------------------------------------------------------------------
# Listing files.
# ----------------------------------------------------------------------------


def _local(path: str) -> Callable[[], IO[bytes]]:
    return lambda: open(path, "rb")


def _stored(store: Store, key: str) -> Callable[[], IO[bytes]]:
    return lambda: io.BytesIO(store.get(key))


def _glob_base(pattern: str) -> str:
    """The directory part of a glob before its first wildcard: names are relative to it."""
    parts = Path(pattern).parts
    base: list[str] = []
    for part in parts[:-1]:
        if any(c in part for c in "*?["):
            break
        base.append(part)
    return str(Path(*base)) if base else "."


def _stdlib_entries() -> tuple[str, list[_Entry]]:
    root = sysconfig.get_paths()["stdlib"]
    paths = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    # site-packages can live under the stdlib directory (pyenv, /usr/local):
    # it differs from machine to machine, the stdlib does not.
    entries = [
        _Entry(Path(os.path.relpath(p, root)).as_posix(), _local(p))
        for p in paths
        if os.path.isfile(p) and not {"site-packages", "dist-packages"} & set(Path(p).parts)
    ]
    return f"stdlib:{root}", entries


def _entries(source: str) -> list[_Entry]:
    """The files of a glob, directory or gs:// prefix, sorted by relative name."""
    if not scheme(source).filesystem:
        store = open_store(source)
        entries = [_Entry(key, _stored(store, key)) for key in store.list() if not key.endswith("/")]
    else:
        pattern = os.path.expanduser(source)
        if os.path.isdir(pattern):
            pattern = os.path.join(pattern, "**", "*")
        base = _glob_base(pattern)
        entries = [
            _Entry(Path(os.path.relpath(p, base)).as_posix(), _local(p))
            for p in glob.glob(pattern, recursive=True)
            if os.path.isfile(p)
        ]
    return sorted(entries, key=lambda e: e.name)


def _is_hf_dir(source: str) -> bool:
    if not scheme(source).filesystem:
        store = open_store(source)
        return any(store.exists(m) for m in HF_MARKERS)
    path = os.path.expanduser(source)
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in HF_MARKERS)


def detect_format(source: str | None, entries: list[_Entry] | None = None) -> str:
    """The format of ``source``: a saved Hugging Face dataset, else by its files' extensions, else text."""
    if source is None:
        return "text"
    if _is_hf_dir(source):
        return "hf"
    names = [e.name for e in (entries if entries is not None else _entries(source))]
    if names and all(n.endswith(JSONL_SUFFIXES) for n in names):
        return "jsonl"
    if names and all(n.endswith(PARQUET_SUFFIXES) for n in names):
        return "parquet"
    return "text"


# ----------------------------------------------------------------------------
# Documents of each format.
# ----------------------------------------------------------------------------


def _text_documents(entries: list[_Entry]) -> Iterator[Document]:
    for e in entries:

        def read(limit: int | None, e: _Entry = e) -> bytes:
            with e.open() as f:
                return f.read() if limit is None else f.read(limit)

        yield Document(e.name, read)


def _row(name: str, text: str) -> Document:
    data = text.encode("utf-8")
    return Document(name, lambda limit: data if limit is None else data[:limit])


def _jsonl_documents(entries: list[_Entry], field: str) -> Iterator[Document]:
    for e in entries:
        row = 0
        with e.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DatasetError(f"{e.name} line {lineno}: not valid JSON ({err.msg})") from None
                if not isinstance(obj, dict):
                    raise DatasetError(f"{e.name} line {lineno}: a JSON {type(obj).__name__}, not an object")
                if field not in obj:
                    raise DatasetError(
                        f"{e.name} line {lineno}: no field {field!r} (it has {sorted(obj)[:10]}); "
                        "choose the field with --field"
                    )
                value = obj[field]
                if value is not None and not isinstance(value, str):
                    raise DatasetError(
                        f"{e.name} line {lineno}: field {field!r} is a {type(value).__name__}, not a string"
                    )
                yield _row(f"{e.name}#{row}", value or "")
                row += 1


def _check_column(what: str, names: list[str], column: str, types: dict[str, str]) -> None:
    if column not in names:
        raise DatasetError(f"{what} has no column {column!r}; its columns are {names}; choose one with --field")
    if types[column] not in ("string", "large_string"):
        raise DatasetError(f"{what}: column {column!r} is {types[column]}, not a string column")


def _parquet_documents(entries: list[_Entry], column: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    for e in entries:
        with e.open() as f:
            try:
                pf = pq.ParquetFile(f)
            except Exception as err:  # pyarrow raises several types for a file that is not Parquet
                raise DatasetError(f"{e.name}: not a Parquet file ({err})") from None
            schema = pf.schema_arrow
            _check_column(e.name, list(schema.names), column, {n: str(schema.field(n).type) for n in schema.names})
            row = 0
            for batch in pf.iter_batches(columns=[column], batch_size=1024):
                for value in batch.column(0).to_pylist():
                    yield _row(f"{e.name}#{row}", value or "")
                    row += 1


def _arrow_texts(what: str, opener: Callable[[], IO[bytes]], column: str) -> Iterator[str]:
    """The texts of one column of an Arrow stream file (the files ``datasets.save_to_disk`` writes)."""
    import pyarrow as pa

    with opener() as f:
        try:
            reader = pa.ipc.open_stream(f)
        except Exception as err:  # not an Arrow stream
            raise DatasetError(f"{what}: not an Arrow stream file ({err})") from None
        schema = reader.schema
        _check_column(what, list(schema.names), column, {n: str(schema.field(n).type) for n in schema.names})
        index = schema.names.index(column)
        for batch in reader:
            for value in batch.column(index).to_pylist():
                yield value or ""


def _hf_splits(source: str) -> list[str]:
    """The split directories of a saved dataset, relative to it ("" for a single Dataset)."""
    store = open_store(os.path.expanduser(source) if scheme(source).filesystem else source)
    if store.exists("dataset_dict.json"):
        try:
            splits = json.loads(store.get("dataset_dict.json"))["splits"]
        except (ValueError, KeyError, TypeError):
            raise DatasetError(f"{store.child('dataset_dict.json')}: no list of splits") from None
        return sorted(str(s) for s in splits)
    return [""]


def _hf_documents_pyarrow(source: str, column: str) -> Iterator[Document]:
    """A saved Hugging Face dataset read with pyarrow alone: state.json names its Arrow files in order."""
    root = os.path.expanduser(source) if scheme(source).filesystem else source
    store = open_store(root)
    for split in _hf_splits(source):
        prefix = f"{split}/" if split else ""
        try:
            state = json.loads(store.get(f"{prefix}state.json"))
            files = [str(d["filename"]) for d in state["_data_files"]]
            label = split or str(state.get("_split") or "data")
        except (NotFound, ValueError, KeyError, TypeError):  # no state.json: the Arrow files in name order
            files = sorted(
                k[len(prefix) :] for k in store.list(prefix) if k.endswith(".arrow") and "/" not in k[len(prefix) :]
            )
            label = split or "data"
        if not files:
            raise DatasetError(f"{store.child(prefix + 'state.json')}: no Arrow data files in the saved dataset")
        row = 0
        for fname in files:
            key = prefix + fname
            opener = _local(os.path.join(root, key)) if scheme(root).filesystem else _stored(store, key)
            for text in _arrow_texts(store.child(key), opener, column):
                yield _row(f"{label}#{row}", text)
                row += 1


def _hf_documents_datasets(source: str, column: str) -> Iterator[Document]:
    """A saved Hugging Face dataset read with ``datasets.load_from_disk``; the same names as the pyarrow path."""
    import datasets

    loaded = datasets.load_from_disk(os.path.expanduser(source))
    parts: list[tuple[str, Any]] = (
        [(str(k), loaded[k]) for k in sorted(loaded)]
        if isinstance(loaded, datasets.DatasetDict)
        else [(str(loaded.split or "data"), loaded)]
    )
    for label, ds in parts:
        features = {n: str(ds.features[n].dtype) for n in ds.column_names}
        _check_column(f"{source} ({label})", list(ds.column_names), column, features)
        row = 0
        for batch in ds.select_columns([column]).iter(batch_size=1024):
            for value in batch[column]:
                yield _row(f"{label}#{row}", value or "")
                row += 1


def _hf_documents(source: str, column: str) -> Iterator[Document]:
    if scheme(source).filesystem and importlib.util.find_spec("datasets") is not None:
        return _hf_documents_datasets(source, column)
    return _hf_documents_pyarrow(source, column)


def open_source(source: str | None, fmt: str | None = None, field: str | None = None) -> Source:
    """The documents of ``source`` in ``fmt`` (None or "auto": detected), in a stable order.

    ``source``: None for this Python's standard library (``**/*.py``), a local
    file, glob or directory, or ``gs://bucket/prefix``.  ``field``: the JSONL
    field or the Parquet / Hugging Face column holding the text (default "text").
    """
    if fmt in (None, "auto"):
        fmt = None
    elif fmt not in FORMATS:
        raise DatasetError(f"format {fmt!r}: one of auto, {', '.join(FORMATS)}")
    column = field or DEFAULT_FIELD
    if source is None:
        if fmt not in (None, "text"):
            raise DatasetError(f"format {fmt!r} needs a source (the default source, the stdlib, is text)")
        desc, entries = _stdlib_entries()
        entries.sort(key=lambda e: e.name)
        return Source(desc, "text", len(entries), lambda: _text_documents(entries))
    if (fmt is None and _is_hf_dir(source)) or fmt == "hf":
        if not _is_hf_dir(source):
            raise DatasetError(f"{source} is not a saved Hugging Face dataset (no {' / '.join(HF_MARKERS)})")
        return Source(source, "hf", 1, lambda: _hf_documents(source, column))
    entries = _entries(source)
    fmt = fmt or detect_format(source, entries)
    if fmt == "jsonl":
        if not scheme(source).filesystem or os.path.isdir(os.path.expanduser(source)):
            entries = [e for e in entries if e.name.endswith(JSONL_SUFFIXES)]
        return Source(source, fmt, len(entries), lambda: _jsonl_documents(entries, column))
    if fmt == "parquet":
        if not scheme(source).filesystem or os.path.isdir(os.path.expanduser(source)):
            entries = [e for e in entries if e.name.endswith(PARQUET_SUFFIXES)]
        return Source(source, fmt, len(entries), lambda: _parquet_documents(entries, column))
    return Source(source, "text", len(entries), lambda: _text_documents(entries))
