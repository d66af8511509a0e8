"""Invalid conf is refused before anything runs, with the reason (dag.test: the same checks as a trigger)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from airflow_test_env import alerts, task_states


def test_schema_invalid_conf_creates_no_run(dagbag: Any) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match="run_name"):
        dagbag.dags["resilient_training"].test(run_conf={"run_name": "../../etc/passwd"}, logical_date=None)


def test_cross_field_invalid_conf_stops_at_the_first_task(dagbag: Any, tmp_path: Path) -> None:
    """min_workers > max_workers passes each field's schema; resolve_config refuses it, nothing else runs."""
    conf = {"run_name": "bad", "storage_root": str(tmp_path), "min_workers": 3, "max_workers": 2}
    dr = dagbag.dags["resilient_training"].test(run_conf=conf, logical_date=None)
    states = task_states(dr)
    assert dr.state == "failed"
    assert states["resolve_config"] == ("failed", 1)  # no retry: a config cannot fix itself
    ran = {t for t, (state, _) in states.items() if state == "success"}
    assert ran == {"report", "release_capacity"}  # the teardowns, which find nothing to do
    assert all(
        states[t][0] == "upstream_failed"
        for t in ("prepare_dataset", "provision_capacity", "training.launch_job", "training.watch_job", "prune")
    )
    assert not (tmp_path / "bad").exists()  # nothing was written
    [alert] = [a for a in alerts() if a["run_id"] == dr.run_id]
    assert alert["kind"] == "failure" and alert["task_id"] == "resolve_config"
    assert "min_workers (3) > max_workers (2)" in alert["reason"]


def test_continual_training_continues_from_the_newest_validated_checkpoint(dagbag: Any, tmp_path: Path) -> None:
    """The scheduled DAG's config: steps = newest validated + steps_per_run, resume_from = that step."""
    from rtrain_airflow.operators.training import RTrainResolveRunConfigOperator

    from training.checkpoint.ledger import Ledger
    from training.storage import open_store

    dag = dagbag.dags["resilient_training_continual"]
    op = dag.get_task("resolve_config")
    assert isinstance(op, RTrainResolveRunConfigOperator)
    params = {**{k: dag.params[k] for k in dag.params}, "storage_root": str(tmp_path), "steps_per_run": 15}

    fresh = op.execute({"params": params})
    assert fresh["config"]["optimizer"]["steps"] == 15 and fresh["config"]["checkpoint"]["resume_from"] == "latest"

    store = open_store(f"{tmp_path}/continual")
    store.put("config.json", b"{}")
    ledger = Ledger(store)
    for step, state in ((10, "validated"), (20, "validated"), (30, "rejected")):
        ledger.record(step, "committed")
        ledger.record(step, state, **({"metrics": {"loss": 1.0}} if state == "validated" else {"reason": "worse"}))
    later = op.execute({"params": params})
    assert later["config"]["optimizer"]["steps"] == 35 and later["config"]["checkpoint"]["resume_from"] == "20"


def test_an_unknown_priority_is_refused_at_the_trigger(dagbag: Any) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match="priority"):
        dagbag.dags["resilient_training"].test(run_conf={"priority": "top"}, logical_date=None)


def test_a_runs_priority_orders_its_training_tasks_in_airflow(dagbag: Any, tmp_path: Path) -> None:
    """The cluster policy (plugins/airflow_local_settings.py) weighs a run's tasks by its priority level."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    def weights(priority: str | None) -> dict[str, int]:
        conf = {"run_name": "w", "storage_root": str(tmp_path), "min_workers": 3, "max_workers": 2}
        dr = dagbag.dags["resilient_training"].test(run_conf={**conf, "priority": priority}, logical_date=None)
        with create_session() as s:
            tis = s.query(TaskInstance).filter(TaskInstance.dag_id == dr.dag_id, TaskInstance.run_id == dr.run_id)
            return {ti.task_id: int(ti.priority_weight or 0) for ti in tis}

    plain, low, urgent = weights(None), weights("low"), weights("urgent")
    for task in ("training.launch_job", "training.watch_job", "provision_capacity"):
        assert plain[task] < 1000, plain
        assert low[task] == 1000 + plain[task] and urgent[task] == 4000 + plain[task], (low, urgent)
    assert urgent["training.watch_job"] > low["training.launch_job"] > plain["resolve_config"]


def test_init_from_weights_that_would_not_load_fail_resolve_config_in_one_line(dagbag: Any, tmp_path: Path) -> None:
    """A truncated safetensors file is found from its header when the config is resolved, not by the job."""
    import os
    import shutil

    from airflow.sdk.exceptions import AirflowFailException

    ckpt = tmp_path / "llama3-tied"
    shutil.copytree(Path(__file__).parents[1] / "training" / "data" / "hf" / "llama3-tied", ckpt)
    os.truncate(ckpt / "model.safetensors", (ckpt / "model.safetensors").stat().st_size - 1000)
    dag = dagbag.dags["resilient_training"]
    params = {k: dag.params[k] for k in dag.params} | {"storage_root": str(tmp_path / "runs"), "init_from": str(ckpt)}
    with pytest.raises(AirflowFailException) as failed:
        dag.get_task("resolve_config").execute({"params": params})
    message = str(failed.value)
    assert message.startswith(f"invalid conf: init_from: {ckpt}/model.safetensors: truncated: tensor "), message
    assert "\n" not in message and not (tmp_path / "runs").exists()
