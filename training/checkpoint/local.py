"""The local checkpoint tier: each host's own copy of recent steps, on storage of that host.

Every ``local_checkpoint_every`` steps each worker also saves in the background to a host-local
tmpfs (an in-memory ``emptyDir`` on GKE).  After a lost host the leader resumes from the newest step
every member of the next round holds (advertised in the agents' heartbeats), when it is newer than
the newest persistent checkpoint.  A copy (:mod:`training.checkpoint.local_copy`) is the shards one
process holds, each once, in one file summed by chunk, with their index and the data position; it
restores onto any mesh, straight from the file's memory.  Not Orbax, whose bookkeeping costs a small state ten times its bytes and
whose emergency checkpointer needs two data-parallel replicas and the saved topology.  The tier
needs every host to hold a whole replica (``dcn_fsdp=1``, the elastic default); else it is off, and
says why.  A copy counts once it is of this job, finalised (renamed, its mark last) and described
by its agent's manifest (``<step>.manifest.json``: the round, each file's size and CRC32C); a worker
checks its copy against the manifest before restoring, and steps over one that fails.  A copy the
tier drops leaves its shard file behind as the host's spare (``.spare.bin``), which the next copy
is written over: its memory is not freed and taken again at every save.

JAX is imported inside functions only: the agent imports this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.checkpoint import bulk, lean, local_copy
from training.checkpoint.local_copy import INDEX, SHARDS, STEP_MARK, CopyError, Mapped
from training.checkpoint.resume import DataPosition

MANIFEST = "{step}.manifest.json"
CHECKED = "{step}.checked.json"  # its agent checked the copy whole (check_ahead)
_MANIFEST_RE = re.compile(r"^(\d+)\.manifest\.json$")
SPARE = ".spare.bin"  # a dropped copy's shard file, written over by the next copy


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


def finalised_steps(directory: Path) -> list[int]:
    """Steps finalised in ``directory`` (renamed from their temporary name, marked)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and (p / STEP_MARK).exists())


def _described(step_dir: Path) -> dict[str, list[int]]:
    """Each file of a copy with its size and CRC32C: the shard file's as its writer summed them, the rest summed here.

    The shard file is the copy's bytes; its writer sums them in memory (its index keeps them), so
    describing a copy reads only its small files.  A copy whose bytes differ from its writer's sums
    fails :func:`verify`.
    """
    try:
        written = dict(json.loads((step_dir / INDEX).read_bytes()).get("files", {}))
    except (OSError, ValueError, AttributeError):
        written = {}
    out: dict[str, list[int]] = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        name = path.relative_to(step_dir).as_posix()
        if name in written:
            out[name] = [int(x) for x in written[name]]
        else:
            data = path.read_bytes()
            out[name] = [len(data), bulk.crc32c(data)]
    return out


def write_manifest(directory: Path, step: int, round_: int) -> LocalStep:
    """Describe a finalised step (its files' sizes and CRC32C): from now on it may be restored."""
    files = _described(directory / str(step))
    doc = {"step": step, "round": round_, "files": files, "time": time.time()}
    tmp = directory / f".{step}.manifest.tmp"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, directory / MANIFEST.format(step=step))
    return LocalStep(step, round_, files)


def read_manifests(directory: Path) -> dict[int, LocalStep]:
    """The described steps whose directory is still there (the tier deletes beyond ``local_keep``)."""
    out: dict[int, LocalStep] = {}
    if not directory.is_dir():
        return out
    for p in directory.iterdir():
        m = _MANIFEST_RE.match(p.name)
        if not m:
            continue
        step = int(m[1])
        if not (directory / str(step) / STEP_MARK).exists():
            p.unlink(missing_ok=True)  # its step was pruned
            (directory / CHECKED.format(step=step)).unlink(missing_ok=True)  # (a verdict written as it was)
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


