"""The lean checkpoint format: each process writes its shards once, with an index.

Retired for persistent steps: Orbax's OCDBT commits and restores faster at 1 GiB a process, on a
local disk and on gs:// (``rtrain bench --only formats``); lean won only the fixed cost per save.
``checkpoint_format: lean`` now reads as ``auto``.  Steps older runs saved in it still restore
(:func:`restore`, through :func:`training.checkpoint.manager.restore`), and the local tier
(:mod:`training.checkpoint.local`) writes its copies as lean steps of one process.

A step saved this way is one directory, like an Orbax step, and commits by Orbax's rule for its
root (a rename locally, ``commit_success.txt`` on gs://), so the steps, their integrity records,
pruning and the ledger treat both formats alike::

    <step>/lean/<p>.bin    the shards process p wrote, one after another
    <step>/lean/<p>.json   where each of them is (the leaf's path, its box, offset and bytes), and
                           the size and CRC32C of the .bin, summed as it was written
    <step>/lean.json       by process 0 once every process has written: every leaf's dtype and
                           shape, the data position, the config and how many processes wrote
    <step>/integrity.json  by process 0 from the processes' sums, just before it commits the step

Every distinct shard (a box of an array) is written by one device among those that hold it,
chosen by a hash of the leaf and the box, so replicas share the writing.  A save is two barriers
of the coordination service and a few files per process: none of Orbax's per-array machinery.
A restore reads any mesh's step onto the current one: each device's part is put together from
the saved boxes it overlaps.

JAX is imported inside functions only.
"""

from __future__ import annotations

import itertools
import json
import os
import zlib
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from training.checkpoint.resume import DataPosition, data_position
from training.checkpoint.steps import INTEGRITY, committed_steps
from training.layout import checkpoints_uri
from training.storage import NotFound, join, open_store, scheme

META = "lean.json"
FORMAT = 1
COMMIT_FILE = "commit_success.txt"  # Orbax's commit marker on roots without an atomic rename
TMP_SUFFIX = ".orbax-checkpoint-tmp-lean"  # Orbax sees it as temporary: not a step until renamed
BARRIER_TIMEOUT_S = 300
ALIGN = 64  # bytes: a host buffer this aligned becomes a CPU device's own without a copy
READERS = min(4, os.cpu_count() or 1)  # threads a read onto one device uses
POPULATE_BYTES = 1 << 20  # a restored buffer this large is mapped populated (mapping is page-aligned)


def is_lean(step_dir: str) -> bool:
    """Whether the committed step at ``step_dir`` was saved in this format."""
    return open_store(step_dir).exists(META)


def saved_data_position(step_dir: str) -> DataPosition:
    """The data position saved with the step at ``step_dir`` (no JAX needed)."""
    return data_position(read_meta(step_dir)["data"])


def _keys(path: Any) -> list[str | int]:
    """A leaf's path as plain keys (a dict key, an attribute name or a position)."""
    out: list[str | int] = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                v = getattr(k, attr)
                out.append(v if isinstance(v, int) else str(v))
                break
    return out


def box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index (slices) as its box: each dimension's (start, stop)."""
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape, strict=True))


def _writers(name: str, x: Any) -> set[Any]:
    """The devices that write ``x``'s shards: for each distinct box, one of the devices holding it."""
    holders: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for dev, index in x.sharding.devices_indices_map(x.shape).items():
        holders.setdefault(box_of(index, x.shape), []).append(dev)
    out = set()
    for box, devs in holders.items():
        devs.sort(key=lambda d: d.id)
        out.add(devs[zlib.crc32(f"{name}{box}".encode()) % len(devs)])
    return out


@dataclass(frozen=True)
class Plan:
    """What one process writes of a state of one structure and sharding (the same at every save of a round).

    ``picks``: per leaf, the positions among its addressable shards this process writes;
    ``leaves`` and ``index``: the JSON of every leaf's dtype and shape, and of where each written
    shard goes in this process's file (its offsets follow from the shapes); ``pads``: the zero
    bytes before each written shard (none unless the plan aligns them).
    """

    structure: Any
    picks: tuple[tuple[int, ...], ...]
    leaves: str
    index: str
    pads: tuple[int, ...] = ()


