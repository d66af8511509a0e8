"""The packed form of a train state that earlier versions saved in Orbax's format; still restored.

Steps saved now hold the state's own tree (:func:`training.checkpoint.manager.save`), so any
Orbax reader finds each leaf by its name; :func:`check_same_tree` checks such a step against the
state.  The packed form, kept for the steps already written that way:

A checkpoint library spends a few milliseconds of Python per array it writes, whatever its size:
a model's norms, biases, counters and RNG are most of its arrays and almost none of its bytes.  So
a save packs every small, fully replicated array into one host array per (top-level key, dtype)
(the host copy a persistent save starts from holds every small array whole),
and writes those with the large arrays, under flat names, beside a :class:`Layout` that says
where each leaf of the state went.  A restore reads the layout, asks for the large arrays with
the current mesh's shardings (resharded as ever) and the packs as host arrays, then puts each
small leaf onto the current mesh with its own sharding.  A replicated array is the same on any
mesh, and a packed one is at most :data:`PACK_MAX_BYTES`, so no restore gathers anything large.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import jax
import numpy as np

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

PACK_MAX_BYTES = 1 << 16  # a replicated array this small is packed with others of its kind
_PACKABLE_KINDS = "fiub"  # plain numeric dtypes (an extended or custom dtype is saved on its own)


# A saved tree: flat names to arrays (a large one on its mesh, a pack on the host).
SavedTree = dict[str, jax.Array | np.ndarray]


class EntryDoc(TypedDict):
    """An :class:`Entry` as the layout's JSON holds it."""

    path: str
    keys: list[str | int]
    shape: list[int]
    dtype: str
    name: str
    group: str
    offset: int


class LayoutDoc(TypedDict):
    """A :class:`Layout` as it is saved (the step's ``layout`` item)."""

    version: int
    entries: list[EntryDoc]
    groups: dict[str, list[str | int]]  # pack name -> [dtype, elements]


@dataclass(frozen=True)
class Entry:
    """Where one leaf of the state is in a saved tree."""

    path: str  # the leaf's path in the state (jax.tree_util.keystr)
    keys: tuple[str | int, ...]  # the same path as keys, to rebuild the tree without a target
    shape: tuple[int, ...]
    dtype: str
    name: str = ""  # its own array in the saved tree ('' when packed)
    group: str = ""  # the pack it is in ('' when its own)
    offset: int = 0  # its first element in the pack

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Layout:
    """Every leaf of a saved state, and the packs with their sizes."""

    entries: tuple[Entry, ...]
    groups: dict[str, tuple[str, int]]  # pack name -> (dtype, elements)

    def to_json(self) -> LayoutDoc:
        return {
            "version": 1,
            "entries": [
                {
                    "path": e.path,
                    "keys": list(e.keys),
                    "shape": list(e.shape),
                    "dtype": e.dtype,
                    "name": e.name,
                    "group": e.group,
                    "offset": e.offset,
                }
                for e in self.entries
            ],
            "groups": {g: [d, n] for g, (d, n) in self.groups.items()},
        }

    @classmethod
    def from_json(cls, doc: LayoutDoc) -> Layout:
        entries = tuple(
            Entry(
                path=str(e["path"]),
                keys=tuple(e["keys"]),
                shape=tuple(int(n) for n in e["shape"]),
                dtype=str(e["dtype"]),
                name=str(e["name"]),
                group=str(e["group"]),
                offset=int(e["offset"]),
            )
            for e in doc["entries"]
        )
        return cls(entries, {g: (str(d), int(n)) for g, (d, n) in doc["groups"].items()})

    def only(self, top: str) -> Layout:
        """The entries under one top-level key of the state (``params``), and their packs."""
        entries = tuple(e for e in self.entries if e.keys[:1] == (top,))
        used = {e.group for e in entries}
        return Layout(entries, {g: v for g, v in self.groups.items() if g in used})


def _key(k: Any) -> str | int:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            v = getattr(k, attr)
            return v if isinstance(v, int) else str(v)
    return str(k)


def _dtype(name: Any) -> np.dtype[Any]:
    return np.dtype(str(jax.numpy.dtype(name)))


def packable_dtype(dtype: Any) -> bool:
    """A plain numeric dtype (not an extended one such as a PRNG key's)."""
    try:
        return np.dtype(dtype).kind in _PACKABLE_KINDS
    except TypeError:
        return False


def _packable(x: Any) -> bool:
    return (
        isinstance(x, jax.Array)
        and x.sharding.is_fully_replicated
        and x.nbytes <= PACK_MAX_BYTES
        and packable_dtype(x.dtype)
    )


