"""The local checkpoint tier: each host's own copy of recent steps, on storage of that host.

Every ``local_checkpoint_every`` steps each worker also saves the train state to
its host's local directory (a tmpfs: ``/dev/shm`` here, an ``emptyDir`` with
``medium: Memory`` on GKE) in the background; the persistent tier (the run
root, local or ``gs://``) keeps ``checkpoint_every``.  After a lost host the
survivors resume from the newest step every one of them holds, usually at most
``local_checkpoint_every`` steps back (a save that is due while the previous one
is still being written is skipped), instead of the newest persistent one.

What is saved.  Each process writes the shards *it* holds of the global state
(Orbax's array handler with ``primary_host=None, replica_id=None``, the handler
Orbax's own emergency manager uses for its local tier) through a
:class:`orbax.checkpoint.CheckpointManager` of its own (``active_processes`` is
this process alone, ``max_to_keep=local_keep``).  With data parallelism across
hosts (``dcn_fsdp=1``, our elastic default) every host holds a whole replica,
so one host's copy is a whole checkpoint: it restores onto that host's devices
(a mesh of the host's own block of the global mesh) and becomes the host's part
of the new global arrays, whatever the number of hosts.  When state is sharded
across hosts no single host holds a whole copy; the tier is then off, and says why.

Why not ``orbax.checkpoint.experimental.emergency.CheckpointManager``: it needs at
least two data-parallel replicas (it raises below that; our range goes down to one
host); it saves the persistent tier itself, one ``state`` item only, from the
primary replica (our data position, config, ledger records and resharding
restore would all have to move into it); only non-primary replicas keep local
copies, so with two hosts losing the secondary loses every local copy; and its
local restore maps processes one to one onto the saved topology.

Which copies count.  A copy is a step of this job (the directory names the job),
finalised by Orbax (its rename), and described by a manifest the host's agent
writes beside it (``<step>.manifest.json``: the round that saved it, and the size
and CRC32C of each file).  The agent advertises its copies in its heartbeat; the
leader picks the newest step that every member of the next round holds and that
is newer than the newest persistent checkpoint; the workers check their copies
against the manifests before restoring one, and step over a copy that fails.

Light at import time (the agent imports it): JAX and Orbax are imported inside
:class:`LocalTier` only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "{step}.manifest.json"
_MANIFEST_RE = re.compile(r"^(\d+)\.manifest\.json$")
ORBAX_STEP_MARK = "_CHECKPOINT_METADATA"  # written into every step directory Orbax finalises


LOCAL_DIR_ENV = "RTRAIN_LOCAL_CHECKPOINT_DIR"  # a host's own setting (a pod's volume) wins over the config's


def base_dir(configured: str) -> Path:
    """The local tier's root on this host: the host's, the configured one, else a tmpfs, else the temp directory."""
    if os.environ.get(LOCAL_DIR_ENV):
        return Path(os.environ[LOCAL_DIR_ENV])
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and _free_bytes(shm) >= SHM_MIN_FREE:
        return shm / "rtrain"
    return Path(tempfile.gettempdir()) / "rtrain"


SHM_MIN_FREE = 1 << 30  # a container's /dev/shm is often 64 MiB: too small to be the default


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def run_key(run_uri: str) -> str:
    """A directory name for one run (two runs of one name in different roots do not meet)."""
    name = run_uri.rstrip("/").rsplit("/", 1)[-1]
    return f"{name}-{hashlib.sha256(run_uri.encode()).hexdigest()[:10]}"


def host_dir(configured: str, run_uri: str, job: str, host: str) -> Path:
    return base_dir(configured) / run_key(run_uri) / job / host


@dataclass(frozen=True)
class LocalStep:
    step: int
    round: int
    files: dict[str, list[int]]


def _checksums(directory: Path) -> dict[str, list[int]]:
    from training.storage import open_store

    return open_store(str(directory)).checksums()


def finalised_steps(directory: Path) -> list[int]:
    """Steps Orbax finalised in ``directory`` (renamed from its temporary name, metadata written)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and (p / ORBAX_STEP_MARK).exists())


def write_manifest(directory: Path, step: int, round_: int) -> LocalStep:
    """Describe a finalised step (its files' sizes and CRC32C): from now on it may be restored."""
    files = _checksums(directory / str(step))
    doc = {"step": step, "round": round_, "files": files, "time": time.time()}
    tmp = directory / f".{step}.manifest.tmp"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, directory / MANIFEST.format(step=step))
    return LocalStep(step, round_, files)