def plan(state: Any, *, every_held_box: bool = False, align: int = 1) -> Plan:
    """This process's plan for saving ``state`` (its structure, shardings and shapes; not its values).

    A process writes the boxes it is the writer of (:func:`_writers`: together, the processes write
    every box once); with ``every_held_box``, each distinct box its devices hold (a host's own copy).
    Each box starts at a multiple of ``align`` bytes of the file.
    """
    import jax
    import numpy as np

    leaves, entries, picks, pads = [], [], [], []
    offset = 0
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        name = jax.tree_util.keystr(path)
        leaves.append({"path": name, "keys": _keys(path), "dtype": str(x.dtype), "shape": list(x.shape)})
        writers = None if every_held_box else _writers(name, x)
        mine, seen = [], set()
        for i, shard in enumerate(x.addressable_shards):
            box = box_of(shard.index, x.shape)
            if (writers is not None and shard.device not in writers) or box in seen:
                continue
            seen.add(box)
            nbytes = int(np.prod([hi - lo for lo, hi in box], dtype=np.int64)) * np.dtype(x.dtype).itemsize
            pads.append(-offset % align)
            offset += pads[-1]
            entries.append({"path": name, "box": [list(b) for b in box], "offset": offset, "nbytes": nbytes})
            offset += nbytes
            mine.append(i)
        picks.append(tuple(mine))
    return Plan(jax.tree.structure(state), tuple(picks), json.dumps(leaves), json.dumps(entries), tuple(pads))


def sums(parts: list[Any]) -> list[int]:
    """The size and CRC32C of the file ``parts`` (bytes or arrays) make, one after another."""
    import google_crc32c

    crc, size = google_crc32c.Checksum(), 0
    for part in parts:
        crc.update(part)
        size += memoryview(part).nbytes
    return [size, int.from_bytes(crc.digest(), "big")]


def shard_bytes(state: Any, p: Plan, pool: Executor | None = None) -> list[Any]:
    """The bytes of the shards ``p`` picks of ``state`` (flat uint8 arrays), in the order of its index, each after
    the zero bytes that align it.

    With ``pool``, its threads fetch the shards, several at a time.  An accelerator's shard comes into new host
    memory; a CPU device's is a view of its buffer, which a donating step then leaves alone.
    """
    import jax
    import numpy as np

    shards = [x.addressable_data(i) for x, picks in zip(jax.tree.leaves(state), p.picks, strict=True) for i in picks]

    def host(a: Any) -> Any:
        return np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)

    fetched = pool.map(host, shards) if pool is not None else map(host, shards)
    parts = []
    for pad, got in zip(
        itertools.chain(p.pads, itertools.repeat(0)), fetched, strict=False
    ):  # (pads: 0 past the plan's)
        if pad:
            parts.append(np.zeros(pad, np.uint8))
        parts.append(got)
    return parts


def index_json(p: Plan, files: dict[str, list[int]]) -> bytes:
    """A process's index: the size and CRC32C of its file (``files``; may be empty) and where each shard is."""
    return f'{{"files": {json.dumps(files)}, "entries": {p.index}}}'.encode()  # the entries' JSON made once


def meta_json(p: Plan, step: int, processes: int, data: DataPosition, config: dict[str, Any]) -> bytes:
    """A step's description (``lean.json``): every leaf's dtype and shape, the data position, the config."""
    head = json.dumps({"format": FORMAT, "step": step, "processes": processes, "data": data, "config": config})
    return f'{head[:-1]}, "leaves": {p.leaves}}}'.encode()  # the leaves' JSON made once