def check_ahead(directory: Path, step: int) -> str:
    """Check this host's copy of ``step`` whole now, ahead of any restore: '' when it passed, else what is wrong.

    Its host's agent calls this once a copy is described, in the idle class.  A copy that passes is
    recorded (``<step>.checked.json``) with its shard file's identity (inode, size, change times); a
    worker that finds the file unchanged takes the recorded verdict instead of summing every byte
    again in its restore (on a TPU v5e host, 6 s for 6.4 GiB).  Any write to the file changes its
    times, and then the worker checks it itself.
    """
    path = directory / str(step) / SHARDS
    try:
        before = _identity(path)
    except OSError as e:
        return f"local step {step} cannot be read ({e})"
    problem = verify(directory, step)
    if problem:
        return problem
    with contextlib.suppress(OSError):
        if _identity(path) == before:
            tmp = directory / f".{step}.checked.tmp-{os.getpid()}"
            tmp.write_text(json.dumps({"step": step, "shards": before, "time": time.time()}))
            os.replace(tmp, directory / CHECKED.format(step=step))
    return ""


def checked_ahead(directory: Path, step: int) -> bool:
    """Whether this host's copy of ``step`` passed :func:`check_ahead` and its shard file has not changed since."""
    try:
        doc = json.loads((directory / CHECKED.format(step=step)).read_text())
        return bool(doc["step"] == step and doc["shards"] == _identity(directory / str(step) / SHARDS))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _identity(path: Path) -> list[int]:
    """A file's inode, size and modification and change times: any write or rename of it changes them."""
    st = os.stat(path)
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def verify(directory: Path, step: int) -> str:
    """'' when this host's copy of ``step`` matches its manifest, else what is wrong (naming the file)."""
    with ThreadPoolExecutor(bulk.THREADS, thread_name_prefix="rtrain-local-check") as pool:
        problem, _ = open_checked(directory, step, pool)
    return problem


def open_checked(
    directory: Path, step: int, pool: Executor, on_mapped: Callable[[Mapped], None] | None = None
) -> tuple[str, Mapped | None]:
    """This host's copy of ``step`` mapped, once every file matches its manifest: ('', copy), else (what is wrong, None).

    The small files are summed whole; the shard file's bytes chunk by chunk in ``pool``'s threads
    (which also brings the mapping's pages in for the restore that follows).  ``on_mapped`` is called
    with the copy once it is mapped and its sizes match, before its bytes are summed.
    """
    path = directory / MANIFEST.format(step=step)
    try:
        expected = {name: (int(size), int(crc)) for name, (size, crc) in json.loads(path.read_text())["files"].items()}
    except FileNotFoundError:
        return f"no local copy of step {step} on this host", None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"the manifest of local step {step} is unreadable ({e})", None
    step_dir = directory / str(step)
    for name, (size, crc) in sorted(expected.items()):
        if name != SHARDS:
            problem = _check_small(step_dir / name, name, step, size, crc)
            if problem:
                return problem, None
    if SHARDS not in expected:
        return f"the manifest of local step {step} does not name {SHARDS}", None
    try:
        copy = local_copy.open_mapped(step_dir)
    except CopyError as e:
        return f"local step {step}: {e}", None
    size = expected[SHARDS][0]
    if copy.data.nbytes != size:
        return f"file {SHARDS} of local step {step} has {copy.data.nbytes} bytes, {size} when saved (truncated?)", None
    if (copy.chunks.size, copy.digest) != expected[SHARDS]:
        return f"file {SHARDS} of local step {step} is not the one its manifest describes", None
    if on_mapped is not None:
        on_mapped(copy)
    if checked_ahead(directory, step):  # its agent summed it whole, and it has not changed since
        return "", copy
    problem = local_copy.check(copy, pool)
    return (f"local step {step}: {problem}", None) if problem else ("", copy)


