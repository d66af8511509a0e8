"""A round's persistent saves: the pins that keep a pruner off its steps, the background save pipeline, and the
stop request every process reads alike at a save.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, TypedDict

from training.checkpoint.resume import DataPosition
from training.checkpoint.steps import is_committed
from training.elastic.wire import ReportType
from training.elastic.worker.link import Assignment, Reporter
from training.storage import scheme

if TYPE_CHECKING:
    from training.checkpoint.ledger import PinKind
    from training.checkpoint.manager import FailFastManager
    from training.config import Config
    from training.storage import Store


class Pins:
    """A running job pins the steps it reads or writes, so a pruner never deletes them underneath (rank 0)."""

    def __init__(self, store: Store, rank: int, round_: int) -> None:
        self.store = store
        self.rank = rank
        self.owner = f"worker{rank}-r{round_}-{os.getpid()}"
        self.keys: dict[int, str] = {}

    def pin(self, step: int, kind: PinKind) -> None:
        from training.checkpoint.ledger import pin

        if self.rank == 0:
            self.keys[step] = pin(self.store, step, self.owner, kind)

    def unpin(self, step: int) -> None:
        from training.checkpoint.ledger import unpin

        if step in self.keys:
            unpin(self.store, self.keys.pop(step))


class SaveCost(TypedDict, total=False):
    """What a persistent save cost, reported with its commit: when it started (``t0``, dropped then), its bytes, the
    host copy's bound at this machine's bandwidth, the loop's pause, the save thread's and the write's seconds."""

    t0: float
    bytes: int
    copy_bound_s: float
    copy_GBps: float
    blocking_s: float
    save_s: float
    write_s: float


class Saver:
    """The checkpoint pipeline: saves in a background thread, a commit reported once Orbax finalised it.

    A save costs the loop only the dispatch of a host copy of the state
    (:class:`training.checkpoint.manager.HostSnapshot`, compiled in the save thread after the round's first steps).
    Everything else happens in the save thread: the pin, Orbax's blocking part (its barriers,
    per-array bookkeeping and the transfer to host memory), then Orbax's own background write.
    Running Orbax off the loop's thread is safe because every barrier it takes is a barrier of the
    coordination service (see :func:`training.checkpoint.manager.checkpoint_manager`), never a device
    collective that could interleave with the training step's.  With ``async_checkpoint: false``
    the loop saves and waits itself, as it asked.

    Each commit reports what the save cost: the loop's pause (``blocking_s``), the save thread's
    share (``save_s``), the time to commit (``write_s``), and the bytes this process copied against
    the lower bound of that copy at the host's memory bandwidth (``copy_bound_s``).
    """

    def __init__(
        self, run: str, mngr: FailFastManager, rep: Reporter, pins: Pins, abstract: Any, *, background: bool = True
    ) -> None:
        from training.checkpoint.manager import BackgroundSave, packs_small, raise_failure, wait_saved

        self.run = run
        self.mngr = mngr
        self.rep = rep
        self.pins = pins
        self.pending: int | None = None
        self.last_saved: int | None = None
        self.committed_any = False
        self.bg = BackgroundSave(abstract, "rtrain-save", background=background, gather_small=packs_small(mngr))
        self.raise_failure, self.wait_saved = raise_failure, wait_saved  # a failed commit's error, seen every step
        self.nbytes: int | None = None
        self.cost: SaveCost = {}

    def _commit(self, step: int) -> None:
        # An async save that failed raises here; a step is reported committed only when finalised.
        self.raise_failure(self.mngr)
        if not is_committed(self.run, step):  # that step alone: a listing of every step costs a look at each
            raise RuntimeError(f"checkpoint {step} did not commit (no finalised step directory){_why_not(self.mngr)}")
        cost, self.cost = self.cost, {}
        cost["write_s"] = round(time.time() - cost.pop("t0"), 4)
        self.rep.send(ReportType.CHECKPOINT, step=step, committed=True, **cost)
        self.pins.unpin(step)
        self.committed_any = True

    def _started(self, *, block: bool) -> bool:
        """Whether the save thread has handed the save to Orbax (its error, if any, raised here)."""
        started, took = self.bg.collect(block=block)
        if took is not None:
            self.cost["save_s"] = round(took, 4)
        return started

    def prepare_ahead(self) -> None:
        """Compile the save's host copy in the save thread now (after the round's first steps)."""
        self.bg.prepare_ahead()

    def poll(self) -> None:
        if self.pending is None or not self._started(block=False):
            return
        # A background write that failed (a full disk, a read-only root) raises now: Orbax may still count
        # the save as in progress, and the other processes wait for this one at its commit barrier.
        self.raise_failure(self.mngr)
        if not self.mngr.is_saving_in_progress():
            step, self.pending = self.pending, None
            self._commit(step)

    def wait(self) -> None:
        self._started(block=True)
        self.wait_saved(self.mngr)
        self.poll()

    def save(self, step: int, state: Any, data_pos: DataPosition, cfg: Config) -> None:
        from training.checkpoint import manager as ckpt

        if self.pending is not None:
            self.wait()
        t0 = time.time()
        if self.nbytes is None:
            self.nbytes = ckpt.local_bytes(state)  # the same at every save of this round's mesh
        nbytes, bandwidth = self.nbytes, ckpt.copy_bandwidth()
        self.cost = SaveCost(
            t0=t0, bytes=nbytes, copy_bound_s=round(nbytes / bandwidth, 6), copy_GBps=round(bandwidth / 1e9, 2)
        )

        def start(state: Any) -> None:
            self.pins.pin(step, "save")
            ckpt.save(self.mngr, step, state, data_pos, cfg)

        self.pending = self.last_saved = step
        self.bg.start(start, state)
        blocking = time.time() - t0
        self.cost["blocking_s"] = round(blocking, 4)
        self.rep.send(ReportType.CHECKPOINT, step=step, committed=False, blocking_s=blocking)


