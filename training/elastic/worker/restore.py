"""Where a round starts: a local copy every process holds, a committed checkpoint (checked, resharded onto
this mesh), or a new model; with a rollback's hint and a changed dataset's rule.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from training.checkpoint.resume import DataPosition
from training.elastic.codes import WorkerExit
from training.elastic.wire import ReportType
from training.elastic.worker import link
from training.elastic.worker.link import Assignment, Reporter, leave
from training.elastic.worker.programs import init_once
from training.elastic.worker.saves import Pins

if TYPE_CHECKING:
    from training.checkpoint.ledger import CheckpointRecord, Ledger
    from training.checkpoint.local import LocalTier
    from training.checkpoint.manager import FailFastManager
    from training.checkpoint.resume import ResumeHint
    from training.config import Config
    from training.elastic.chaos import WorkerChaos
    from training.sections import DataSection
    from training.trainer import Trainer


@dataclass
class Start:
    """Where a round starts: the train state, the step it holds (None: a new model), the data position."""

    state: Any
    restored: int | None
    next_batch: int
    lr_scale: float
    skipped: list[list[int]]
    dataset: str  # the fingerprint of the data trained on
    tier: LocalTier | None  # this host's local checkpoint tier (None: off)
    chaos: WorkerChaos  # the faults this process fires

    @property
    def step(self) -> int:
        return int(self.restored or 0)


def restore(
    cfg: Config,
    run: str,
    a: Assignment,
    rep: Reporter,
    trainer: Trainer,
    mngr: FailFastManager,
    ledger: Ledger,
    dataset: str,
    pins: Pins,
) -> Start:
    """The round's starting point: a local copy, a committed checkpoint (resharded onto this mesh), or a new model.

    Every process computes the same decision from the same objects (committed steps, ledger,
    the round's local candidates and every process's verdict on its own copies).
    """
    from training.checkpoint.resume import ResumeError, choose_resume
    from training.checkpoint.steps import committed_steps

    t0 = time.time()
    shape = trainer.mesh.shape
    tier, chaos = host_tier(cfg, run, a, rep, trainer)
    live = tier if tier is not None and tier.enabled else None  # the tier, when it is on
    local_step = local_candidate(run, a, rep, live, ledger) if live is not None else None
    decision = None
    if local_step is not None:
        assert live is not None
        state, pos = restore_local(live, local_step, a, rep, t0)
        step0: int | None = local_step
    else:
        try:
            states = ledger.states()
            decision = choose_resume(a.resume.checkpoint, committed_steps(run), states, ledger.pointer_record())
        except ResumeError as e:
            leave(rep, WorkerExit.ERROR, str(e))
        step0 = decision.step
        if step0 is not None:
            state, pos = restore_persistent(run, step0, a, rep, trainer, mngr, ledger, states, pins)
            rep.send(
                ReportType.RESTORE,
                step=step0,
                tier="persistent",
                mesh=shape,
                workers=a.processes,
                seconds=time.time() - t0,
            )
        else:
            state, pos = init_once(cfg, trainer, pins.store, a), DataPosition(next_batch=0)
            rep.send(ReportType.INIT, step=0, mesh=shape, workers=a.processes, seconds=time.time() - t0)
    if step0 is not None and pos.get("dataset") not in (None, dataset):
        pos = data_changed(cfg.data, step0, pos, dataset, rep)
    if live is not None:
        live.forget_after(step0)
    start = Start(
        state,
        step0,
        int(pos["next_batch"]),
        float(pos.get("lr_scale", 1.0)),
        list(pos.get("skipped", [])),
        dataset,
        tier,
        chaos,
    )
    if decision is not None and decision.hint is not None:
        follow_hint(start, decision.hint, rep)
    return start


def host_tier(
    cfg: Config, run: str, a: Assignment, rep: Reporter, trainer: Trainer
) -> tuple[LocalTier | None, WorkerChaos]:
    """This host's local checkpoint tier (None: off; reported when it cannot be used) and the faults this process
    fires (some act on the tier's copies), the tier held for the worker's link."""
    from training.checkpoint.local import LocalTier, host_dir
    from training.elastic.chaos import WorkerChaos

    ck = cfg.checkpoint
    local_dir = host_dir(ck.local_checkpoint_dir, run, a.job, os.environ["RTRAIN_HOST"])
    tier = LocalTier(local_dir, ck.local_keep, trainer.mesh, trainer.abstract) if ck.local_checkpoint_every else None
    link.hold_tier(tier)
    live = tier if tier is not None and tier.enabled else None
    chaos = WorkerChaos(
        list(a.faults), a.rank, rep.send, local_dir, (lambda: settle_local(live, rep, a)) if live is not None else None
    )
    if tier is not None and not tier.enabled:
        rep.send(ReportType.LOCAL_TIER_OFF, reason=tier.reason)
    return tier, chaos


def restore_local(tier: LocalTier, step: int, a: Assignment, rep: Reporter, t0: float) -> tuple[Any, DataPosition]:
    """This host's local copy of ``step`` onto the round's mesh, reported (started at ``t0``)."""
    state, pos = tier.restore(step)
    rep.send(
        ReportType.RESTORE,
        step=step,
        tier="local",
        mesh=tier.mesh.shape,
        workers=a.processes,
        seconds=time.time() - t0,
        checked_ahead=step in tier.ahead,  # its agent had checked this host's copy whole
    )
    return state, pos


def local_candidate(run: str, a: Assignment, rep: Reporter, tier: LocalTier, ledger: Ledger) -> int | None:
    """The local copy the round starts from: the newest the leader offered that every process holds intact and
    that is newer than any committed persistent step (None: the persistent tier)."""
    from training.checkpoint.resume import ResumeError, choose_resume
    from training.checkpoint.steps import committed_steps

    if not a.resume.local:
        return None
    # The leader judged "newer than any persistent checkpoint" from the ledger; a save that Orbax
    # finalised but whose record was not written yet (its process died) is a committed step too.
    try:
        persistent = choose_resume("latest", committed_steps(run), ledger.states(), None).step
    except ResumeError:
        persistent = None
    return pick_local_step(list(a.resume.local), tier, a, rep, newer_than=persistent)


def follow_hint(start: Start, hint: ResumeHint, rep: Reporter) -> None:
    """A rollback's hint for the resumed round: skip to its batch, scale the learning rate; reported."""
    if hint.skip_to_batch is not None and hint.skip_to_batch > start.next_batch:
        start.skipped.append([start.next_batch, hint.skip_to_batch])
        start.next_batch = hint.skip_to_batch
    start.lr_scale *= hint.lr_scale
    rep.send(
        ReportType.RESUMED_WITH,
        step=start.step,
        next_batch=start.next_batch,
        lr_scale=start.lr_scale,
        skipped=start.skipped,
    )


def data_changed(data: DataSection, step: int, pos: DataPosition, dataset: str, rep: Reporter) -> DataPosition:
    """The data position to go on from when checkpoint ``step`` was trained on another dataset (or leave)."""
    if data.on_dataset_change != "restart":
        leave(
            rep,
            WorkerExit.ERROR,
            f"checkpoint {step} was trained on dataset {pos.get('dataset')}, not {dataset} "
            "(on_dataset_change=restart continues on the new data)",
        )
    # Continual training on refreshed data: the model goes on, the data position starts over.
    rep.send(ReportType.DATA_REFRESHED, step=step, old=pos.get("dataset"), new=dataset)
    return DataPosition(next_batch=0, lr_scale=pos.get("lr_scale", 1.0))


def restore_persistent(
    run: str,
    step: int,
    a: Assignment,
    rep: Reporter,
    trainer: Trainer,
    mngr: FailFastManager,
    ledger: Ledger,
    states: Mapping[int, CheckpointRecord],
    pins: Pins,
) -> tuple[Any, DataPosition]:
    """Committed checkpoint ``step``, checked and resharded onto this round's mesh, and its data position.

    A checkpoint whose files fail their check, or whose data cannot be read, is reported corrupt and
    the worker leaves (the leader then resumes from an older one).
    """
    from training.checkpoint import manager as ckpt
    from training.checkpoint.retention import USABLE_STATES

    check_integrity(run, step, ledger, a, rep)
    pins.pin(step, "restore")
    try:
        state, pos = ckpt.restore(mngr, step, trainer.abstract)
    except Exception as e:  # noqa: BLE001 - unreadable data is a corrupt checkpoint; anything else an error
        if looks_unreadable(e):
            rep.send(ReportType.CORRUPT, step=step, reason=f"restore failed: {str(e).strip().splitlines()[0]}")
            leave(rep, WorkerExit.CORRUPT)
        raise
    pins.unpin(step)
    record = states.get(step)
    if a.rank == 0 and (record["state"] if record else "committed") not in USABLE_STATES:
        # A later save of a step whose unusable one was moved out: its commit is on record from now on.
        ledger.record(step, "committed", reason="committed by Orbax; its writer did not live to record it")
    return state, pos


def settle_local(tier: LocalTier, rep: Reporter, a: Assignment) -> None:
    """Finish this host's local saves in flight and report each one."""
    tier.wait()
    for done, seconds in tier.finished():
        rep.send(ReportType.LOCAL_CHECKPOINT, everyone=True, step=done, seconds=seconds, round=a.round)


def pick_local_step(
    candidates: list[int], tier: LocalTier, a: Assignment, rep: Reporter, newer_than: int | None = None
) -> int | None:
    """The newest candidate whose local copy every process holds intact (or None: the persistent tier).

    Newest first, each process checks its own copy of a candidate (every byte against its sums,
    which maps it for the restore) and the verdicts are gathered, so every process takes the same
    decision; an older candidate is checked only when a newer one failed somewhere.  A copy that
    fails is stepped over, with an event naming it.  A candidate no newer than a committed
    persistent step (``newer_than``, as any process sees it) is not taken: the persistent tier
    has that state or a newer one.
    """
    floor = int(_gathered(a, -1 if newer_than is None else newer_than).max())  # -1: no committed step
    for s in candidates:
        if s <= floor:
            break
        problem = tier.check(s)
        if _gathered(a, 0 if problem else 1).all():
            return s
        if problem:  # stepped over
            rep.send(
                ReportType.LOCAL_CHECKPOINT_SKIPPED,
                everyone=True,
                step=s,
                host=os.environ.get("RTRAIN_HOST"),
                reason=problem,
            )
    tier.forget_checked()  # no local copy is taken: its mappings and device memory go before the persistent restore
    return None


def _gathered(a: Assignment, value: int) -> Any:
    """Every process's ``value`` (an array, one per process)."""
    import numpy as np

    mine = np.array([value], np.int32)
    if a.processes == 1:
        return mine
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)


def check_integrity(run: str, step: int, ledger: Ledger, a: Assignment, rep: Reporter) -> None:
    """Process 0 checks the step's files against its ledger record; every process learns the verdict."""
    import numpy as np
    from jax.experimental import multihost_utils

    from training.checkpoint.steps import verify

    problem = ""
    if a.rank == 0:
        record = ledger.state(step)
        try:
            problem = verify(run, step, record.get("files") if record is not None else None)
        except Exception as e:  # noqa: BLE001 - an unreadable step is as bad as a changed one
            problem = f"cannot check checkpoint {step}: {e}"
    bad = int(bool(problem))
    if a.processes > 1:
        bad = int(multihost_utils.broadcast_one_to_all(np.int32(bad)))
    if bad:
        if a.rank == 0:
            rep.send(ReportType.CORRUPT, step=step, reason=problem)
        leave(rep, WorkerExit.CORRUPT)


def looks_unreadable(e: BaseException) -> bool:
    """A restore error about the checkpoint's own bytes (not a vanished peer)."""
    text = f"{type(e).__name__} {e}".lower()
    return any(k in text for k in ("data_loss", "not_found", "error reading", "error opening", "corrupt", "decode"))