def _check_small(path: Path, name: str, step: int, size: int, crc: int) -> str:
    """'' when a copy's small file has the size and CRC32C its manifest gives, else what differs."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return f"file {name} of local step {step} is missing"
    except OSError as e:
        return f"local step {step} cannot be read ({e})"
    if len(data) != size:
        return f"file {name} of local step {step} has {len(data)} bytes, {size} when saved (truncated?)"
    if bulk.crc32c(data) != crc:
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


def forget_job(configured: str, run_uri: str, job: str) -> None:
    """Remove a job's local copies on this host, every host's of it that this machine holds (the job is over).

    No later job reads them (each forgets the copies of the jobs before it), and a tmpfs holds them
    in memory until the machine restarts.
    """
    root = base_dir(configured) / run_key(run_uri)
    shutil.rmtree(root / job, ignore_errors=True)
    with contextlib.suppress(OSError):
        root.rmdir()  # the run's directory, once no job of it is left


@dataclass
class _Staged:
    """A local save waiting for the guard: the step, its host copy (in flight or made), its data position."""

    step: int
    copy: Any
    data: DataPosition
    t0: float


class LocalTier:
    """One worker's local checkpoints (JAX side): save in the background, restore onto the global mesh."""

    def __init__(self, directory: Path, keep: int, mesh: Any, abstract: Any) -> None:
        self.directory = directory
        self.keep = keep
        self.mesh = mesh
        self.abstract = abstract
        self.reason = why_not_local(mesh, abstract)
        self.off_for_mesh = bool(self.reason)  # the same in every process of the round
        self.enabled = not self.reason
        self.pending: list[tuple[int, float]] = []  # handed to the save thread: (step, when staged)
        self.staged: _Staged | None = None  # a host copy waiting for the guard to pass its step
        self.passed = -1  # the newest step the guard has passed
        self.skipped = 0  # saves skipped because the previous one was still being written
        self.failure = ""  # why a save failed and turned the tier off (the loop reports it once)
        self.bg: Any = None
        self.writer = StepWriter()
        self.checked: dict[int, Mapped] = {}  # copies checked whole (mapped), for the restore that follows
        self.in_flight: tuple[int, local_copy.InFlight] | None = None  # a checked copy's parts, sent while summed
        self.ahead: set[int] = set()  # copies checked whole by their agent (check_ahead), found unchanged
        if not self.enabled:
            return
        from training.checkpoint.manager import BackgroundSave

        directory.mkdir(parents=True, exist_ok=True)
        _remove_orphans(directory, also_mine=True)  # (no write of this process has started yet)
        self.bg = BackgroundSave(abstract, "rtrain-local-save")

    def forget_after(self, step: int | None) -> None:
        """Drop local copies newer than the step this round starts from: they are of a lineage that ended."""
        for s in finalised_steps(self.directory):
            if step is None or s > step:
                _remove_step(self.directory, s, spare=s not in self.writer.adopted)

    def save(self, step: int, state: Any, data: DataPosition) -> float | None:
        """Stage a save of ``step``: the seconds the loop was blocked, or None: not saved.

        The loop only dispatches a host copy of the state (:class:`~training.checkpoint.manager.HostSnapshot`),
        right after the step and before the next one takes the state.  The copy waits in memory
        until the guard has passed the step (:meth:`release`, when the loop reads it a step later);
        then this tier's save thread writes it.  So the loop never waits for the step it saves.
        Call it when :meth:`can_save`.
        """
        if self.staged is not None or not self.enabled:
            return None
        t0 = time.time()
        self.staged = _Staged(step, self._copy(state), data, t0)
        return time.time() - t0

    def _copy(self, state: Any) -> Any:
        """A copy of ``state`` the next step cannot change: on CPU devices a device copy (dispatched, made while the
        next step runs); on an accelerator its shards fetched into host memory by several threads, before this returns.

        An accelerator's one copy to its pinned host memory ran at half the speed of 8 threads' fetches on a TPU v5e
        host, and its pages were then slow to read (the tier's write took 26 s for 6.4 GiB).  The next step takes the
        state's buffers, so either way it cannot start before the bytes have left the device.
        """
        import jax

        if not local_copy.threaded([next(iter(x.devices())) for x in jax.tree.leaves(state)[:1]]):
            return self.bg.snapshot(state)
        plan = self.writer.plan_of(state)
        with ThreadPoolExecutor(bulk.THREADS, thread_name_prefix="rtrain-local-fetch") as pool:
            return Fetched(plan, lean.shard_bytes(state, plan, pool))

    def release(self, passed: int | None) -> None:
        """The guard has passed every step up to ``passed``: hand the staged copy of one of them to the save thread.

        A write still in flight is not waited for: the copy stays staged until the next call.
        """
        if passed is not None:
            self.passed = max(self.passed, passed)
        staged = self.staged
        if staged is None or staged.step > self.passed or self.busy():
            return
        self.staged = None
        self._started()  # the previous write's outcome
        if not self.enabled:  # it failed
            return
        self.bg.write(self.writer, staged.copy, self.directory, staged.step, staged.data, self.keep)
        self.pending.append((staged.step, staged.t0))

    def prepare_ahead(self) -> None:
        """Compile the save's device copy in the save thread now (after the round's first steps; none on an
        accelerator, whose copy is fetched by threads)."""
        if self.bg is not None and not local_copy.threaded(list(self.mesh.devices.flat[:1])):
            self.bg.prepare_ahead()

    def busy(self) -> bool:
        """A save in flight."""
        return self.bg is not None and self.bg.busy()

    def can_save(self) -> bool:
        """Whether a save due now may start.

        A copy still staged (its write waits for the one before it) is not waited for: this interval
        is skipped, and the next one saves the newer step.
        """
        if self.staged is not None:
            self.skipped += 1
            return False
        return True

    def _started(self) -> None:
        """Collect the save thread's outcome: a write that failed (a full tmpfs) turns the tier off."""
        if self.bg is None:
            return
        try:
            self.bg.collect()
        except OSError as e:
            self.enabled = False
            self.reason = self.failure = f"a local save failed: {e}"
            self.pending = []
            _remove_orphans(self.directory, also_mine=True)

    def finished(self) -> list[tuple[int, float]]:
        """Saves that have finalised since the last call: (step, seconds from its start)."""
        if not self.pending or self.busy():
            return []
        self._started()
        done, self.pending = self.pending, []
        now = time.time()
        return [(step, now - t0) for step, t0 in done]

    def check(self, step: int) -> str:
        """'' when this host's copy of ``step`` is whole and as written (kept mapped for :meth:`restore`), else why not.

        Its parts start for their devices as soon as it is mapped, while its sums are checked: the restore that
        follows waits only for what is left of the transfer.  Parts of a copy that fails are dropped.
        """
        self._drop_in_flight()  # an earlier candidate's parts: one state's worth of device memory at a time

        def send(copy: Mapped) -> None:
            try:
                self.in_flight = (step, local_copy.send(copy, self.abstract))
            except Exception:  # noqa: BLE001 - a copy the state cannot take: the restore says why, if it is taken
                self.in_flight = None

        with ThreadPoolExecutor(bulk.THREADS, thread_name_prefix="rtrain-local-check") as pool:
            problem, copy = open_checked(self.directory, step, pool, on_mapped=send)
        if copy is None:
            self._drop_in_flight()
        else:
            self.checked[step] = copy
            if checked_ahead(self.directory, step):
                self.ahead.add(step)
        return problem

    def restore(self, step: int) -> tuple[Any, DataPosition]:
        """This host's copy of ``step`` as the global state on the current mesh, and its data position.

        A copy :meth:`check` passed is read from the mapping it made (its pages are in already), its parts
        already on their way.
        """
        copy = self.checked.pop(step, None)
        self.checked.clear()  # the other candidates' mappings
        self.writer.adopted.add(step)  # a CPU device may hold the file's pages as its buffers: never written over
        flight, self.in_flight = self.in_flight, None
        if flight is not None and flight[0] == step and copy is not None:
            return local_copy.receive(flight[1])
        if flight is not None:
            flight[1].drop()
        if copy is None:
            return read_step(self.directory, step, self.abstract)
        return local_copy.restore(copy, self.abstract)

    def forget_checked(self) -> None:
        """No checked copy is restored (the round restores from elsewhere): drop their mappings and parts in flight."""
        self.checked.clear()
        self._drop_in_flight()

    def _drop_in_flight(self) -> None:
        flight, self.in_flight = self.in_flight, None
        if flight is not None:
            flight[1].drop()

    def finish_writing(self, timeout: float) -> None:
        """Let the write in flight finish, waiting at most ``timeout`` seconds (from any thread: the process is leaving).

        A copy finalised before the process leaves is one its host can restore from.
        """
        import concurrent.futures

        starting = self.bg.starting if self.bg is not None else None
        if starting is not None:
            concurrent.futures.wait([starting], timeout=timeout)

    def wait(self) -> None:
        """Finish the writes handed over, and the staged copy's once the guard has passed its step."""
        self._started()
        if self.staged is not None and self.staged.step <= self.passed:
            self.release(None)
            self._started()

    def close(self) -> None:
        if self.bg is not None:
            self.wait()
            self.staged = None  # a step the guard never passed: not saved
            self.bg.close()


