"""Delete the checkpoints a retention policy lets go, and the debris of crashed saves.

``plan_prune`` decides, ``prune`` acts.  What counts as a committed checkpoint
is Orbax's own rule (``orbax.checkpoint.path.step.is_path_finalized``: a
renamed directory on a local root, a ``commit_success.txt`` marker on gs://),
so prune and restore never disagree about which steps exist.

Safety, in order of importance:

* the protected set (newest usable, newest validated, resume pointer, promoted,
  pinned) is kept whatever the policy says;
* pins and the resume pointer are read again just before each batch is
  deleted, so a restore that started after planning is not pulled from under
  the job;
* an incomplete checkpoint (an Orbax temporary directory, or on gs:// a step
  directory without its commit marker) is removed only when no job has pinned
  its step *and* nothing was written into it for ``incomplete_grace_s``: a save
  in flight looks exactly like a crashed one;
* a step is marked ``pruned`` in the ledger before its files go, and its
  commit is undone first (local: renamed to an Orbax temporary name; gs://:
  the commit marker deleted first), so a prune that dies half way leaves an
  incomplete checkpoint for the next prune, never a committed one with holes.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal, TypedDict

from training.checkpoint.ledger import Ledger, pinned_steps
from training.checkpoint.retention import (
    AnyOf,
    ExpireQuarantined,
    KeepBestN,
    KeepEveryNSteps,
    KeepLastN,
    Policy,
    StepInfo,
    decide,
)
from training.events import EventLog
from training.layout import CHECKPOINTS
from training.sections import CheckpointSection
from training.storage import NotFound, Store, open_store, scheme

# A committed step being deleted on a local root is first renamed to
# "<step>.orbax-checkpoint-tmp-pruning-<nonce>": Orbax then sees it as temporary.
PRUNING = "-pruning-"


@dataclass
class PrunePlan:
    """What a prune keeps and deletes, and why (also what ``prune`` did, when not a dry run)."""

    run_uri: str
    now: float
    kept: dict[int, list[str]]  # step -> the reasons it is kept
    deleted: list[int]  # committed steps to delete, ascending
    incomplete: list[str]  # names of incomplete checkpoint directories to delete
    left_alone: dict[str, str] = field(default_factory=dict)  # incomplete dir -> why it stays
    sizes: dict[str, int] = field(default_factory=dict)  # dir name -> bytes, for what is deleted
    dry_run: bool = True

    @property
    def bytes_freed(self) -> int:
        return sum(self.sizes.get(str(s), 0) for s in self.deleted) + sum(self.sizes.get(n, 0) for n in self.incomplete)

    def to_dict(self) -> Pruned:
        return Pruned(
            run_uri=self.run_uri,
            now=self.now,
            kept={str(k): v for k, v in self.kept.items()},
            deleted=list(self.deleted),
            incomplete=list(self.incomplete),
            left_alone=dict(self.left_alone),
            sizes=dict(self.sizes),
            dry_run=self.dry_run,
            bytes_freed=self.bytes_freed,
            quarantine_expired=[],
        )


class Pruned(TypedDict):
    """What a prune kept, deleted and freed, as JSON (the CLI's and the DAG's result)."""

    run_uri: str
    now: float
    kept: dict[str, list[str]]  # step (as text) -> the reasons it is kept
    deleted: list[int]
    incomplete: list[str]
    left_alone: dict[str, str]
    sizes: dict[str, int]
    dry_run: bool
    bytes_freed: int
    quarantine_expired: list[str]  # quarantined checkpoints past their time to live (deleted unless a dry run)


def retention_policy(ck: CheckpointSection, best_mode: Literal["min", "max"] = "min") -> Policy:
    """The union of the checkpoint section's enabled retention rules; 0 turns a rule off (the protected set is
    kept regardless).

    With every rule off only the protected set survives a prune.
    """
    rules: list[Policy] = []
    if ck.keep_last > 0:
        rules.append(KeepLastN(ck.keep_last))
    if ck.keep_best > 0:
        rules.append(KeepBestN(ck.keep_best, ck.best_metric, best_mode))
    if ck.keep_every > 0:
        rules.append(KeepEveryNSteps(ck.keep_every))
    if ck.quarantine_ttl_s > 0:
        rules.append(ExpireQuarantined(ck.quarantine_ttl_s))
    return AnyOf(*rules)


# -- looking at the checkpoint directory -------------------------------------------------


def _checkpoint_dirs(store: Store) -> tuple[dict[int, str], dict[str, int]]:
    """(committed step -> dir name, incomplete dir name -> step), by Orbax's rules."""
    from etils import epath
    from orbax.checkpoint._src.path import step as ocp_step

    root = store.child(CHECKPOINTS)
    if scheme(root).cached_listings:
        _forget_listings(root)
    base = epath.Path(root)
    committed: dict[int, str] = {}
    incomplete: dict[str, int] = {}
    if not base.exists():
        return committed, incomplete
    for path in base.iterdir():
        try:
            step = ocp_step.step_from_checkpoint_name(path.name)
        except ValueError:
            continue  # not a step directory (Orbax metadata, something of a user's)
        if ocp_step.is_path_finalized(path):
            committed[step] = path.name
        elif ocp_step.is_path_temporary(path):
            incomplete[path.name] = step
    return committed, incomplete


