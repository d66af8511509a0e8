"""Checkpoint I/O: the manager, save, restore, and reading a step on one device.

Everything the run needs to resume is one checkpoint per step: the state
(parameters, optimizer state, step, RNG), the global data position and the
resolved config.  The default (``checkpoint_format: auto``) is Orbax's OCDBT on
every root.  A step is a plain Orbax checkpoint (OCDBT, or zarr) with three items: ``state``
(the state's own tree, by name: ``params``, ``opt_state``, ``step``, ``rng``),
``data`` and ``config``, so a plain
``orbax.checkpoint`` restore of ``state`` gives the named trees.  Steps saved by
earlier versions with their small arrays packed (a fourth item, ``layout``,
:mod:`training.checkpoint.packing`) still restore.  Restores are given abstract targets
carrying the *current* mesh's shardings, so a checkpoint written on any other
mesh is resharded.  Steps saved in :mod:`training.checkpoint.lean`, retired as a format
to save in, still restore.

The vocabulary is small: :func:`checkpoint_manager`, :func:`save`, :func:`restore`;
which steps exist is :func:`training.checkpoint.steps.committed_steps`.
"""

from __future__ import annotations

import asyncio
import functools
import math
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers
from orbax.checkpoint._src.path import atomicity

from training.background import idle_this_thread
from training.checkpoint import lean, packing
from training.checkpoint.orbax_cost import OneWriteShardings, read_flag_once, target_size, with_target_size
from training.checkpoint.resume import DataPosition, data_position
from training.checkpoint.steps import fresh_gcs_listings, record_integrity
from training.config import Config
from training.layout import checkpoints_uri, step_uri
from training.ready import wait_ready
from training.sections import CheckpointSection
from training.storage import join, scheme

State = dict[str, Any]


fresh_gcs_listings()  # before Orbax lists a gs:// root in this process
read_flag_once()  # Orbax's absl flag, read ~400 times a save: each read then a lookup, not an exception


def use_ocdbt(cfg: Config) -> bool:
    """Whether a config's Orbax checkpoints are OCDBT (``ocdbt_for`` its checkpoint section)."""
    return ocdbt_for(cfg.checkpoint)


def ocdbt_for(section: CheckpointSection) -> bool:
    """OCDBT (Orbax's default) on every root, ``auto`` included; plain zarr only where the section says ``zarr``."""
    return section.checkpoint_format in ("auto", "ocdbt")


async def _record(path: Any) -> None:
    """A step's record (Orbax commits each item's directory with the same class first: those are not steps)."""
    if path.get_final().name.isdigit():
        await asyncio.to_thread(record_integrity, str(path.get()))


class RecordedRename(atomicity.AtomicRenameTemporaryPath):  # type: ignore[misc]
    """Orbax's commit by rename (local roots), with the step's integrity record written into it first."""

    async def finalize(self) -> None:
        await _record(self)
        await super().finalize()


class RecordedCommitFile(atomicity.CommitFileTemporaryPath):  # type: ignore[misc]
    """Orbax's commit by a success file (gs://), with the step's integrity record written into it first."""

    async def finalize(self) -> None:
        await _record(self)
        await super().finalize()


class FailFastManager(ocp.CheckpointManager):  # type: ignore[misc]
    """Orbax's manager, keeping the error of a background commit where the training loop can see it at once.

    A failed commit's error is raised once, in Orbax's finalize thread, which then waits at a barrier
    of all processes that the others (whose writes succeeded) never reach: ``check_for_errors`` and
    ``wait_until_finished`` would see nothing, or block, for Orbax's barrier timeout.
    :attr:`failure` is that error, kept for :func:`raise_failure`.
    """

    failure: BaseException | None = None
    # The OCDBT data file size Orbax picks for the root, given with each save (``with_target_size``).
    target_size: int | None = None

    def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
        if self.target_size is not None and kwargs.get("args") is not None:
            kwargs["args"] = with_target_size(kwargs["args"], self.target_size)
        return bool(super().save(step, *args, **kwargs))

    def _wait_for_checkpointers(self) -> None:
        try:
            super()._wait_for_checkpointers()
        except BaseException as e:
            self.failure = e
            raise


def raise_failure(mngr: ocp.CheckpointManager | lean.LeanManager) -> None:
    """Raise the error of a background commit that failed (a full disk, a read-only root), naming the step's root."""
    mngr.check_for_errors()
    failure = getattr(mngr, "failure", None)
    if failure is not None:
        raise RuntimeError(f"a checkpoint save to {mngr.directory} failed: {failure}") from failure


