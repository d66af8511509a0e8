"""Orbax's save, made cheaper in CPU without changing what it writes: three fixed costs of each save cut.

A small model's save (65 arrays of a few KiB) cost about 100 ms of CPU in Orbax's OCDBT format, on
hosts whose cores the training steps already fill.  Each piece here writes the same step:

- :class:`OneWriteShardings`: the item's ``_sharding`` record (each array's sharding, read by a
  plain restore with no target) in one write, the same bytes; Orbax opens it and writes in a
  transaction once per array (about 20 ms a save).
- :func:`read_flag_once`: Orbax reads an absl flag at each of its ~400 ``process_index()`` calls a
  save; with absl's flags unparsed (no absl app here) each read raises and logs its caller.
- :func:`with_target_size`: the OCDBT data file size Orbax picks for the root, given with the save,
  so that Orbax does not look it up twice per array (building paths each time).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint import future, multihost, type_handlers
from orbax.checkpoint._src.metadata import sharding as sharding_metadata
from orbax.checkpoint._src.serialization import tensorstore_utils

FLAG = "experimental_orbax_use_distributed_process_id"


class OneWriteShardings(type_handlers.ArrayHandler):  # type: ignore[misc]
    """Orbax's handler of ``jax.Array`` leaves, writing the ``_sharding`` record in one write.

    Orbax's own writer is off; :meth:`serialize` adds the one write in its place, on the primary
    host as Orbax's.  Orbax hands a handler all of an item's arrays in one call, so the record
    written is the whole item's.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(enable_write_sharding_file=False, **kwargs)

    async def serialize(
        self,
        values: Sequence[jax.Array],
        infos: Sequence[type_handlers.ParamInfo],
        args: Sequence[type_handlers.SaveArgs] | None = None,
    ) -> Sequence[future.Future]:
        futures = list(await super().serialize(values, infos, args))
        if not infos or not multihost.is_primary_host(self._primary_host):
            return futures
        shardings = [_written(v).sharding for v in values]
        record = future.CommitFutureAwaitingContractedSignals(
            write_record(shardings, infos), name="serialize_shardings"
        )
        return [record, *futures]


def _written(value: jax.Array) -> jax.Array:
    """The array Orbax writes for ``value``: a typed PRNG key as its key data."""
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(value)
    return value


def record_entries(shardings: Sequence[jax.sharding.Sharding | None], names: Sequence[str]) -> dict[str, str]:
    """The ``_sharding`` record's entries: each array's name (URL-safe base64, Orbax's key) to its sharding."""
    out = {}
    for sharding, name in zip(shardings, names, strict=True):
        meta = sharding_metadata.from_jax_sharding(sharding) if sharding is not None else None
        if meta is not None:
            out[base64.urlsafe_b64encode(name.encode()).decode()] = meta.to_serialized_string()
    return out


async def write_record(
    shardings: Sequence[jax.sharding.Sharding | None], infos: Sequence[type_handlers.ParamInfo]
) -> None:
    """Write the item's ``_sharding`` record into its directory, once that is made, in one write."""
    for info in infos:
        await info.await_path_creation()
    parent = infos[0].parent_dir
    if parent is None or any(info.parent_dir is not parent and info.parent_dir != parent for info in infos):
        raise ValueError("an item's arrays are written into one directory")
    entries = record_entries(shardings, [str(info.name) for info in infos])
    if not entries:
        return
    spec = tensorstore_utils.get_sharding_tensorstore_spec(parent.as_posix(), str(infos[0].name))
    del spec["json_pointer"]  # the whole record, not one array's entry
    record = await ts.open(spec, open=True, context=infos[0].ts_context)
    await record.write(entries)  # type: ignore[arg-type]  # the json driver writes a JSON value


def read_flag_once() -> None:
    """Give Orbax's one absl flag the value Orbax falls back to, unless something parsed the flags already.

    Unparsed, each read raises and logs (about 5 µs, 400 reads a save); parsed, a read is a lookup.
    """
    from absl import flags

    flag = flags.FLAGS[FLAG]
    if not flags.FLAGS.is_parsed() and not flag.present:
        flag.parse("false")  # what Orbax uses when the flag cannot be read


def target_size(root: str) -> int:
    """The OCDBT data file size Orbax picks for a root (per scheme: smaller on GCS), looked up once."""
    spec = tensorstore_utils.build_kvstore_tspec(root, use_ocdbt=True)
    return int(tensorstore_utils._get_backend_ocdbt_target_data_file_size(spec))


def with_target_size(args: Any, size: int) -> Any:
    """``args`` of a save with each PyTree item given ``size`` as its OCDBT data file size, where it has none."""
    if not isinstance(args, ocp.args.Composite):
        return args
    items = {
        name: dataclasses.replace(item, ocdbt_target_data_file_size=size)
        if isinstance(item, ocp.args.PyTreeSave) and item.ocdbt_target_data_file_size is None
        else item
        for name, item in args.items()
    }
    return ocp.args.Composite(**items)
