"""The elastic engine end to end: real JAX processes, real gloo collectives, real SIGKILLs."""

from __future__ import annotations

import numpy as np
import pytest
from jobs import job_config, run_job, step_ids, worker_logs

from training import api
from training.storage import open_store

pytestmark = pytest.mark.slow


def _events(run_uri: str, *types: str) -> list[dict]:
    return api.events(run_uri, types or None)


def _final_state(run_uri: str, step: int) -> dict:
    from training.trainer import load_state_host

    return load_state_host(run_uri, step)


def _newest_committed_before_failure(run_uri: str) -> int:
    # Async saves commit in the background: which one had committed when the worker
    # died depends on timing, so the contract is "the newest committed", not a step number.
    evs = _events(run_uri)
    i_fail = next(i for i, e in enumerate(evs) if e["type"] == "failure")
    return max(e["step"] for e in evs[:i_fail] if e["type"] == "checkpoint" and e["committed"])


def _assert_exact_data_position(run_uri: str, dataset: str, cfg) -> None:
    from training.data import global_batch_ids

    ids = step_ids(run_uri)
    assert sorted(ids) == list(range(cfg.steps)), "every step consumed exactly one global batch"
    for step, got in ids.items():
        want = global_batch_ids(dataset, seed=cfg.seed, global_batch=cfg.global_batch, batch_index=step)
        assert got == sorted(int(i) for i in want), f"step {step}: wrong examples after a resize"


def test_losing_one_of_four_hosts_resizes_and_finishes_every_step(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="lose-host",
        steps=24,
        min_workers=2,
        max_workers=4,
        checkpoint_every=8,
        chaos=["preempt:worker=1,step=13"],
        trace_data_ids=True,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)

    st = api.status(cfg.run_uri)
    assert st["state"] == "finished" and st["step"] == 24 and st["workers"] == 2

    [failure] = _events(cfg.run_uri, "failure")
    assert failure["worker"] == 1 and failure["returncode"] == -9
    assert 0 <= failure["detect_s"] < 2.0, "the agent must see a dead worker within about a second"
    [resize] = _events(cfg.run_uri, "resize")
    # 3 hosts are left, but 16 sequences do not split over 3: the plan takes 2.
    assert (resize["old_workers"], resize["new_workers"]) == (4, 2)
    assert resize["old_mesh"] == {"data": 4, "fsdp": 2, "tensor": 1}
    assert resize["new_mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}

    # The restore is of the newest checkpoint committed before the failure.
    [restore] = _events(cfg.run_uri, "restore")
    assert restore["step"] == _newest_committed_before_failure(cfg.run_uri)
    assert restore["mesh"] == resize["new_mesh"]
    resumed = [e for e in _events(cfg.run_uri, "resumed") if e["attempt"] == 1]
    assert resumed and resumed[0]["step"] == 9

    _assert_exact_data_position(cfg.run_uri, tiny_dataset, cfg)


def test_resume_parity_same_topology_bitwise_and_across_topologies_within_tolerance(tmp_path, tiny_dataset, jax_cache):
    common = dict(steps=20, checkpoint_every=5, min_workers=1, max_workers=2, trace_data_ids=True)
    plain = job_config(str(tmp_path), tiny_dataset, jax_cache, run_name="plain", **common)
    same = job_config(
        str(tmp_path), tiny_dataset, jax_cache, run_name="same", chaos=["crash:worker=1,step=12"], **common
    )
    moved = job_config(
        str(tmp_path), tiny_dataset, jax_cache, run_name="moved", chaos=["preempt:worker=1,step=12"], **common
    )
    for cfg in (plain, same, moved):
        assert run_job(cfg) == 0, worker_logs(cfg.run_uri)

    # The crash kept the topology; the preemption moved the job from 2 hosts to 1.
    assert [e["workers"] for e in _events(same.run_uri, "launch")] == [2, 2]
    assert [e["workers"] for e in _events(moved.run_uri, "launch")] == [2, 1]
    assert _events(same.run_uri, "restore")[0]["step"] == _newest_committed_before_failure(same.run_uri)

    a, b, c = (_final_state(cfg.run_uri, 20) for cfg in (plain, same, moved))
    import jax

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y)), "same-topology resume must be bitwise identical"
    # Across topologies the reductions run in another order: equal up to float rounding.
    worst = max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(c["params"]), strict=True)
    )
    assert worst < 1e-4, f"cross-topology resume drifted by {worst}"
    ids = [step_ids(cfg.run_uri) for cfg in (plain, same, moved)]
    assert ids[0] == ids[1] == ids[2], "the examples of every step are the same in all three runs"