def read_manifests(directory: Path) -> dict[int, LocalStep]:
    """The described steps whose directory is still there (Orbax deletes beyond ``local_keep``)."""
    out: dict[int, LocalStep] = {}
    if not directory.is_dir():
        return out
    for p in directory.iterdir():
        m = _MANIFEST_RE.match(p.name)
        if not m:
            continue
        step = int(m[1])
        if not (directory / str(step) / ORBAX_STEP_MARK).exists():
            p.unlink(missing_ok=True)  # its step was pruned
            continue
        try:
            doc = json.loads(p.read_text())
            out[step] = LocalStep(step, int(doc["round"]), dict(doc["files"]))
        except (OSError, ValueError, KeyError):
            continue
    return out


def describe_new(directory: Path, round_: int) -> dict[int, LocalStep]:
    """Write manifests for finalised steps that have none (saved by ``round_``'s worker); all described steps."""
    known = read_manifests(directory)
    for step in finalised_steps(directory):
        if step not in known:
            try:
                known[step] = write_manifest(directory, step, round_)
            except OSError:
                continue
    return known


def verify(directory: Path, step: int) -> str:
    """'' when this host's copy of ``step`` matches its manifest, else what is wrong (naming the file)."""
    path = directory / MANIFEST.format(step=step)
    try:
        expected = json.loads(path.read_text())["files"]
    except FileNotFoundError:
        return f"no local copy of step {step} on this host"
    except (OSError, ValueError, KeyError) as e:
        return f"the manifest of local step {step} is unreadable ({e})"
    try:
        found = _checksums(directory / str(step))
    except OSError as e:
        return f"local step {step} cannot be read ({e})"
    for name, (size, crc) in sorted(expected.items()):
        got = found.get(name)
        if got is None:
            return f"file {name} of local step {step} is missing"
        if int(got[0]) != int(size):
            return f"file {name} of local step {step} has {got[0]} bytes, {size} when saved (truncated?)"
        if int(got[1]) != int(crc):
            return f"file {name} of local step {step} fails its CRC32C check"
    return ""


def forget_other_jobs(configured: str, run_uri: str, job: str) -> None:
    """Remove this run's local copies of earlier jobs on this host (their lineage may have been rolled back)."""
    root = base_dir(configured) / run_key(run_uri)
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.name != job:
            shutil.rmtree(p, ignore_errors=True)


def parse_resume(resume: str) -> list[int]:
    """``local:22,20`` -> [22, 20] (the candidates, newest first); [] for anything else."""
    if not resume.startswith("local:"):
        return []
    return [int(s) for s in resume.removeprefix("local:").split(",") if s.strip().isdigit()]