def _forget_listings(uri: str) -> None:
    """Drop gcsfs's cached listings (used by epath, hence by Orbax's path checks).

    gcsfs caches directory listings for the life of the process; a long-lived
    process (an Airflow worker) would otherwise judge "committed" from a stale
    view and could miss a step committed or deleted since.
    """
    try:
        from etils.epath import backend

        backend.fsspec_backend.fs(uri).invalidate_cache()
    except Exception:  # a different epath backend (tf.io.gfile) keeps no such cache
        pass


def _scan(store: Store, dirname: str) -> tuple[int, float | None]:
    """(bytes, newest write time) of a checkpoint directory."""
    return store.usage(f"{CHECKPOINTS}/{dirname}")


def _step_infos(ledger: Ledger, committed: dict[int, str]) -> list[StepInfo]:
    states = ledger.states(committed)
    infos = []
    for step in sorted(committed):
        rec = states.get(step)
        if rec is None:
            infos.append(StepInfo(step))  # committed by Orbax, never recorded (the job died first)
        else:
            infos.append(StepInfo(step, rec["state"], rec.get("metrics"), rec.get("time")))
    return infos


def plan_prune(
    run: str | Store,
    policy: Policy,
    now: float | None = None,
    *,
    pin_max_age_s: float = 3600.0,
    incomplete_grace_s: float = 600.0,
) -> PrunePlan:
    """What ``prune`` would delete, without deleting anything."""
    store = open_store(run) if isinstance(run, str) else run
    now = time.time() if now is None else now
    ledger = Ledger(store)
    committed, incomplete = _checkpoint_dirs(store)
    pins = pinned_steps(store, pin_max_age_s, now)
    kept, deleted = decide(policy, _step_infos(ledger, committed), now, ledger.pointer(), pins)

    plan = PrunePlan(store.uri, now, kept, deleted, [])
    for step in deleted:
        plan.sizes[str(step)] = _scan(store, committed[step])[0]
    for name, step in sorted(incomplete.items()):
        size, newest = _scan(store, name)
        if PRUNING in name:
            plan.incomplete.append(name)  # our own, left by a prune that died: no save writes here
            plan.sizes[name] = size
        elif step in pins:
            plan.left_alone[name] = f"step {step} is pinned by a running job"
        elif newest is not None and now - newest < incomplete_grace_s:
            plan.left_alone[name] = (
                f"written {now - newest:.0f}s ago (< {incomplete_grace_s:g}s): a save may be in flight"
            )
        else:
            plan.incomplete.append(name)
            plan.sizes[name] = size
    return plan


# -- deleting ----------------------------------------------------------------------------------


def _delete_dir(store: Store, dirname: str, committed: bool) -> None:
    """Delete one checkpoint directory, undoing its commit first (see the module docstring)."""
    from orbax.checkpoint._src.path import atomicity_types

    key = f"{CHECKPOINTS}/{dirname}"
    if committed and scheme(store.uri).atomic_rename:  # a rename undoes the commit at once
        doomed = f"{key}{atomicity_types.TMP_DIR_SUFFIX}{PRUNING}{uuid.uuid4().hex[:8]}"
        try:
            store.move(key, doomed)
        except (FileNotFoundError, NotFound):
            return
        key = doomed
    elif committed:
        store.delete(f"{key}/{atomicity_types.COMMIT_SUCCESS_FILE}")
    # The trailing slash matters: a prefix "checkpoints/5" would also match "checkpoints/50".
    store.delete(key + "/")


def prune(
    run: str | Store,
    policy: Policy,
    dry_run: bool,
    events: EventLog | None = None,
    *,
    now: float | None = None,
    batch_size: int = 16,
    pin_max_age_s: float = 3600.0,
    incomplete_grace_s: float = 600.0,
) -> PrunePlan:
    """Plan, then (unless ``dry_run``) delete in batches and emit a "prune" event.

    Returns the plan as carried out: a step pinned or pointed at after planning
    moves from ``deleted`` to ``kept``.  A dry run deletes nothing and emits nothing.
    """
    store = open_store(run) if isinstance(run, str) else run
    plan = plan_prune(store, policy, now, pin_max_age_s=pin_max_age_s, incomplete_grace_s=incomplete_grace_s)
    plan.dry_run = dry_run
    if dry_run:
        return plan

    ledger = Ledger(store)
    done: list[int] = []
    todo = list(plan.deleted)
    for i in range(0, len(todo), batch_size):
        # Look again right before deleting: a job may have pinned a step, or a
        # rollback moved the pointer onto it, since the plan was made.
        pins = pinned_steps(store, pin_max_age_s)
        pointer = ledger.pointer()
        for step in todo[i : i + batch_size]:
            if step in pins or step == pointer:
                plan.kept[step] = ["pinned" if step in pins else "resume pointer"]
                plan.sizes.pop(str(step), None)
                continue
            ledger.record(step, "pruned", policy=str(policy))
            _delete_dir(store, str(step), committed=True)
            done.append(step)
    plan.deleted = done
    plan.kept = dict(sorted(plan.kept.items()))

    pins = pinned_steps(store, pin_max_age_s)
    gone = []
    for name in plan.incomplete:
        from orbax.checkpoint._src.path import step as ocp_step

        step = ocp_step.step_from_checkpoint_name(name)
        if step in pins:
            plan.left_alone[name] = f"step {step} is pinned by a running job"
            plan.sizes.pop(name, None)
            continue
        _delete_dir(store, name, committed=False)
        gone.append(name)
    plan.incomplete = gone

    if events is not None:
        events.emit(
            "prune",
            deleted=plan.deleted,
            kept=sorted(plan.kept),
            bytes_freed=plan.bytes_freed,
            incomplete=plan.incomplete,
            policy=str(policy),
        )
    return plan
