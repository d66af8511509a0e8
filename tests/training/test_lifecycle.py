"""Checkpoint lifecycle end to end: the in-training guard, validation, rollback, pruning."""

from __future__ import annotations

import pytest
from jobs import job_config, run_job, step_ids, worker_logs

from training import api
from training.backends import local
from training.checkpoint.ledger import Ledger
from training.storage import open_store

pytestmark = pytest.mark.slow


def test_nan_loss_rolls_back_in_job_and_skips_the_offending_batches(tmp_path, tiny_dataset, jax_cache):
    from training.data import global_batch_ids

    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="nan",
        steps=16,
        checkpoint_every=5,
        min_workers=2,
        max_workers=2,
        log_every=1,
        chaos=["nan:step=12"],
        trace_data_ids=True,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    [rb] = api.events(cfg.run_uri, ("rollback",))
    # The update of step 12 is NaN, so the loss reported at step 14 (computed on the
    # parameters after step 13) is the first non-finite one; step 10 is the last good checkpoint.
    assert (rb["kind"], rb["from_step"], rb["to_step"]) == ("in-job", 14, 10)
    assert "loss is nan" in rb["reason"]
    [how] = api.events(cfg.run_uri, ("resumed_with",))
    assert how["next_batch"] == 14 and how["skipped"] == [[10, 14]]
    assert api.events(cfg.run_uri, ("failure",)) == [], "a guard rollback is not a worker failure"
    assert api.status(cfg.run_uri)["state"] == "finished"
    # After the rollback, step 10 trains on global batch 14: batches 10..13 are skipped.
    ids = step_ids(cfg.run_uri)
    for step in range(10, 16):
        want = sorted(
            int(i)
            for i in global_batch_ids(tiny_dataset, seed=cfg.optimizer.seed, global_batch=16, batch_index=step + 4)
        )
        assert ids[step] == want


def test_guard_gives_up_past_its_attempt_limit_naming_step_and_metric(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="nan-forever",
        steps=12,
        checkpoint_every=5,
        min_workers=1,
        max_workers=1,
        log_every=1,
        chaos=["nan:step=7,repeat=1"],
        max_guard_rollbacks=1,
    )
    assert run_job(cfg) == 1
    st = api.status(cfg.run_uri)
    assert st["state"] == "failed"
    assert st["reason"] == (
        "in-training guard: loss is nan at step 9 (metric loss); 1 rollback(s) did not help (max_guard_rollbacks=1)"
    )
    assert len(api.events(cfg.run_uri, ("rollback",))) == 1


@pytest.mark.parametrize("where", ["local", pytest.param("gcs", marks=[pytest.mark.gcs, pytest.mark.extended])])
def test_validation_rejects_a_regression_and_training_resumes_from_the_last_good_checkpoint(
    where, request, tmp_path, tiny_dataset, jax_cache
):
    root = str(tmp_path) if where == "local" else request.getfixturevalue("gcs_root")
    # (The GCS emulator serves one request at a time: under a checkpoint's uploads a heartbeat can wait long.)
    slow = {"heartbeat_timeout_s": 30.0, "lease_s": 15.0} if where == "gcs" else {}
    cfg = job_config(
        root,
        tiny_dataset,
        jax_cache,
        run_name="regress",
        steps=15,
        checkpoint_every=5,
        min_workers=1,
        max_workers=1,
        chaos=["corrupt:step=15"],
        keep_last=2,
        keep_best=1,
        **slow,
    )
    assert run_job(cfg) == 0
    verdicts = api.validate_pending(cfg.run_uri)
    assert [(v["step"], v["verdict"]) for v in verdicts] == [(5, "validated"), (10, "validated"), (15, "rejected")]
    assert "worse than the best validated" in verdicts[2]["reason"]

    rb = api.rollback(cfg.run_uri, reason="validation rejected step 15")
    assert (rb["from_step"], rb["to_step"], rb["quarantined"]) == (15, 10, [15])
    ledger = Ledger(open_store(cfg.run_uri))
    assert ledger.pointer() == 10 and ledger.state(15)["state"] == "quarantined"
    assert api.committed_steps(cfg.run_uri) == [5, 10]
    assert open_store(cfg.run_uri).list("quarantine/"), "the rejected checkpoint is kept for inspection"

    # Resume from the pointer: the corruption fired once; training skips the data window since step 10.
    assert run_job(cfg) == 0
    restores = api.events(cfg.run_uri, ("restore",))
    assert restores[-1]["step"] == 10
    assert api.events(cfg.run_uri, ("resumed_with",))[-1]["next_batch"] == 15
    assert api.validate(cfg.run_uri)["verdict"] == "validated"
    assert ledger.state(15)["history"] == ["committed", "rejected", "quarantined", "committed", "validated"]
    # The verdicts' metrics are a TensorBoard run beside the training curves: one value per step, the
    # re-validated step 15 replacing its rejected value.
    from tensorboard_view import read_scalars

    val = read_scalars(cfg.run_uri, "validation")
    assert [s for s, _ in val["loss"]] == [5, 10, 15] and [v for _, v in val["rejected"]] == [0.0, 0.0, 0.0]
    assert val["loss"][2][1] == pytest.approx(ledger.state(15)["metrics"]["loss"])

    # Retention: keep the newest and the best; the pointer and newest validated are protected.
    dry = api.prune(cfg.run_uri, dry_run=True)
    assert dry["deleted"] == [5] and api.committed_steps(cfg.run_uri) == [5, 10, 15]
    done = api.prune(cfg.run_uri)
    assert done["deleted"] == [5]
    assert api.committed_steps(cfg.run_uri) == [10, 15]
    [ev] = api.events(cfg.run_uri, ("prune",))
    assert ev["deleted"] == [5]