def wait_saved(mngr: ocp.CheckpointManager | lean.LeanManager, poll_s: float = 0.05) -> None:
    """Wait for the newest save to finish, raising at once (not at Orbax's barrier timeout) when its commit failed."""
    import time

    if isinstance(mngr, FailFastManager):
        while mngr.is_saving_in_progress():
            raise_failure(mngr)
            time.sleep(poll_s)
    mngr.wait_until_finished()
    raise_failure(mngr)


# A replicated shard is split among its replicas for writing only when each slice has at least this
# many bytes: below it, slicing on the device costs more than writing the shard once.
MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL = 1 << 20


def checkpoint_manager(cfg: Config, run: str, *, async_save: bool | None = None) -> FailFastManager:
    """The run's persistent checkpoint manager (``manager_for`` its checkpoint section)."""
    return manager_for(cfg.checkpoint, run, async_save=async_save)


def manager_for(section: CheckpointSection, run: str, *, async_save: bool | None = None) -> FailFastManager:
    """The run's persistent checkpoint manager (Orbax's), shared by every process of the job, as the checkpoint
    section says.

    Two Orbax options keep a save's blocking part short:

    - ``active_processes`` names every process, so Orbax's barriers are barriers of the
      coordination service.  Left unset, each barrier is a device all-gather compiled and run on
      the loop's own thread (8 of them per save: about 55 ms of a 200 ms save on this project's
      development machine).  Orbax does not create the root with ``active_processes`` set, so we do.
    - Replicated shards are split among replicas only above :data:`MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL`
      (a device slice per small array halved the blocking time of a small model's save).
    """
    from etils import epath

    mp = ocp.options.MultiprocessingOptions(primary_host=0, active_processes=set(range(jax.process_count())))
    root = epath.Path(checkpoints_uri(run))
    if scheme(str(root)).filesystem:  # object stores have no directories to create
        root.mkdir(parents=True, exist_ok=True)
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=1,  # we decide when to save
        max_to_keep=None,  # retention is the pruner's job: it knows validation and pins
        create=False,  # made above: not supported with active_processes
        cleanup_tmp_directories=True,  # a save cut off by a crash is never restored, and is cleaned up
        enable_async_checkpointing=section.async_checkpoint if async_save is None else async_save,
        multiprocessing_options=mp,
        # Orbax's own choice of commit for the root's scheme, recording the step's integrity first.
        temporary_path_class=RecordedRename if scheme(str(root)).atomic_rename else RecordedCommitFile,
    )
    registry = type_handlers.create_type_handler_registry(
        (
            jax.Array,
            # Orbax's handler, with its record of each array's sharding (a plain restore with no target
            # needs it) written in one write, not one per array.
            OneWriteShardings(min_slice_bytes_for_replica_parallel=MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL),
        ),
        (np.ndarray, type_handlers.NumpyHandler()),  # the packs of small arrays (steps of earlier versions)
    )
    handlers = {
        "state": ocp.PyTreeCheckpointHandler(
            use_ocdbt=ocdbt_for(section),
            use_compression=section.checkpoint_compression,
            multiprocessing_options=mp,
            type_handler_registry=registry,
        ),
        "data": ocp.JsonCheckpointHandler(multiprocessing_options=mp),
        "config": ocp.JsonCheckpointHandler(multiprocessing_options=mp),
        "layout": ocp.JsonCheckpointHandler(multiprocessing_options=mp),
    }
    mngr = FailFastManager(root, options=options, item_handlers=handlers)
    if ocdbt_for(section):
        mngr.target_size = target_size(str(root))
    return mngr


def save(mngr: ocp.CheckpointManager, step: int, state: State, data: DataPosition, cfg: Config) -> bool:
    """Save ``state`` as step ``step`` in the manager's format: the state's own tree, unpacked."""
    return bool(
        mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state),
                data=ocp.args.JsonSave(data),
                config=ocp.args.JsonSave(cfg.model_dump()),
            ),
            force=True,
        )
    )


def packs_small(mngr: ocp.CheckpointManager) -> bool:
    """Whether a save packs the small arrays, so its host copy gathers them: no persistent format does now.

    Orbax's steps hold the state's own tree, so any tool reads a leaf by its name.
    """
    del mngr
    return False