class LocalTier:
    """One worker's local checkpoints (JAX side): save in the background, restore onto the global mesh."""

    def __init__(self, directory: Path, keep: int, mesh: Any, abstract: Any) -> None:
        import jax
        import orbax.checkpoint as ocp
        from orbax.checkpoint import type_handlers

        self.directory = directory
        self.mesh = mesh
        self.abstract = abstract
        self.reason = why_not_local(mesh, abstract)
        self.enabled = not self.reason
        self.pending: list[tuple[int, float]] = []
        self.skipped = 0  # saves skipped because the previous one was still being written
        self.mngr: Any = None
        if not self.enabled:
            return
        from training.checkpoint.manager import BackgroundSave

        self.bg = BackgroundSave(abstract, "rtrain-local-save")
        me = jax.process_index()
        directory.mkdir(parents=True, exist_ok=True)
        # Every process is its own primary host, with barriers among itself only.
        mp = ocp.options.MultiprocessingOptions(
            primary_host=None, active_processes={me}, barrier_sync_key_prefix=f"rtrain-local-{me}"
        )
        registry = type_handlers.create_type_handler_registry(
            (jax.Array, type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False))
        )
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=1,
            max_to_keep=keep,
            create=False,  # (not supported with active_processes; made above)
            cleanup_tmp_directories=True,
            enable_async_checkpointing=True,
            multiprocessing_options=mp,
            # Orbax signals "directories created" under keys shared by every process of the job: with
            # each process saving on its own, one would go on when another's directories exist.
            async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False),
        )
        self.mngr = ocp.CheckpointManager(
            directory,
            options=options,
            item_handlers={
                "state": ocp.PyTreeCheckpointHandler(
                    use_ocdbt=True, use_zarr3=True, multiprocessing_options=mp, type_handler_registry=registry
                ),
                "data": ocp.JsonCheckpointHandler(multiprocessing_options=mp),
            },
        )
        self.local_mesh = _host_block(mesh)

    def forget_after(self, step: int | None) -> None:
        """Drop local copies newer than the step this round starts from: they are of a lineage that ended."""
        for s in self.mngr.all_steps(read=True):
            if step is None or s > step:
                self.mngr.delete(s)
                (self.directory / MANIFEST.format(step=s)).unlink(missing_ok=True)

    def save(self, step: int, state: Any, data: dict[str, Any]) -> float | None:
        """Start a background save of ``step``; the seconds the loop was blocked, or None: skipped.

        The loop only dispatches a host copy of the state (:class:`~training.checkpoint.manager.HostSnapshot`);
        this tier's save thread hands it to Orbax.  Call it when :meth:`can_save`; a save still in
        flight is never waited for (None).
        """
        if self.busy():
            return None
        self._started()
        t0 = time.time()
        self.bg.start(self._save, state, step, data)
        self.pending.append((step, t0))
        return time.time() - t0

    def _save(self, state: Any, step: int, data: dict[str, Any]) -> None:
        import orbax.checkpoint as ocp

        self.mngr.save(
            step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data)), force=True
        )

    def busy(self) -> bool:
        """A save in flight: still being handed to Orbax, or Orbax still writing it."""
        return self.bg.busy() or bool(self.mngr.is_saving_in_progress())

    def can_save(self) -> bool:
        """Whether a save due now may start (the loop then brings the step through the guard first).

        A save still writing the previous copy is not waited for: this interval is skipped, and the
        next one saves the newer step.
        """
        if self.busy():
            self.skipped += 1
            return False
        return True

    def _started(self) -> None:
        """Raise the save thread's error, if any (the manager is touched only once the thread is done)."""
        self.bg.collect()

    def finished(self) -> list[tuple[int, float]]:
        """Saves that have finalised since the last call: (step, seconds from its start)."""
        if not self.pending or self.bg.busy():
            return []
        self._started()
        self.mngr.check_for_errors()
        # Not "no save in progress": saving every few steps, one is nearly always in flight.  A step is
        # done once it, or a newer one, is finalised on disk (the older may be pruned already).
        newest = max(finalised_steps(self.directory), default=-1)
        done = [(step, t0) for step, t0 in self.pending if step <= newest]
        self.pending = [(step, t0) for step, t0 in self.pending if step > newest]
        now = time.time()
        return [(step, now - t0) for step, t0 in done]

    def restore(self, step: int) -> tuple[Any, dict[str, Any]]:
        """This host's copy of ``step`` as the global state on the current mesh, and its data position."""
        import jax
        import orbax.checkpoint as ocp
        from jax.sharding import NamedSharding

        def local(a: Any) -> Any:
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.local_mesh, a.sharding.spec))

        target = jax.tree.map(local, self.abstract)
        args = jax.tree.map(
            lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype), target
        )
        out = self.mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(target, restore_args=args), data=ocp.args.JsonRestore()
            ),
        )
        # This host's shards, which are its part of the global arrays of the current mesh.
        state = jax.tree.map(
            lambda x, a: jax.make_array_from_single_device_arrays(
                a.shape, a.sharding, [s.data for s in x.addressable_shards]
            ),
            out["state"],
            self.abstract,
        )
        return state, dict(out["data"])

    def wait(self) -> None:
        if self.mngr is not None:
            self._started()
            self.mngr.wait_until_finished()

    def close(self) -> None:
        if self.mngr is not None:
            self.wait()
            self.mngr.close()
            self.bg.close()


def why_not_local(mesh: Any, abstract: Any) -> str:
    """'' when every host holds a whole replica of the state, else why the local tier cannot help."""
    import jax

    if _host_block(mesh) is None:
        return "this host's devices are not one block of the mesh"
    for path, a in jax.tree_util.tree_leaves_with_path(abstract):
        sharding = a.sharding
        shape = a.shape
        indices = sharding.addressable_devices_indices_map(shape).values()
        covered = {
            tuple((s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(ix, shape, strict=True))
            for ix in indices
        }
        size = 1
        for n in shape:
            size *= n
        held = 0
        for box in covered:
            v = 1
            for lo, hi in box:
                v *= hi - lo
            held += v
        if held < size:
            name = jax.tree_util.keystr(path)
            return f"the state is sharded across hosts ({name} is split; set dcn_fsdp=1 to keep a whole copy per host)"
    return ""


def _host_block(mesh: Any) -> Any:
    """A mesh of this process's devices, the block of the global mesh they form (None if they do not)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    me = jax.process_index()
    mine = np.vectorize(lambda d: d.process_index == me)(mesh.devices)
    where = np.nonzero(mine)
    lo = [int(w.min()) for w in where]
    hi = [int(w.max()) + 1 for w in where]
    block = mesh.devices[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))]
    if block.size != int(mine.sum()):
        return None
    return Mesh(block, mesh.axis_names)