def _why_not(mngr: FailFastManager) -> str:
    """A likely reason a save did not commit: a full disk (Orbax's background error does not always surface)."""
    directory = str(mngr.directory)
    if not scheme(directory).filesystem:  # no disk of ours to fill
        return ""
    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    return f": No space left on device ({free} bytes free)" if free < (1 << 20) else ""


def stop_requested(store: Store, a: Assignment) -> bool:
    """Did the leader ask this round to stop at this checkpoint (to grow the group)?

    Only process 0 reads the request; its answer is broadcast so that every
    process stops at the same step.
    """
    return StopVote.cast(store, a, 0).agreed()


def _read_stop_request(store: Store, a: Assignment) -> int:
    from training.layout import CONTROL
    from training.storage import NotFound

    try:
        req = json.loads(store.get(CONTROL))
        return int(req.get("action") == "stop_at_checkpoint" and req.get("round") == a.round)
    except (NotFound, ValueError):
        return 0


def _sum_over_processes(x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.sum(x, dtype=x.dtype, axis=0)


class StopVote:
    """Process 0's reading of a stop request, broadcast to every process for the save at ``step``.

    Cast a step before that save and read at it: the broadcast runs on the devices between the two
    steps, so the save waits for no collective of its own (a blocking broadcast there held every
    process's loop for it at each save).
    """

    def __init__(self, step: int, flag: Any) -> None:
        self.step, self.flag = step, flag

    @classmethod
    def cast(cls, store: Store, a: Assignment, step: int) -> StopVote:
        import jax
        import numpy as np
        from jax.experimental import multihost_utils
        from jax.sharding import Mesh
        from jax.sharding import PartitionSpec as P

        flag = _read_stop_request(store, a) if a.rank == 0 else 0
        if a.processes == 1:
            return cls(step, flag)
        devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
        mesh = Mesh(devices, ("processes", "local_devices"))
        mine = multihost_utils.host_local_array_to_global_array(np.full((1,), flag, np.int32), mesh, P("processes"))
        with jax.set_mesh(mesh):
            return cls(step, jax.jit(_sum_over_processes, out_shardings=P())(mine))

    def agreed(self) -> bool:
        """Whether every process stops at the save (waits for the broadcast if it is still running)."""
        import jax

        if isinstance(self.flag, int):
            return bool(self.flag)
        return bool(int(jax.device_get(self.flag.addressable_data(0))))
