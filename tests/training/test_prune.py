"""Prune a real Orbax checkpoint directory: exactly the planned steps go, nothing in use does."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from training.checkpoint import prune as prune_mod
from training.checkpoint.ledger import Ledger, pin
from training.checkpoint.retention import KeepBestN, KeepLastN
from training.events import EventLog
from training.storage import LocalStore, Store, open_store

ocp = pytest.importorskip("orbax.checkpoint")
TMP = "600.orbax-checkpoint-tmp"  # what Orbax leaves when a local save of step 600 dies


def save_steps(uri: str, steps: list[int]) -> None:
    # OCDBT (Orbax's default) on either root, as the trainer saves.
    mgr = ocp.CheckpointManager(
        uri + "/checkpoints",
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
        item_handlers=ocp.StandardCheckpointHandler(),
    )
    for step in steps:
        tree = {"w": np.full((64,), float(step), np.float32), "b": np.arange(8, dtype=np.int32) + step}
        mgr.save(step, args=ocp.args.StandardSave(tree))
    mgr.wait_until_finished()
    mgr.close()


def committed_steps(uri: str) -> list[int]:
    from orbax.checkpoint._src.path import step as ocp_step

    return sorted(ocp_step.checkpoint_steps(uri + "/checkpoints"))


def fake_crashed_save(run: Path, name: str = TMP, age_s: float = 7200) -> None:
    d = run / "checkpoints" / name / "default"
    d.mkdir(parents=True)
    (d / "partial").write_bytes(b"\0" * 1000)
    old = time.time() - age_s
    for p in (d / "partial", d, d.parent):
        os.utime(p, (old, old))


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """Steps 100..500 saved by Orbax; 100-300 validated, 400 rejected, 500 never recorded; a crashed save of 600."""
    root = tmp_path / "run"
    save_steps(str(root), [100, 200, 300, 400, 500])
    ledger = Ledger(open_store(str(root)))
    for step, loss in [(100, 0.5), (200, 0.2), (300, 0.4)]:
        ledger.record(step, "committed")
        ledger.record(step, "validated", metrics={"loss": loss})
    ledger.record(400, "rejected", reason="loss went up")
    fake_crashed_save(root)
    return root


def tree_listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    "policy, kept, deleted",
    [
        # 500: newest committed; 300: newest validated; 400 (rejected) is counted by no rule.
        (KeepLastN(1), {300, 500}, [100, 200, 400]),
        (KeepLastN(1) | KeepBestN(1, "loss"), {200, 300, 500}, [100, 400]),
        (KeepLastN(3), {200, 300, 500}, [100, 400]),
    ],
    ids=str,
)
def test_plan_names_exactly_what_goes(run: Path, policy, kept: set[int], deleted: list[int]) -> None:
    plan = prune_mod.plan_prune(str(run), policy)
    assert set(plan.kept) == kept and plan.deleted == deleted
    assert plan.incomplete == [TMP]
    assert plan.kept[500][0] == "newest committed" and plan.kept[300][0] == "newest validated"


def test_dry_run_deletes_nothing_and_reports_bytes(run: Path) -> None:
    before = tree_listing(run)
    events = EventLog(open_store(str(run)), source="test")
    plan = prune_mod.prune(str(run), KeepLastN(1), dry_run=True, events=events)
    assert plan.dry_run and plan.deleted == [100, 200, 400] and plan.incomplete == [TMP]
    step_bytes = sum(f.stat().st_size for f in (run / "checkpoints" / "100").rglob("*") if f.is_file())
    assert plan.sizes["100"] == step_bytes > 0 and plan.sizes[TMP] == 1000
    assert plan.bytes_freed == sum(plan.sizes.values())
    assert tree_listing(run) == before
    assert events.read() == []


def test_prune_deletes_the_plan_and_records_it(run: Path) -> None:
    store = open_store(str(run))
    events = EventLog(store, source="test")
    planned = prune_mod.plan_prune(store, KeepLastN(1))
    plan = prune_mod.prune(str(run), KeepLastN(1), dry_run=False, events=events, batch_size=2)
    assert plan.deleted == [100, 200, 400] and plan.incomplete == [TMP]
    assert plan.bytes_freed == planned.bytes_freed > 0
    assert committed_steps(str(run)) == [300, 500]
    assert sorted(os.listdir(run / "checkpoints")) == ["300", "500"]
    assert Ledger(store).state(100)["state"] == "pruned"  # type: ignore[index]
    (ev,) = events.read(("prune",))
    assert ev["deleted"] == [100, 200, 400] and ev["kept"] == [300, 500] and ev["bytes_freed"] == plan.bytes_freed
    # What is kept still restores, and a second prune has nothing to do.
    mgr = ocp.CheckpointManager(str(run / "checkpoints"))
    restored = mgr.restore(300, args=ocp.args.StandardRestore())
    assert float(restored["w"][0]) == 300.0
    mgr.close()
    again = prune_mod.prune(str(run), KeepLastN(1), dry_run=False)
    assert again.deleted == [] and again.incomplete == []


def test_a_pinned_step_is_never_deleted(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(str(run))
    pin(store, 100, "validator", "restore")  # a restore in flight
    pin(store, 600, "trainer", "save")  # a save in flight, not a crash
    real_plan = prune_mod.plan_prune

    def plan_then_a_job_pins_200(*a, **k):  # a restore of 200 starts after the plan was made
        plan = real_plan(*a, **k)
        pin(store, 200, "rollback", "restore")
        return plan

    monkeypatch.setattr(prune_mod, "plan_prune", plan_then_a_job_pins_200)
    plan = prune_mod.prune(str(run), KeepLastN(1), dry_run=False)
    assert plan.deleted == [400]
    assert plan.kept[100] == ["pinned"] and plan.kept[200] == ["pinned"]
    assert plan.incomplete == [] and "pinned" in plan.left_alone[TMP]
    assert committed_steps(str(run)) == [100, 200, 300, 500]
    assert (run / "checkpoints" / TMP).is_dir()


def test_an_incomplete_checkpoint_is_removed_only_when_quiet(run: Path) -> None:
    fake_crashed_save(run, "700.orbax-checkpoint-tmp", age_s=5)  # looks like a save in flight
    plan = prune_mod.prune(str(run), KeepLastN(5), dry_run=False)
    assert plan.deleted == [400] and plan.incomplete == [TMP]
    assert "in flight" in plan.left_alone["700.orbax-checkpoint-tmp"]
    assert not (run / "checkpoints" / TMP).exists()
    plan = prune_mod.prune(str(run), KeepLastN(5), dry_run=False, incomplete_grace_s=0)
    assert plan.incomplete == ["700.orbax-checkpoint-tmp"]
    assert sorted(os.listdir(run / "checkpoints")) == ["100", "200", "300", "500"]


def test_a_prune_that_dies_midway_leaves_no_half_deleted_committed_step(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(self: LocalStore, key: str) -> None:
        raise RuntimeError("killed")

    monkeypatch.setattr(LocalStore, "delete", crash)
    with pytest.raises(RuntimeError):
        prune_mod.prune(str(run), KeepLastN(1), dry_run=False)
    monkeypatch.undo()
    # Step 100 was un-committed before its files went: Orbax no longer sees it,
    # and the next prune cleans it up as an incomplete checkpoint.
    assert committed_steps(str(run)) == [200, 300, 400, 500]
    plan = prune_mod.prune(str(run), KeepLastN(1), dry_run=False)
    assert plan.deleted == [200, 400] and len(plan.incomplete) == 2 and plan.incomplete[0].startswith("100.")
    assert sorted(os.listdir(run / "checkpoints")) == ["300", "500"]


@pytest.mark.gcs
def test_prune_on_gcs(gcs_root: str) -> None:
    save_steps(gcs_root, [1, 2, 20])
    store: Store = open_store(gcs_root)
    store.put("checkpoints/9/default/partial", b"x" * 100)  # a save that died before its commit marker
    Ledger(store).set_pointer(1, "rollback")
    events = EventLog(store, source="test")

    dry = prune_mod.prune(gcs_root, KeepLastN(1), dry_run=True, incomplete_grace_s=0)
    assert dry.deleted == [2] and dry.incomplete == ["9"] and dry.bytes_freed > 100
    assert committed_steps(gcs_root) == [1, 2, 20]

    plan = prune_mod.prune(gcs_root, KeepLastN(1), dry_run=False, events=events, incomplete_grace_s=0)
    assert plan.kept == {1: ["resume pointer"], 20: ["newest committed", "keep_last(1)"]}
    assert plan.deleted == [2] and plan.incomplete == ["9"]
    names = store.list("checkpoints/")
    assert not [n for n in names if n.startswith(("checkpoints/2/", "checkpoints/9/"))]
    assert any(n.startswith("checkpoints/20/") for n in names)  # "checkpoints/2" is a prefix of it
    assert committed_steps(gcs_root) == [1, 20]
    assert events.read(("prune",))[0]["deleted"] == [2]