def test_kill_during_async_save_restores_previous_committed_checkpoint(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="cut-save",
        steps=15,
        checkpoint_every=5,
        min_workers=2,
        max_workers=2,
        chaos=["kill_during_save:worker=0,step=10"],
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    [chaos] = _events(cfg.run_uri, "chaos")
    assert chaos["action"] == "kill_during_save" and chaos["step"] == 10
    # The save of step 10 was cut off: the job resumed from 5, never from the partial 10.
    [restore] = _events(cfg.run_uri, "restore")
    assert restore["step"] == 5
    assert api.committed_steps(cfg.run_uri) == [5, 10, 15]
    leftovers = [p for p in (tmp_path / "cut-save" / "checkpoints").iterdir() if not p.name.isdigit()]
    assert not [p for p in leftovers if "tmp" in p.name], f"partial checkpoint left behind: {leftovers}"


@pytest.mark.gcs
def test_gcs_root_survives_a_worker_kill_and_resumes_on_another_mesh(gcs_root, tiny_dataset, jax_cache):
    cfg = job_config(
        gcs_root,
        tiny_dataset,
        jax_cache,
        run_name="gcs-run",
        steps=12,
        checkpoint_every=4,
        min_workers=1,
        max_workers=2,
        chaos=["preempt:worker=1,step=10"],
    )
    assert run_job(cfg) == 0
    assert cfg.run_uri.startswith("gs://")
    [restore] = _events(cfg.run_uri, "restore")
    # Saving step 8 waited for step 4's commit, so at least step 4 is there to resume from.
    assert restore["step"] == _newest_committed_before_failure(cfg.run_uri) >= 4
    assert restore["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
    assert api.status(cfg.run_uri)["state"] == "finished"
    assert api.committed_steps(cfg.run_uri) == [4, 8, 12]
    store = open_store(cfg.run_uri)
    assert store.exists("config.json") and store.list("events/")


def test_returning_capacity_is_taken_at_the_next_checkpoint(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="grow",
        steps=25,
        checkpoint_every=5,
        min_workers=2,
        max_workers=4,
        chaos=["preempt:worker=3,step=8", "capacity:to=4,step=12"],
        trace_data_ids=True,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    assert [e["workers"] for e in _events(cfg.run_uri, "launch")] == [4, 2, 4]
    assert [(e["old_workers"], e["new_workers"]) for e in _events(cfg.run_uri, "resize")] == [(4, 2), (2, 4)]
    [rescale] = _events(cfg.run_uri, "rescale_requested")
    # The scale-up waits for a checkpoint boundary, saves there and resumes exactly from it.
    assert rescale["step"] % 5 == 0 and rescale["step"] >= 15
    assert _events(cfg.run_uri, "restore")[-1]["step"] == rescale["step"]
    assert len(_events(cfg.run_uri, "failure")) == 1, "growing is not a failure"
    _assert_exact_data_position(cfg.run_uri, tiny_dataset, cfg)


def test_below_minimum_capacity_the_agent_waits_then_goes_on(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="wait",
        steps=12,
        checkpoint_every=4,
        min_workers=2,
        max_workers=2,
        capacity_timeout_s=60,
        chaos=["preempt:worker=1,step=6"],
    )
    import threading
    import time

    def give_back_a_host() -> None:  # capacity returns while the agent waits, as an operator would do it
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = api.status(cfg.run_uri) if (tmp_path / "wait").exists() else None
            if st and st.get("state") == "waiting_for_capacity":
                api.set_capacity(cfg.run_uri, 2, reason="host repaired")
                return
            time.sleep(0.2)

    helper = threading.Thread(target=give_back_a_host, daemon=True)
    helper.start()
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    helper.join(timeout=5)
    [wait] = _events(cfg.run_uri, "waiting_for_capacity")
    assert (wait["available"], wait["min_workers"]) == (1, 2)
    assert [e["workers"] for e in _events(cfg.run_uri, "launch")] == [2, 2]
    assert api.status(cfg.run_uri)["state"] == "finished"


def test_capacity_that_never_returns_fails_the_job_clearly(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="starved",
        steps=12,
        checkpoint_every=4,
        min_workers=2,
        max_workers=2,
        capacity_timeout_s=2,
        chaos=["preempt:worker=1,step=5"],
    )
    assert run_job(cfg) == 2
    st = api.status(cfg.run_uri)
    assert st["state"] == "failed"
    assert st["reason"] == "capacity stayed below min_workers=2 for 2s (available: 1)"


def test_a_spent_failure_budget_fails_the_job_with_the_reason(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="budget",
        steps=12,
        checkpoint_every=4,
        min_workers=1,
        max_workers=1,
        max_failures=1,
        chaos=["crash:worker=0,step=3", "crash:worker=0,step=6"],
    )
    assert run_job(cfg) == 1
    st = api.status(cfg.run_uri)
    assert st["state"] == "failed"
    assert st["reason"].startswith(
        "failure budget spent: 2 failures > max_failures=1; last: worker 0 killed by signal 9"
    )