def _safe(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_")[:80]


def pack(state: Any) -> tuple[SavedTree, Layout]:
    """(the tree to save: flat names to arrays, its layout).  Reads the small arrays to host memory."""
    tree: SavedTree = {}
    parts: dict[str, list[np.ndarray]] = {}
    sizes: dict[str, int] = {}
    entries = []
    for i, (path, x) in enumerate(jax.tree_util.tree_leaves_with_path(state)):
        keys = tuple(_key(k) for k in path)
        name = jax.tree_util.keystr(path)
        shape, dtype = tuple(int(n) for n in x.shape), str(x.dtype)
        if _packable(x):
            group = f"pack_{_safe(str(keys[0]))}_{np.dtype(x.dtype).name}"
            host = np.asarray(x.addressable_data(0)).reshape(-1)
            offset = sizes.get(group, 0)
            parts.setdefault(group, []).append(host)
            sizes[group] = offset + host.size
            entries.append(Entry(name, keys, shape, dtype, group=group, offset=offset))
        else:
            saved = f"a{i:05d}_{_safe(name)}"
            tree[saved] = x
            entries.append(Entry(name, keys, shape, dtype, name=saved))
    groups = {}
    for group, arrays in parts.items():
        tree[group] = np.concatenate(arrays)
        groups[group] = (str(tree[group].dtype), int(tree[group].size))
    return tree, Layout(tuple(entries), groups)


def targets(
    layout: Layout, abstract: Any
) -> tuple[dict[str, jax.ShapeDtypeStruct | np.ndarray], dict[str, ocp.RestoreArgs]]:
    """(the saved tree's restore target, its restore args) for a state shaped like ``abstract``.

    ``abstract`` is None for a restore onto this process's first device, every array whole.
    """
    import orbax.checkpoint as ocp

    wanted = _by_path(abstract) if abstract is not None else {}
    if abstract is not None:
        _check_same_leaves(layout, set(wanted))
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target: dict[str, jax.ShapeDtypeStruct | np.ndarray] = {}
    args: dict[str, ocp.RestoreArgs] = {}
    for e in layout.entries:
        if not e.name:
            continue
        a = wanted.get(e.path)
        sharding = a.sharding if a is not None else device
        dtype = a.dtype if a is not None else _dtype(e.dtype)  # (Orbax casts a saved dtype to the state's)
        target[e.name] = jax.ShapeDtypeStruct(e.shape, dtype, sharding=sharding)
        args[e.name] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=e.shape, dtype=dtype)
    for group, (dtype, n) in layout.groups.items():
        target[group] = np.zeros(n, _dtype(dtype))
        args[group] = ocp.RestoreArgs(restore_type=np.ndarray)
    return target, args


def unpack(restored: Mapping[str, jax.Array | np.ndarray], layout: Layout, abstract: Any) -> Any:
    """The state from a restored saved tree: ``abstract``'s tree and shardings (None: nested dicts, one device)."""
    if abstract is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        out: dict[Any, Any] = {}
        for e in layout.entries:
            node = out
            for k in e.keys[:-1]:
                node = node.setdefault(k, {})
            node[e.keys[-1]] = _leaf(restored, e, device)
        return out
    entries = {e.path: e for e in layout.entries}

    def one(path: Any, a: Any) -> Any:
        name = jax.tree_util.keystr(path)
        e = entries.get(name)
        if e is None:
            raise ValueError(f"the checkpoint has no array {name}")
        if e.shape != tuple(a.shape):
            raise ValueError(f"the checkpoint's {name} has shape {list(e.shape)}; the state wants {list(a.shape)}")
        return _leaf(restored, e, a.sharding, a.dtype)

    return jax.tree_util.tree_map_with_path(one, abstract)


def _leaf(restored: Mapping[str, jax.Array | np.ndarray], e: Entry, sharding: Any, dtype: Any = None) -> Any:
    if e.name:
        return restored[e.name]
    host = np.asarray(restored[e.group])[e.offset : e.offset + e.size].reshape(e.shape)
    if dtype is not None:
        host = host.astype(dtype, copy=False)
    return jax.make_array_from_callback(e.shape, sharding, lambda ix: host[ix])


def _check_same_leaves(layout: Layout, wanted: set[str]) -> None:
    """Raise, naming a few, when the checkpoint's arrays are not the state's (another model or optimizer)."""
    saved = {e.path for e in layout.entries}
    extra, missing = sorted(saved - wanted), sorted(wanted - saved)
    if extra or missing:
        parts = [f"not in this run's state: {', '.join(extra[:5])}"] if extra else []
        parts += [f"not in the checkpoint: {', '.join(missing[:5])}"] if missing else []
        raise ValueError("the checkpoint's state does not match this run's (" + "; ".join(parts) + ")")


def _names(tree: Any) -> set[str]:
    """Each leaf's path with every key as a string: a named tuple's fields and a saved dict's keys alike."""
    return {"".join(f"[{str(_key(k))!r}]" for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}


def check_same_tree(saved: Any, abstract: Any) -> None:
    """Raise, naming a few, when a saved tree's leaves (Orbax's metadata of an unpacked step) are not the state's."""
    saved_names, wanted = _names(saved), _names(abstract)
    if saved_names != wanted:
        fake = Layout(tuple(Entry(n, (), (), "") for n in saved_names), {})
        _check_same_leaves(fake, wanted)


def _by_path(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_leaves_with_path(tree)}