def write_shards(state: Any, step_dir: str, process: int, p: Plan) -> dict[str, list[int]]:
    """Write the shards of ``state`` this process is the writer of; the size and CRC32C of each file written."""
    parts = shard_bytes(state, p)
    written = {f"lean/{process}.bin": sums(parts)}
    store = open_store(step_dir)
    store.delete(f"lean/{process}.json")  # an index left by a save of this step cut off before: it would not match
    store.put_parts(f"lean/{process}.bin", (part.data for part in parts))
    index = index_json(p, written)
    store.put(f"lean/{process}.json", index)
    return {**written, f"lean/{process}.json": sums([index])}


@dataclass
class LeanManager:
    """The persistent checkpoints of a run in the lean format, written only by the formats bench
    (``benchmarks/formats.py``, the evidence for lean's retirement) and to test that old steps restore.

    :meth:`save` writes, commits and returns on every process (a save thread calls it); nothing of
    it runs later, so a save is never in progress once it has returned.  Each process records the
    size and CRC32C of what it wrote in its index; process 0 makes the step's integrity record of
    them, so no file is read back.
    """

    run: str
    processes: int
    process: int
    config: dict[str, Any]
    saves: int = 0
    plan: Plan | None = None

    @property
    def directory(self) -> str:
        return checkpoints_uri(self.run)

    def save(self, step: int, state: Any, data: DataPosition) -> bool:
        import jax
        from orbax.checkpoint import multihost

        self.saves += 1
        everyone = set(range(self.processes))
        final = join(self.directory, str(step))
        renamed = scheme(final).atomic_rename
        step_dir = final + TMP_SUFFIX if renamed else final
        if self.plan is None or self.plan.structure != jax.tree.structure(state):
            self.plan = plan(state)
        # A process whose write fails (a full disk) still meets the others at both barriers, so that none
        # waits for it; without its index process 0 does not commit, and every process learns it.
        error: Exception | None = None
        mine: dict[str, list[int]] = {}
        try:
            if self.process == 0 and (Path(final).exists() if renamed else open_store(final).exists(COMMIT_FILE)):
                raise FileExistsError(f"checkpoint {step} exists already at {final}")
            mine = write_shards(state, step_dir, self.process, self.plan)
        except OSError as e:
            error = e
        multihost.sync_global_processes(
            f"rtrain-lean-{step}-{self.saves}-written", processes=everyone, timeout=BARRIER_TIMEOUT_S
        )
        if self.process == 0 and error is None:
            try:
                self._commit(step, step_dir, final if renamed else "", mine, data)
            except (OSError, RuntimeError) as e:
                error = e
        multihost.sync_global_processes(
            f"rtrain-lean-{step}-{self.saves}-committed", processes=everyone, timeout=BARRIER_TIMEOUT_S
        )
        if error is not None:
            raise error
        return True

    def _commit(self, step: int, step_dir: str, rename_to: str, mine: dict[str, list[int]], data: DataPosition) -> None:
        """Process 0: the step's description, its integrity record, then its commit (a rename or a marker)."""
        assert self.plan is not None
        store = open_store(step_dir)
        files = dict(mine)
        for p in range(1, self.processes):
            try:
                raw = store.get(f"lean/{p}.json")
            except NotFound:
                raise RuntimeError(f"process {p} did not write its part of checkpoint {step}") from None
            files[f"lean/{p}.json"] = sums([raw])
            files.update(json.loads(raw)["files"])
        meta = meta_json(self.plan, step, self.processes, data, self.config)
        store.put(META, meta)
        files[META] = sums([meta])
        store.put(INTEGRITY, json.dumps(files, sort_keys=True).encode())
        if rename_to:
            os.rename(step_dir, rename_to)
        else:
            store.put(COMMIT_FILE, b"committed")

    # What the saver asks of Orbax's manager: a lean save is over when save() returns.
    def check_for_errors(self) -> None:
        return None

    def is_saving_in_progress(self) -> bool:
        return False

    def wait_until_finished(self) -> None:
        return None

    def close(self) -> None:
        return None

    def all_steps(self, read: bool = True) -> list[int]:
        return committed_steps(self.run)


@dataclass(frozen=True)
class Saved:
    """Where one saved box of a leaf is: the process that wrote it, its box, offset and bytes."""

    process: int
    box: tuple[tuple[int, int], ...]
    offset: int
    nbytes: int