def test_continual_training_on_a_refreshed_dataset_restarts_the_data_position(tmp_path, tiny_dataset, jax_cache):
    from training import data

    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="continual",
        steps=6,
        checkpoint_every=3,
        min_workers=1,
        max_workers=1,
    )
    assert run_job(cfg) == 0
    fresh = str(tmp_path / "refreshed")
    data.prepare(None, fresh, 64, max_bytes=200_000)  # other content: another fingerprint

    refused = cfg.model_copy(update={"dataset": fresh, "steps": 9})
    with pytest.raises(api.LaunchError, match="different dataset"):
        local.run_here(refused)

    onward = refused.model_copy(update={"on_dataset_change": "restart"})
    assert run_job(onward) == 0
    [ev] = api.events(cfg.run_uri, ("data_refreshed",))
    assert ev["step"] == 6 and ev["new"] == data.load_manifest(fresh)["fingerprint"] != ev["old"]
    assert api.status(cfg.run_uri)["step"] == 9


def test_validate_on_slice_judges_what_the_job_evaluated_on_its_own_mesh(tmp_path, tiny_dataset, jax_cache):
    """A model too big for one device: the job evaluates each step it saves, sharded like training; validation
    judges those metrics (the same as one device's), and evaluates on the host only a step the job did not."""
    from training.checkpoint.lifecycle import evaluate
    from training.checkpoint.manager import load_params_host

    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="on-slice",
        steps=12,
        checkpoint_every=4,
        min_workers=2,
        max_workers=2,
        validate_on="slice",
        chaos=["corrupt:step=12"],
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    evaluated = {e["step"]: e for e in api.events(cfg.run_uri, ("evaluated",))}
    assert sorted(evaluated) == [4, 8, 12]
    verdicts = api.validate_pending(cfg.run_uri)
    assert [(v["step"], v["verdict"], v["evaluated_on"]) for v in verdicts] == [
        (4, "validated", "slice"),
        (8, "validated", "slice"),
        (12, "rejected", "slice"),  # the corrupted parameters, caught from the job's own evaluation
    ]
    assert verdicts[1]["metrics"]["loss"] == evaluated[8]["metrics"]["loss"]
    # The same evaluation set on one device: the same metrics.
    on_host = evaluate(cfg, load_params_host(cfg.run_uri, 8))
    for key in ("loss", "accuracy"):
        assert on_host[key] == pytest.approx(evaluated[8]["metrics"][key], rel=1e-4), key
    # A step committed again by another round (trained again) has no evaluation of its own: left unjudged by
    # validate_pending (it is not the newest), evaluated on the host when asked for by name.
    Ledger(open_store(cfg.run_uri)).record(4, "committed", attempt=999)
    assert api.validate_pending(cfg.run_uri) == []
    again = api.validate(cfg.run_uri, 4)
    assert again["evaluated_on"] == "host"
    assert again["metrics"]["loss"] == pytest.approx(evaluated[4]["metrics"]["loss"], rel=1e-4)