def restore(mngr: ocp.CheckpointManager, step: int, abstract: State) -> tuple[State, DataPosition]:
    """Step ``step`` as ``abstract``'s arrays (its shapes and the current mesh's shardings), and its data position.

    A step saved in the retired lean format (by an earlier run) is read too.
    """
    step_dir = join(str(mngr.directory), str(step))
    if lean.is_lean(step_dir):
        return lean.restore(step_dir, abstract)
    items = mngr.item_metadata(step)
    if "data" not in items:  # every Orbax step of this project has its data position
        raise ValueError(f"checkpoint {step} has neither lean.json nor Orbax's metadata: it is incomplete")
    if "layout" not in items:  # the state's own tree (saved unpacked)
        saved = getattr(items["state"], "tree", items["state"]) if items.get("state") is not None else None
        if saved is not None:
            packing.check_same_tree(saved, abstract)
        out = mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
                ),
                data=ocp.args.JsonRestore(),
            ),
        )
        return out["state"], data_position(out["data"])
    layout = packing.Layout.from_json(
        mngr.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))["layout"]
    )
    target, args = packing.targets(layout, abstract)
    out = mngr.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.PyTreeRestore(target, restore_args=args), data=ocp.args.JsonRestore()),
    )
    return packing.unpack(out["state"], layout, abstract), data_position(out["data"])


class HostSnapshot:
    """Copies of the state for background saves: dispatched at once, made while the next steps run.

    The training step donates its state, so a save that goes on while training does needs its own
    copy.  It goes to an accelerator's ``pinned_host`` memory where it has one (TPUs, GPUs): host
    RAM, not accelerator memory, and the transfer Orbax would make anyway.  Elsewhere, JAX's CPU
    devices included, it is a copy on the device: a CPU device's memory is host RAM already, and
    its ``pinned_host`` buffers are mapped page by page (a GiB copied there cost 0.63 s of CPU
    against 0.18 s for a device copy, most of it page faults).  One compiled identity with host output shardings makes
    the whole copy a single dispatch (a per-array ``device_put`` costs the loop ~5x more).  With
    ``gather_small`` each small array is whole in the copy (a persistent save packs those); the
    copy then gathers them, so every process of the job must make it (a persistent save is made
    by all of them).

    ``abstract`` is the state's shapes and shardings.  :meth:`prepare` compiles the copy; call it
    off the loop (a save thread), or the first save compiles it (a few hundred ms on a busy host).
    """

    def __init__(self, abstract: State, *, gather_small: bool = False) -> None:
        import threading

        self.abstract = abstract
        self.gather_small = gather_small
        self.fn: Any = None
        self.lock = threading.Lock()

    def prepare(self) -> None:
        with self.lock:
            if self.fn is not None:
                return
            device = jax.local_devices()[0]
            kinds = {m.kind for m in device.addressable_memories()}
            out = jax.tree.map(_saved_sharding if self.gather_small else (lambda a: a.sharding), self.abstract)
            if "pinned_host" in kinds and device.platform != "cpu":
                out = jax.tree.map(lambda sh: sh.with_memory_kind("pinned_host"), out)
                jitted = jax.jit(lambda s: s, out_shardings=out)
            else:
                jitted = jax.jit(lambda s: jax.tree.map(lambda x: x.copy(), s), out_shardings=out)
            self.fn = jitted.lower(self.abstract).compile()

    def __call__(self, state: State) -> State:
        self.prepare()
        return dict(self.fn(state))


def _saved_sharding(a: Any) -> Any:
    """The sharding of a leaf's copy for a save: a small one whole on every device (so it is packed)."""
    sharding = a.sharding
    small = math.prod(a.shape) * np.dtype(a.dtype).itemsize <= packing.PACK_MAX_BYTES
    if small and isinstance(sharding, jax.sharding.NamedSharding) and packing.packable_dtype(a.dtype):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