class _Blobs:
    """The saved boxes a process needs, by where they are: open files, or ranges fetched from gs://.

    On an object store only the byte ranges of the boxes this process's devices overlap are
    fetched (neighbours merged into one request, requests in parallel), not every host's file.
    """

    MERGE_GAP = 1 << 20  # two needed ranges this close are fetched as one

    def __init__(self, step_dir: str, needed: list[Saved]) -> None:
        import numpy as np

        self.store = open_store(step_dir)
        self.local = scheme(step_dir).filesystem
        self.files: dict[int, Any] = {}  # process -> its .bin, memory-mapped
        self.fds: dict[int, int] = {}  # process -> its .bin, open for positional reads
        self.ranges: dict[int, list[tuple[int, Any]]] = {}  # process -> [(start, bytes)], by start
        if self.local:
            for p in sorted({s.process for s in needed}):
                path = Path(self.store.child(f"lean/{p}.bin"))
                size = path.stat().st_size
                self.files[p] = np.memmap(path, np.uint8, mode="r") if size else np.zeros(0, np.uint8)
                self.fds[p] = os.open(path, os.O_RDONLY)
            return
        self._fetch(needed)

    def close(self) -> None:
        """Closes the files (the memory maps go with their last view)."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def _fetch(self, needed: list[Saved]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import numpy as np

        spans: list[tuple[int, int, int]] = []  # (process, start, end)
        for s in sorted(needed, key=lambda s: (s.process, s.offset)):
            if spans and spans[-1][0] == s.process and s.offset - spans[-1][2] <= self.MERGE_GAP:
                p, lo, hi = spans[-1]
                spans[-1] = (p, lo, max(hi, s.offset + s.nbytes))
            else:
                spans.append((s.process, s.offset, s.offset + s.nbytes))

        def get(span: tuple[int, int, int]) -> Any:
            p, lo, hi = span
            return np.frombuffer(self.store.get_range(f"lean/{p}.bin", lo, hi - lo), np.uint8)

        with ThreadPoolExecutor(16) as pool:
            for (p, lo, _), data in zip(spans, pool.map(get, spans), strict=True):
                self.ranges.setdefault(p, []).append((lo, data))

    def __call__(self, s: Saved) -> Any:
        """The bytes of one saved box."""
        if self.local:
            return self.files[s.process][s.offset : s.offset + s.nbytes]
        for lo, data in self.ranges.get(s.process, []):
            if lo <= s.offset and s.offset + s.nbytes <= lo + len(data):
                return data[s.offset - lo : s.offset - lo + s.nbytes]
        raise KeyError(f"box {s.box} of process {s.process} was not fetched")

    def read_into(self, s: Saved, start: int, into: memoryview) -> None:
        """Fills ``into`` with the box's bytes from ``start`` on: read straight from the file where it is local."""
        if not self.local:
            into[:] = self(s)[start : start + len(into)]
            return
        done = 0
        while done < len(into):
            n = os.preadv(self.fds[s.process], [into[done:]], s.offset + start + done)
            if n <= 0:
                raise ValueError(f"lean/{s.process}.bin ends before the box {s.box} it indexes")
            done += n


def _index(step_dir: str, meta: dict[str, Any]) -> dict[str, list[Saved]]:
    store = open_store(step_dir)
    out: dict[str, list[Saved]] = {}
    for p in range(int(meta["processes"])):
        for e in json.loads(store.get(f"lean/{p}.json"))["entries"]:
            box = tuple((int(lo), int(hi)) for lo, hi in e["box"])
            out.setdefault(e["path"], []).append(Saved(p, box, int(e["offset"]), int(e["nbytes"])))
    return out


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> list[tuple[int, int]] | None:
    """The box where ``a`` and ``b`` meet, or None."""
    both = [(max(lo, c), min(hi, d)) for (lo, hi), (c, d) in zip(a, b, strict=True)]
    return None if any(lo >= hi for lo, hi in both) else both


