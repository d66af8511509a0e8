"""Bulk bytes between host memory and a local file: summed by chunk, written by one thread, checked by several.

A host's copy of a large state (gigabytes) is written, checked and read here.  Every call that
touches the bytes releases the interpreter lock (``os.pwrite``, the ``crc32c`` package's sum), so
a training loop's thread is not held up while they run.  A file is summed per fixed-size chunk
(:class:`Sums`), so a reader checks its chunks in parallel.

A write is one thread's: each piece is summed and written while it is in the core's cache, which
costs the least CPU (0.27 s a GiB into a tmpfs file here, against 0.5 s for two threads, whose
writes to one file take turns at its lock anyway).  The CPU a save takes is CPU a step does not get.

Nothing here knows about JAX.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CHUNK = 16 << 20  # bytes summed as one: a reader's unit of work
PIECE = 1 << 20  # bytes a writer sums and writes at a time (they stay in the core's cache in between)
THREADS = max(1, min(8, os.cpu_count() or 1))  # threads that check a host's copy


def crc32c(data: Any, value: int = 0) -> int:
    """The CRC32C of ``data`` (any buffer) continuing from ``value``, summed without the interpreter lock."""
    import crc32c as crc

    return int(crc.crc32c(data, value))


@dataclass(frozen=True)
class Sums:
    """A file's size and the CRC32C of each ``chunk`` bytes of it, in order (the last chunk may be short)."""

    size: int
    chunk: int
    crcs: tuple[int, ...]

    def digest(self) -> int:
        """One CRC32C standing for the whole file: the sum of its chunks' sums, each as 4 big-endian bytes."""
        return crc32c(b"".join(c.to_bytes(4, "big") for c in self.crcs))

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "chunk": self.chunk, "crcs": list(self.crcs)}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Sums:
        size, chunk, crcs = int(doc["size"]), int(doc["chunk"]), tuple(int(c) for c in doc["crcs"])
        if chunk <= 0 or len(crcs) != -(-size // chunk):
            raise ValueError(f"{len(crcs)} chunk sums do not describe {size} bytes in chunks of {chunk}")
        return Sums(size, chunk, crcs)


def _views(parts: Sequence[Any]) -> list[memoryview]:
    return [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]


def _chunks(views: list[memoryview], chunk: int) -> list[list[tuple[int, memoryview]]]:
    """The parts laid end to end, cut at every ``chunk`` bytes of the file: each chunk's (file offset, bytes)."""
    out: list[list[tuple[int, memoryview]]] = []
    offset = 0
    for v in views:
        start = 0
        while start < v.nbytes:
            if offset % chunk == 0:
                out.append([])
            n = min(v.nbytes - start, chunk - offset % chunk)
            out[-1].append((offset, v[start : start + n]))
            start += n
            offset += n
    return out


def write(path: Path, parts: Sequence[Any], chunk: int | None = None) -> Sums:
    """Write ``parts`` (buffers) one after another as the file ``path``; their sums per ``chunk`` (:data:`CHUNK`) bytes.

    A file already at ``path`` is overwritten in place, not replaced: its pages (a tmpfs file's
    memory) are reused rather than freed and allocated again.  It is cut to the new size first.
    """
    chunk = chunk or CHUNK
    views = _views(parts)
    size = sum(v.nbytes for v in views)
    crcs: list[int] = []
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, size)
        for pieces in _chunks(views, chunk):
            crc = 0
            for offset, piece in pieces:
                for start in range(0, piece.nbytes, PIECE):
                    bit = piece[start : start + PIECE]
                    crc = crc32c(bit, crc)
                    done = 0
                    while done < bit.nbytes:
                        done += os.pwrite(fd, bit[done:], offset + start + done)
            crcs.append(crc)
    finally:
        os.close(fd)
    return Sums(size, chunk, tuple(crcs))


def map_file(path: Path) -> np.ndarray:
    """The file's bytes as a read-only array mapped from it (a tmpfs file: its memory, no copy); empty for no bytes."""
    size = path.stat().st_size
    if size == 0:
        return np.zeros(0, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(pages, np.uint8, size)


def first_bad_chunk(data: np.ndarray, expected: Sums, pool: Executor) -> int | None:
    """The first chunk of ``data`` (a file's bytes) whose CRC32C differs from ``expected``; None when all agree.

    Reading a mapped file here also brings its pages in, in parallel, for whoever reads it next.
    """
    if data.nbytes != expected.size:
        return 0

    def crc_of(i: int) -> int:
        return crc32c(data[i * expected.chunk : (i + 1) * expected.chunk])

    got = pool.map(crc_of, range(len(expected.crcs)))
    return next((i for i, (a, b) in enumerate(zip(got, expected.crcs, strict=True)) if a != b), None)