# --- writing and reading copies ----------------------------------------------------------------------


class StepWriter:
    """Writes local steps (the save thread calls it), with the plan of the first state it wrote.

    ``adopted``: the steps this process restored from; their files are deleted when dropped, never
    kept as the spare (:func:`write_step`).
    """

    def __init__(self) -> None:
        self.plan: lean.Plan | None = None
        self.adopted: set[int] = set()

    def plan_of(self, state: Any) -> lean.Plan:
        """The plan for copies of ``state`` (made once for its structure)."""
        import jax

        if self.plan is None or self.plan.structure != jax.tree.structure(state):
            self.plan = lean.plan(state, every_held_box=True, align=lean.ALIGN)
        return self.plan

    def __call__(self, copy: Any, directory: Path, step: int, data: DataPosition, keep: int) -> None:
        """Write ``copy`` (a :class:`Fetched` copy, or a state on its devices) as local step ``step``."""
        plan = copy.plan if isinstance(copy, Fetched) else self.plan_of(copy)
        write_step(copy, directory, step, data, keep, plan, adopted=frozenset(self.adopted))


@dataclass
class Fetched:
    """A state's shards this process holds, fetched into host memory for a local copy: its plan and their bytes."""

    plan: lean.Plan
    parts: list[Any]


def write_step(
    state: Any,
    directory: Path,
    step: int,
    data: DataPosition,
    keep: int,
    plan: lean.Plan,
    adopted: frozenset[int] = frozenset(),
) -> None:
    """Write this process's shards of ``state`` (or a :class:`Fetched` copy of them) as local step ``step``
    (atomically), then keep the newest ``keep``.

    ``plan``: the state's :func:`~training.checkpoint.lean.plan` with every box held.
    The host's spare file, if it has one, becomes the new copy's shard file and is written over.  A
    dropped copy's file becomes the spare unless the copy is ``adopted``: restored by this process, whose
    CPU devices may have taken its mapped pages as their buffers (an unlinked file's pages stay
    while they are mapped; a file written over changes under them).
    """
    tmp = directory / f".{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "lean").mkdir(parents=True)
    with contextlib.suppress(FileNotFoundError):
        os.rename(directory / SPARE, tmp / SHARDS)
    parts = state.parts if isinstance(state, Fetched) else lean.shard_bytes(state, plan)
    local_copy.write(parts, tmp, step, plan, data)
    final = directory / str(step)
    if final.exists():
        _remove_step(directory, step)
    os.rename(tmp, final)
    for old in finalised_steps(directory)[:-keep] if keep > 0 else []:
        _remove_step(directory, old, spare=old not in adopted)