def empty(shape: list[int], dtype: Any, *, shared: bool) -> Any:
    """An uninitialised host array; ``shared``: one a CPU device takes as its own without a copy.

    A shared array is aligned to 64 bytes, and a large one is mapped with its pages populated in
    one call (faulting them in one by one costs about as much as reading the bytes).  Any other is
    offset from that alignment, so a device always copies it into a buffer of its own.
    """
    import mmap

    import numpy as np

    dtype = np.dtype(dtype)
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if shared and nbytes >= POPULATE_BYTES:
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        return np.frombuffer(pages, np.uint8, nbytes).view(dtype).reshape(shape)
    raw = np.empty(nbytes + 2 * ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN + (0 if shared else ALIGN // 4)
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def rows_in(want: tuple[tuple[int, int], ...], box: tuple[tuple[int, int], ...]) -> tuple[int, int] | None:
    """Where ``want`` lies in the saved ``box`` (first and last element, row-major), if it is one run; else None."""
    if not box:
        return (0, 1)  # a scalar: its one element
    if want[1:] != box[1:] or not (box[0][0] <= want[0][0] and want[0][1] <= box[0][1]):
        return None
    row = 1
    for lo, hi in box[1:]:
        row *= hi - lo
    return (want[0][0] - box[0][0]) * row, (want[0][1] - box[0][0]) * row


class Boxes(Protocol):
    """Where a reader finds the bytes of saved boxes (:class:`_Blobs`; a local copy's mapping)."""

    def __call__(self, s: Saved) -> Any: ...
    def read_into(self, s: Saved, start: int, into: memoryview) -> None: ...


def assemble(
    name: str, dtype: Any, saved: list[Saved], want: tuple[tuple[int, int], ...], *, blobs: Boxes, shared: bool
) -> Any:
    """The box ``want`` of a leaf, put together from the saved boxes it overlaps.

    ``shared``: the result goes to a device that may take it as its own (nothing donates it to a
    step), so it is read into an array from ``empty``, straight from the file where one saved box
    holds all of it as one run of bytes.  Otherwise the device copies it into a buffer of its own,
    which a step that donates the state can reuse.
    """
    out = empty([hi - lo for lo, hi in want], dtype, shared=shared)
    for s in saved if shared else []:
        span = rows_in(want, s.box)
        if span is not None:
            blobs.read_into(s, span[0] * out.itemsize, memoryview(out.reshape(-1).view("uint8")))
            return out
    covered = 0
    for s in saved:
        overlap = _overlap(want, s.box)
        if overlap is None:
            continue
        part = blobs(s).view(dtype).reshape([hi - lo for lo, hi in s.box])
        src = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, s.box, strict=True))
        dst = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, want, strict=True))
        out[dst] = part[src]
        size = 1
        for lo, hi in overlap:
            size *= hi - lo
        covered += size
    if covered < out.size:
        raise ValueError(f"the checkpoint holds only part of {name}")
    return out


def read_meta(step_dir: str) -> dict[str, Any]:
    meta = json.loads(open_store(step_dir).get(META))
    if int(meta.get("format", 0)) != FORMAT:
        raise ValueError(f"{step_dir}: lean checkpoint format {meta.get('format')}, this version reads {FORMAT}")
    return dict(meta)


def _read_parts(
    blobs: _Blobs, jobs: set[tuple[str, Any, tuple[tuple[int, int], ...]]], saved: dict[str, list[Saved]]
) -> dict[tuple[str, tuple[tuple[int, int], ...]], Any]:
    """Each wanted box (leaf, dtype, box) as a host array a device takes as its own, read by a few threads.

    Reading and populating pages release the interpreter, so the threads overlap.
    """
    from concurrent.futures import ThreadPoolExecutor

    def read(job: tuple[str, Any, tuple[tuple[int, int], ...]]) -> Any:
        name, dtype, box = job
        return assemble(name, dtype, saved.get(name, []), box, blobs=blobs, shared=True)

    todo = sorted(jobs, key=lambda job: job[0])
    with ThreadPoolExecutor(READERS) as pool:
        return {(name, box): array for (name, _, box), array in zip(todo, pool.map(read, todo), strict=True)}