class BackgroundSave:
    """One save at a time handed to a save thread: the loop only dispatches a :class:`HostSnapshot`.

    :meth:`start` runs ``fn(copy_of_state, *args)`` in the thread (the call into Orbax, which
    then writes in its own thread); :meth:`collect` takes its outcome, raising its error on the
    loop's thread.  With ``background=False`` the call runs on the caller's thread, on the state
    itself, and is collected the same way.  Both checkpoint tiers save through this.
    """

    def __init__(self, abstract: State, name: str, *, background: bool = True, gather_small: bool = False) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.snapshot = HostSnapshot(abstract, gather_small=gather_small)
        # The save thread (and the checkpoint library's threads it starts) runs only on cores the loop leaves
        # idle: a lowered niceness still takes about a tenth of a busy core from the step, and the step after
        # each save paid for it (issue 51: ~130 ms of wall time a save at nice 10, ~80 ms in the idle class).
        self.thread = (
            ThreadPoolExecutor(1, thread_name_prefix=name, initializer=idle_this_thread) if background else None
        )
        self.prepared = False  # the copy's compile was handed to the thread (prepare_ahead)
        self.starting: Any = None  # a Future: the seconds the thread's part of the newest save took

    def prepare_ahead(self) -> None:
        """Compile the copy in the save thread, once: call it after a round's first steps.

        A round's start is CPU-bound on a busy host (every process sets up at once); the steady
        steps leave CPU idle, which the save thread (in the idle class) takes.  A save that comes
        first compiles the copy itself.
        """
        if self.thread is not None and not self.prepared:
            self.prepared = True
            self.thread.submit(self.snapshot.prepare)

    def start(self, fn: Any, state: State, *args: Any) -> None:
        from concurrent.futures import Future

        if self.thread is not None:
            self.write(fn, self.snapshot(state), *args)
            return
        self.starting = Future()
        try:
            self.starting.set_result(_timed(fn, state, *args))
        except BaseException as e:  # noqa: BLE001 - raised by collect(), as the thread's would be
            self.starting.set_exception(e)

    def write(self, fn: Any, copy: State, *args: Any) -> None:
        """Run ``fn(copy, *args)`` in the thread: ``copy`` made by :attr:`snapshot` earlier (the previous one collected)."""
        assert self.thread is not None, "a save without a thread takes the state itself (start)"
        self.starting = self.thread.submit(_timed, fn, copy, *args)

    def busy(self) -> bool:
        """The newest save is still being handed to Orbax."""
        return self.starting is not None and not self.starting.done()

    def collect(self, *, block: bool = True) -> tuple[bool, float | None]:
        """(handed over, seconds it took: None when nothing was left to collect); raises its error."""
        if self.starting is None:
            return True, None
        if not block and not self.starting.done():
            return False, None
        starting, self.starting = self.starting, None
        return True, float(starting.result())

    def close(self) -> None:
        if self.thread is not None:
            self.thread.shutdown()


def _timed(fn: Any, state: State, *args: Any) -> float:
    """Seconds ``fn(state, *args)`` took, with the wait for ``state``'s copy (:func:`training.ready.wait_ready`)."""
    import time

    t = time.time()
    wait_ready([x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)])
    fn(state, *args)
    return time.time() - t


def local_bytes(state: State) -> int:
    """Bytes of ``state`` held by this process's devices: what its save copies to host memory."""
    return sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards)


@functools.cache
def copy_bandwidth(nbytes: int = 64 << 20) -> float:
    """This host's memory copy bandwidth, bytes/s (best of 3): a save's copy can be no faster.

    Measured once per process (a worker does it while it warms up, before it has a round).
    """
    import time

    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def all_finite(tree: Any) -> bool:
    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(jax.device_get(tree)))


def _read_on_first_device(run: str, step: int, top: str | None = None) -> Any:
    """A checkpoint's state (or one top-level key of it) on this process's first device, as nested dicts.

    Orbax reshards whatever mesh wrote it; an unpacked checkpoint (the state's own tree) is read by its
    own metadata, a packed one (earlier versions) through its layout.
    """
    from etils import epath

    if lean.is_lean(step_uri(run, step)):
        return lean.read_host(step_uri(run, step), top)
    step_dir = epath.Path(step_uri(run, step))
    path = step_dir / "state"
    ck = ocp.PyTreeCheckpointer()
    try:
        doc = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(step_dir / "layout")
    except FileNotFoundError:  # the state's own tree, unpacked
        doc = None
    if doc is not None:
        layout = packing.Layout.from_json(doc)
        if top is not None:
            layout = layout.only(top)
        target, args = packing.targets(layout, None)
        tree = ck.restore(path, args=ocp.args.PyTreeRestore(item=target, restore_args=args, partial_restore=True))
        state = packing.unpack(tree, layout, None)
        return state[top] if top is not None else state
    meta = ck.metadata(path)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), tree)
    if top is not None:
        target = {top: target[top]}
    args = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    out = ck.restore(path, args=args)
    return out[top] if top is not None else dict(out)


def load_state_host(run: str, step: int) -> State:
    """A checkpoint's state on this process's first device (audits, tests)."""
    return dict(_read_on_first_device(run, step))


def load_params_host(run: str, step: int) -> Any:
    """A checkpoint's parameters alone on this process's first device (the optimizer state is not read)."""
    return _read_on_first_device(run, step, "params")