def read_step(directory: Path, step: int, abstract: Any) -> tuple[Any, DataPosition]:
    """Local step ``step`` as arrays of ``abstract``'s shapes and shardings, and its data position (not checked).

    The copy holds a whole replica of every array (:func:`why_not_local`): each of this process's
    devices gets its part of the current mesh from it, whatever the mesh it was saved on.
    """
    return local_copy.restore(local_copy.open_mapped(directory / str(step)), abstract)


def _remove_step(directory: Path, step: int, spare: bool = False) -> None:
    """Remove a copy: out of the steps first (renamed), so that no reader meets it half deleted.

    ``spare``: its shard file becomes the host's spare, if it has none.
    """
    (directory / MANIFEST.format(step=step)).unlink(missing_ok=True)
    (directory / CHECKED.format(step=step)).unlink(missing_ok=True)
    doomed = directory / f".{step}.del-{os.getpid()}"
    shutil.rmtree(doomed, ignore_errors=True)  # (a removal of this step cut off before)
    try:
        os.rename(directory / str(step), doomed)
    except FileNotFoundError:
        return
    if spare and not (directory / SPARE).exists():
        with contextlib.suppress(FileNotFoundError):
            os.rename(doomed / SHARDS, directory / SPARE)
    shutil.rmtree(doomed, ignore_errors=True)


def _remove_orphans(directory: Path, also_mine: bool = False) -> None:
    """Remove copies (and verdicts) cut off mid-write by a process that is gone (or by this one)."""
    for p in [*directory.glob(".*.tmp-*"), *directory.glob(".*.del-*")]:
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (not Path(f"/proc/{pid}").exists() or (also_mine and int(pid) == os.getpid())):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:  # a verdict's temporary file (check_ahead)
                p.unlink(missing_ok=True)


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
