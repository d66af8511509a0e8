"""One local copy of a state: the shards one process holds in one file, written and read in parallel, summed by chunk.

A copy is a directory (a step of the lean format, written by one process)::

    lean/0.bin    every distinct box this process's devices hold, once, one after another
    lean/0.json   where each box is in lean/0.bin, its size and CRC32C per chunk, and their digest
    lean.json     every leaf's dtype and shape, and the data position
    COMMITTED     written last, before the directory gets its name

The bytes move through :mod:`training.checkpoint.bulk`, the interpreter lock released: written by
the save thread alone (the least CPU), checked by several threads.  A reader maps ``lean/0.bin`` (a tmpfs file is memory already: no read, no copy),
checks every chunk's CRC32C in parallel, and hands each device its part straight from the
mapping.  So a restore is one pass over the bytes to check them and one copy into the devices'
own buffers, and nothing else.

JAX is imported inside functions only: the agent imports this module.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.checkpoint import bulk, lean
from training.checkpoint.resume import DataPosition, data_position

STEP_MARK = "COMMITTED"  # written last into a copy, before its directory gets its name
SHARDS = "lean/0.bin"  # the copy's bytes: every box this process holds, once
INDEX = "lean/0.json"  # where each box is in SHARDS, and SHARDS' size, chunk sums and digest as written


class CopyError(ValueError):
    """A copy that cannot be read as written: a file missing, cut short, unreadable or of an earlier format."""


def write(parts: list[Any], tmp: Path, step: int, plan: lean.Plan, data: DataPosition) -> None:
    """Write this process's shards as copy ``step`` into the directory ``tmp``, its mark last.

    ``parts``: the shards' bytes in the order of ``plan`` (the state's :func:`~training.checkpoint.lean.plan`
    with every box held; :func:`~training.checkpoint.lean.shard_bytes`).  A file already at ``tmp``'s
    shard path (a retired copy's, moved there) is overwritten in place.  The caller gives ``tmp`` the
    step's name once this returns.
    """
    (tmp / "lean").mkdir(parents=True, exist_ok=True)
    sums = bulk.write(tmp / SHARDS, parts)
    files = {SHARDS: [sums.size, sums.digest()]}
    index = f'{{"files": {json.dumps(files)}, "chunks": {json.dumps(sums.to_json())}, "entries": {plan.index}}}'
    (tmp / INDEX).write_bytes(index.encode())
    (tmp / lean.META).write_bytes(lean.meta_json(plan, step, 1, data, {}))
    (tmp / STEP_MARK).write_text(json.dumps({"step": step, "time": time.time()}))


@dataclass
class Mapped:
    """A copy opened for reading: its shard file mapped, its index and description parsed (nothing checked yet)."""

    step_dir: Path
    data: Any  # the shard file's bytes (a read-only numpy array mapped from it)
    chunks: bulk.Sums
    digest: int  # the shard file's digest as its writer recorded it
    entries: list[dict[str, Any]]
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def open_mapped(step_dir: Path) -> Mapped:
    """The copy at ``step_dir``, its shard file mapped; CopyError naming the file when one cannot be read."""
    try:
        index = json.loads((step_dir / INDEX).read_bytes())
        meta = json.loads((step_dir / lean.META).read_bytes())
    except FileNotFoundError as e:
        raise CopyError(f"file {Path(e.filename or '?').relative_to(step_dir)} is missing") from None
    except (OSError, ValueError) as e:
        raise CopyError(f"its index or description is unreadable ({e})") from None
    if "chunks" not in index or int(meta.get("format", 0)) != lean.FORMAT:
        raise CopyError("it was written by an earlier version (no chunk sums)")
    try:
        chunks = bulk.Sums.from_json(index["chunks"])
        digest = int(index["files"][SHARDS][1])
        data = bulk.map_file(step_dir / SHARDS)
    except FileNotFoundError:
        raise CopyError(f"file {SHARDS} is missing") from None
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise CopyError(f"file {SHARDS} or its sums are unreadable ({e})") from None
    return Mapped(step_dir, data, chunks, digest, list(index["entries"]), meta)


def check(m: Mapped, pool: Executor) -> str:
    """'' when the mapped copy's bytes are as its writer summed them, else what differs (naming the file)."""
    if m.data.nbytes != m.chunks.size:
        return f"file {SHARDS} has {m.data.nbytes} bytes, {m.chunks.size} when saved (truncated?)"
    if m.chunks.digest() != m.digest:
        return f"file {SHARDS}'s chunk sums do not match its digest (the index is damaged)"
    bad = bulk.first_bad_chunk(m.data, m.chunks, pool)
    if bad is not None:
        return f"file {SHARDS} fails its CRC32C check (chunk {bad}, from byte {bad * m.chunks.chunk})"
    return ""


def restore(m: Mapped, abstract: Any) -> tuple[Any, DataPosition]:
    """The mapped copy as arrays of ``abstract``'s shapes and shardings, and its data position.

    Each device's part is a view of the mapping where one saved box holds it as one run of bytes
    (the mesh it was saved on had the same layout on this host), else put together from the
    boxes it overlaps.  An accelerator copies each into its memory, several at a time from
    several threads; on CPU devices one call puts them all.  A CPU device takes a read-only view as its buffer without a copy, so
    the state then lives in the file's pages until the first step replaces it: such a file must
    not be written over while the state may hold it (the local tier deletes it instead).
    """
    return receive(send(m, abstract))


@dataclass
class InFlight:
    """A mapped copy's parts on their way to their devices (:func:`send`); :func:`receive` makes them the state."""

    abstract: Any
    parts: list[Any]  # one array a device, leaf by leaf (or a Future of one, while its thread puts it there)
    per_leaf: list[int]  # how many parts each leaf has
    data: DataPosition

    def arrived(self) -> list[Any]:
        """The parts on their devices, once every one is there."""
        import jax

        return list(jax.block_until_ready([p.result() if isinstance(p, Future) else p for p in self.parts]))

    def drop(self) -> None:
        """Give the parts' device memory back (a copy that failed its check, a candidate not taken)."""
        for part in self.arrived():
            part.delete()
        self.parts = []


def send(m: Mapped, abstract: Any) -> InFlight:
    """Start putting the mapped copy's parts on their devices, as :func:`restore` does; return without waiting.

    The transfers go on while the caller does something else: checking the copy's sums, for one.
    ValueError when the copy's leaves are not the state's.
    """
    import jax

    saved: dict[str, list[lean.Saved]] = {}
    for e in m.entries:
        box = tuple((int(lo), int(hi)) for lo, hi in e["box"])
        saved.setdefault(e["path"], []).append(lean.Saved(0, box, int(e["offset"]), int(e["nbytes"])))
    leaves = {leaf["path"]: leaf for leaf in m.meta["leaves"]}
    paths_abstract = jax.tree_util.tree_leaves_with_path(abstract)
    lean.same_leaves(set(leaves), {jax.tree_util.keystr(p) for p, _ in paths_abstract})
    blobs = _Mapping(m.data)
    jobs: list[tuple[Any, Any, Any]] = []  # (device, host part, dtype), leaf by leaf, device by device
    per_leaf: list[int] = []
    for path, a in paths_abstract:
        name = jax.tree_util.keystr(path)
        if tuple(leaves[name]["shape"]) != tuple(a.shape):
            raise ValueError(f"the copy's {name} has shape {leaves[name]['shape']}; the state wants {list(a.shape)}")
        dtype = leaves[name]["dtype"]
        places = a.sharding.addressable_devices_indices_map(a.shape)
        for dev, ix in places.items():
            want = lean.box_of(ix, a.shape)
            jobs.append((dev, _part(name, dtype, saved.get(name, []), want, blobs), a.dtype))
        per_leaf.append(len(places))
    hosts, devices = [host.astype(dtype, copy=False) for _, host, dtype in jobs], [dev for dev, _, _ in jobs]
    if not threaded(devices):  # one call: a CPU device takes each mapped part as its buffer, without a copy
        return InFlight(abstract, list(jax.device_put(hosts, devices)), per_leaf, data_position(m.meta["data"]))
    pool = _puts()
    return InFlight(
        abstract,
        [pool.submit(_put, h, d) for h, d in zip(hosts, devices, strict=True)],
        per_leaf,
        data_position(m.meta["data"]),
    )


# Whether a copy's bytes move between host memory and the devices in several threads, a part each (None: on
# accelerators).  An accelerator's transfers run several at a time only from several threads.  On a TPU v5e host,
# for 6.4 GiB: to the chip 4.67 s in one call, 0.58 s from 8 threads; from it 9.3 s as one copy to its pinned host
# memory (whose pages then took 10.7 s to read), 7.5 s in one call, 5.4 s from 8 threads.
THREADED_TRANSFERS: bool | None = None


def threaded(devices: list[Any]) -> bool:
    """Whether parts on (or for) ``devices`` move in threads (:data:`THREADED_TRANSFERS`)."""
    if THREADED_TRANSFERS is not None:
        return THREADED_TRANSFERS
    return bool(devices) and devices[0].platform != "cpu"


_POOL: dict[int, ThreadPoolExecutor] = {}  # by process: a forked child makes its own


def _puts() -> ThreadPoolExecutor:
    pid = os.getpid()
    if pid not in _POOL:
        _POOL.clear()
        _POOL[pid] = ThreadPoolExecutor(bulk.THREADS, thread_name_prefix="rtrain-local-put")
    return _POOL[pid]


def _put(host: Any, device: Any) -> Any:
    """``host`` on ``device``, once it is there (a thread's part of :func:`send`)."""
    import jax

    return jax.block_until_ready(jax.device_put(host, device))


def receive(f: InFlight) -> tuple[Any, DataPosition]:
    """The state :func:`send` is putting on the devices, once every part is there, and its data position."""
    import jax

    parts = f.arrived()
    paths_abstract = jax.tree_util.tree_leaves_with_path(f.abstract)
    out, i = [], 0
    for (_, a), n in zip(paths_abstract, f.per_leaf, strict=True):
        out.append(jax.make_array_from_single_device_arrays(a.shape, a.sharding, parts[i : i + n]))
        i += n
    return jax.tree.unflatten(jax.tree.structure(f.abstract), out), f.data


class _Mapping:
    """The saved boxes of a mapped copy, by where they are in it (what :func:`lean.assemble` reads from)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __call__(self, s: lean.Saved) -> Any:
        return self.data[s.offset : s.offset + s.nbytes]

    def read_into(self, s: lean.Saved, start: int, into: memoryview) -> None:
        into[:] = memoryview(self(s))[start : start + len(into)]


def _part(name: str, dtype: str, saved: list[lean.Saved], want: tuple[tuple[int, int], ...], blobs: _Mapping) -> Any:
    """The box ``want`` of a leaf: a view of the mapping where one saved box holds it as one run, else assembled."""
    import numpy as np

    dt = np.dtype(dtype)
    shape = [hi - lo for lo, hi in want]
    for s in saved:
        span = lean.rows_in(want, s.box)
        if span is not None:
            start = s.offset + span[0] * dt.itemsize
            return blobs.data[start : s.offset + span[1] * dt.itemsize].view(dt).reshape(shape)
    return lean.assemble(name, dt, saved, want, blobs=blobs, shared=False)
