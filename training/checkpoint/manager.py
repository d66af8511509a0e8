"""Orbax checkpoint I/O: the manager, save, restore, and reading a step on one device.

Everything the run needs to resume is one Orbax checkpoint per step with
three items: ``state`` (parameters, AdamW state, step, RNG), ``data`` (the
global data position) and ``config`` (the resolved config).  Restores are
given abstract targets carrying the *current* mesh's shardings, so Orbax
reshards a checkpoint written on any other mesh; no code of ours moves shards.

MaxText's small vocabulary: :func:`checkpoint_manager`, :func:`save`,
:func:`restore`; which steps exist is :func:`training.checkpoint.steps.committed_steps`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from training.config import Config
from training.layout import checkpoints_uri, step_uri
from training.storage import is_gcs

State = dict[str, Any]


def use_ocdbt(cfg: Config) -> bool:
    """OCDBT (Orbax's default) unless told otherwise.

    ``auto`` picks plain zarr for a gs:// root served by a GCS emulator
    (STORAGE_EMULATOR_HOST set): OCDBT's manifest needs the object generations
    and conditional writes that real GCS has and emulators get wrong.
    """
    if cfg.checkpoint_format == "auto":
        return not (is_gcs(cfg.root) and bool(os.environ.get("STORAGE_EMULATOR_HOST")))
    return cfg.checkpoint_format == "ocdbt"


def checkpoint_manager(cfg: Config, run: str, *, async_save: bool | None = None) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=1,  # we decide when to save
        max_to_keep=None,  # retention is the pruner's job: it knows validation and pins
        create=True,
        cleanup_tmp_directories=True,  # a save cut off by a crash is never restored, and is cleaned up
        enable_async_checkpointing=cfg.async_checkpoint if async_save is None else async_save,
    )
    handlers = {
        "state": ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt(cfg)),
        "data": ocp.JsonCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
    }
    return ocp.CheckpointManager(checkpoints_uri(run), options=options, item_handlers=handlers)


def save(mngr: ocp.CheckpointManager, step: int, state: State, data: dict[str, Any], cfg: Config) -> bool:
    return bool(
        mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data),
                config=ocp.args.JsonSave(cfg.model_dump()),
            ),
            force=True,
        )
    )


def restore(mngr: ocp.CheckpointManager, step: int, abstract: State) -> tuple[State, dict[str, Any]]:
    out = mngr.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()),
    )
    return out["state"], dict(out["data"])


def all_finite(tree: Any) -> bool:
    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(jax.device_get(tree)))


def load_state_host(run: str, step: int) -> State:
    """A checkpoint's state on this process's first device (audits, validation, tests).

    The abstract target is read from the checkpoint's own metadata and given a
    single-device sharding: Orbax reshards whatever mesh wrote it.
    """
    from etils import epath

    path = epath.Path(step_uri(run, step)) / "state"
    ck = ocp.StandardCheckpointer()
    meta = ck.metadata(path)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), tree)
    return dict(ck.restore(path, target))
