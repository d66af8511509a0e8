"""DAG integrity over the whole DagBag (Astronomer's template, and more): everything that must hold
for every DAG file, checked without running a task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import jsonschema
import pytest
from airflow_test_env import REPO

HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "grain", "tensorstore", "array_record")


def test_no_import_errors_and_the_expected_dags(dagbag: Any) -> None:
    assert dagbag.import_errors == {}
    assert {"resilient_training", "resilient_training_continual"} <= set(dagbag.dags)


def test_no_cycles(dagbag: Any) -> None:
    from airflow.utils.dag_cycle_tester import check_cycle

    for dag in dagbag.dags.values():
        check_cycle(dag)  # raises AirflowDagCycleException


def test_every_dag_is_tagged_and_owned(dagbag: Any) -> None:
    for dag_id, dag in dagbag.dags.items():
        assert dag.tags and "rtrain" in dag.tags, dag_id
        assert dag.doc_md, dag_id
        for task in dag.tasks:
            assert task.owner == "rtrain", task.task_id


def test_the_training_group_retries_at_least_twice(dagbag: Any) -> None:
    for dag in dagbag.dags.values():
        group = dag.task_group_dict["training"]
        tasks = list(group.iter_tasks())
        assert {t.task_id for t in tasks} == {"training.plan_topology", "training.launch_job", "training.watch_job"}
        for task in tasks:
            assert task.retries >= 2, task.task_id
            assert task.on_retry_callback and task.on_failure_callback, task.task_id
        assert dag.get_task("rollback_and_resume").retries >= 2


def test_setup_body_teardown_shape(dagbag: Any) -> None:
    from airflow.sdk import TriggerRule

    for dag in dagbag.dags.values():
        assert dag.get_task("provision_capacity").is_setup
        for tid in ("report", "release_capacity"):
            task = dag.get_task(tid)
            assert task.is_teardown and task.trigger_rule == TriggerRule.ALL_DONE, tid
        assert dag.get_task("prune").trigger_rule == TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS
        order = [t.task_id for t in dag.topological_sort()]
        chain = [
            "resolve_config",
            "prepare_dataset",
            "provision_capacity",
            "training.plan_topology",
            "training.launch_job",
            "training.watch_job",
            "validate",
            "promote_or_rollback",
            "prune",
            "report",
            "release_capacity",
        ]
        assert [t for t in order if t in chain] == chain
        assert set(dag.get_task("promote_or_rollback").downstream_task_ids) == {"promote", "rollback_and_resume"}


def test_scheduled_dag_continues_one_run_at_a_time(dagbag: Any) -> None:
    dag = dagbag.dags["resilient_training_continual"]
    assert dag.catchup is False and dag.max_active_runs == 1
    assert type(dag.timetable).__name__ == "CronTriggerTimetable"
    assert "steps_per_run" in dag.params and "resume_from" not in dag.params
    assert dag.get_task("resolve_config").continual is True
    assert dagbag.dags["resilient_training"].max_active_runs == 4  # runs with a priority share the pool


def test_params_are_valid_json_schemas_with_help_texts(dagbag: Any) -> None:
    for dag in dagbag.dags.values():
        for name, param in dag.params.items():
            schema = param.schema
            jsonschema.Draft202012Validator.check_schema(schema)
            text = param.description or schema.get("description_md") or ""
            assert len(text) > 15, name
            assert "type" in schema, name
            jsonschema.validate(param.value, schema)  # the default is valid
            json.dumps(param.value)


def test_preset_enum_matches_the_presets_on_disk(dagbag: Any) -> None:
    from training.config import preset_names

    assert sorted(dagbag.dags["resilient_training"].params.get_param("preset").schema["enum"]) == preset_names()


def server_params(dag: Any) -> Any:
    """The params as the API server holds them (the serialized DAG), where a trigger's conf is checked."""
    from airflow.serialization.serialized_objects import DagSerialization

    return DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag)).params


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("run_name", "../etc"),
        ("run_name", "a/b"),
        ("run_name", "x..y"),
        ("run_name", ""),
        ("steps", 0),
        ("steps", "ten"),
        ("max_workers", 0),
        ("preset", "gpt5"),
        ("backend", "slurm"),
        ("resume_from", "yesterday"),
        ("chaos", ["explode:now"]),
        ("val_min_accuracy", 2.0),
        ("task", ""),
        ("task", 3),
        ("task_args", "hidden=3"),
        ("task_args", [1, 2]),
    ],
)
def test_params_refuse_bad_values(dagbag: Any, name: str, value: Any) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    params = server_params(dagbag.dags["resilient_training"]).deep_merge({name: value})
    with pytest.raises(ParamValidationError):
        params.validate()


def test_params_accept_the_documented_values(dagbag: Any) -> None:
    good = {
        "run_name": "exp-1.v2_a",
        "steps": 60,
        "resume_from": "40",
        "max_workers": 4,
        "chaos": ["preempt:worker=1,step=40", "capacity:to=4,step=80"],
        "overrides": {"learning_rate": 0.001},
        "task": "examples/regression/task.py:make_task",
        "task_args": {"hidden": 32, "noise": 0.2},
    }
    params = server_params(dagbag.dags["resilient_training"])
    params.deep_merge(good).validate()
    params.deep_merge({"resume_from": "none"}).validate()


PARSE = r"""
import json, sys, time
from airflow.dag_processing.dagbag import DagBag
t = time.perf_counter()
bag = DagBag(dag_folder=sys.argv[1])
took = time.perf_counter() - t
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2].split(",")))
stats = {s.file: s.duration.total_seconds() for s in bag.dagbag_stats}
print(json.dumps({"errors": {str(k): v for k, v in bag.import_errors.items()}, "heavy": heavy, "stats": stats,
                  "took": took, "dags": sorted(bag.dags)}))
"""


def test_parsing_imports_no_heavy_ml_module_and_is_fast() -> None:
    """In a fresh interpreter: parse the dags folder, then look at sys.modules."""
    out = subprocess.run(
        [sys.executable, "-c", PARSE, str(REPO / "dags"), ",".join(HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}
    assert result["heavy"] == [], f"parsing imported {result['heavy']}"
    assert result["dags"] == ["resilient_training", "resilient_training_continual"]
    for file, seconds in result["stats"].items():
        print(f"parse time {file}: {seconds * 1000:.0f} ms")
        assert seconds < 2.0, file


def test_the_priority_field_offers_the_services_levels(dagbag: Any) -> None:
    from training.priorities import PRIORITIES

    for dag in dagbag.dags.values():
        schema = dag.params.get_param("priority").schema
        assert schema["enum"] == [None, *PRIORITIES] and dag.params["priority"] is None  # empty: no shared pool