def restore(step_dir: str, abstract: Any) -> tuple[Any, DataPosition]:
    """The step at ``step_dir`` as ``abstract``'s arrays (its shapes and shardings), and its data position."""
    import jax
    import numpy as np

    meta = read_meta(step_dir)
    saved = _index(step_dir, meta)
    shapes = {leaf["path"]: leaf for leaf in meta["leaves"]}
    same_leaves(set(shapes), {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract)})
    needed: list[Saved] = []
    for path, a in jax.tree_util.tree_leaves_with_path(abstract):
        name = jax.tree_util.keystr(path)
        if tuple(shapes[name]["shape"]) != tuple(a.shape):
            raise ValueError(
                f"the checkpoint's {name} has shape {shapes[name]['shape']}; the state wants {list(a.shape)}"
            )
        boxes = {box_of(ix, a.shape) for ix in a.sharding.addressable_devices_indices_map(a.shape).values()}
        needed += [s for s in saved.get(name, []) if any(_overlap(s.box, b) is not None for b in boxes)]
    blobs = _Blobs(step_dir, needed)

    def load(path: Any, a: Any) -> Any:
        name = jax.tree_util.keystr(path)
        dtype, parts = np.dtype(shapes[name]["dtype"]), saved.get(name, [])

        # A device's part, cast to the state's dtype where it differs.  The device copies it into a
        # buffer of its own, which a step that donates the state reuses; the host array goes at once,
        # and the next part takes its memory (already faulted in), not fresh pages.
        def part(ix: Any) -> Any:
            return assemble(name, dtype, parts, box_of(ix, a.shape), blobs=blobs, shared=False).astype(
                a.dtype, copy=False
            )

        return jax.make_array_from_callback(a.shape, a.sharding, part)

    try:
        return jax.tree_util.tree_map_with_path(load, abstract), data_position(meta["data"])
    finally:
        blobs.close()


def same_leaves(saved: set[str], wanted: set[str]) -> None:
    extra, missing = sorted(saved - wanted), sorted(wanted - saved)
    if extra or missing:
        parts = [f"not in this run's state: {', '.join(extra[:5])}"] if extra else []
        parts += [f"not in the checkpoint: {', '.join(missing[:5])}"] if missing else []
        raise ValueError("the checkpoint's state does not match this run's (" + "; ".join(parts) + ")")


def read_host(step_dir: str, top: str | None = None) -> dict[str, Any]:
    """The step's state (or one top-level key of it) on this process's first device, as nested dicts and lists."""
    import jax
    import numpy as np

    meta = read_meta(step_dir)
    saved = _index(step_dir, meta)
    leaves = [leaf for leaf in meta["leaves"] if top is None or leaf["keys"][:1] == [top]]
    blobs = _Blobs(step_dir, [s for leaf in leaves for s in saved.get(leaf["path"], [])])
    whole = {leaf["path"]: tuple((0, n) for n in leaf["shape"]) for leaf in leaves}
    try:  # the device takes each array as its own: nothing here is donated to a step
        read = _read_parts(
            blobs,
            {(leaf["path"], np.dtype(leaf["dtype"]), whole[leaf["path"]]) for leaf in leaves},
            saved,
        )
    finally:
        blobs.close()
    device = jax.local_devices()[0]
    tree: dict[Any, Any] = {}
    for leaf in leaves:
        node = tree
        for k in leaf["keys"][:-1]:
            node = node.setdefault(k, {})
        node[leaf["keys"][-1]] = jax.device_put(read[leaf["path"], whole[leaf["path"]]], device)
    out = _lists(tree)
    return dict(out[top]) if top is not None else dict(out)


def _lists(node: Any) -> Any:
    """Nested dicts whose keys are the positions 0..n-1 as lists."""
    if not isinstance(node, dict):
        return node
    items = {k: _lists(v) for k, v in node.items()}
    if items and all(isinstance(k, int) for k in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items
