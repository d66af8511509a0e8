"""The trigger form of ``resilient_training`` as Airflow 3.3's form draws it from the params, and the graph.

The form (the UI's FlexibleForm) marks a field required when its schema has a ``type`` that does not allow
``null``, and blocks the trigger while a required field is empty; it shows ``description`` as plain text
when there is one, else renders ``description_md``; it groups fields by ``section`` in the order the params
come, and adds its own "Advanced Options" after them.  A cleared list or JSON field is submitted as ``null``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from test_dag_integrity import server_params

DAG_ID = "resilient_training"
SECTIONS = [
    "Run",
    "Task",
    "Data",
    "Training",
    "Checkpoints",
    "Validation",
    "Storage",
    "Backend",
    "Chaos",
    "Config overrides",
]


def form_requires(param: Any) -> bool:
    """Airflow 3.3's rule (its FlexibleForm's ``isRequired``)."""
    kind = param.schema.get("type")
    return bool(kind) and not (isinstance(kind, list) and "null" in kind)


def help_text(param: Any) -> str:
    return str(param.description or param.schema.get("description_md") or "")


@pytest.fixture
def dag(dagbag: Any) -> Any:
    return dagbag.dags[DAG_ID]


def test_only_fields_with_a_value_are_required(dagbag: Any) -> None:
    for dag_id in (DAG_ID, "resilient_training_continual"):
        params = dagbag.dags[dag_id].params
        required = {name for name, p in params.items() if form_requires(p)}
        # Required fields all have a default, so the form opens ready to trigger.
        assert all(params.get_param(name).value not in (None, "") for name in required), dag_id
        for optional in (
            "chaos",
            "gke",
            "overrides",
            "steps",
            "min_workers",
            "max_workers",
            "dataset",
            "task",
            "task_args",
        ):
            if optional in params:
                assert optional not in required, (dag_id, optional)
                assert params.get_param(optional).value is None, (dag_id, optional)


def test_a_form_with_the_optional_fields_empty_triggers_and_means_off(dag: Any, tmp_path: Path) -> None:
    """What the form submits for an untouched or cleared list/JSON field (null) passes the server's check, and
    resolve_config turns it into "off": no chaos, no gke, no overrides, the preset's values."""
    from rtrain_airflow.operators.training import RTrainResolveRunConfigOperator

    conf = {"chaos": None, "gke": None, "overrides": None, "steps": None, "storage_root": str(tmp_path)}
    params = server_params(dag).deep_merge(conf)
    values = params.validate()
    empties: list[dict[str, object]] = [{"chaos": []}, {"gke": {}}, {"overrides": {}}]
    for empty in empties:  # the REST API's and the docs' "off"
        server_params(dag).deep_merge(empty).validate()
    op = dag.get_task("resolve_config")
    assert isinstance(op, RTrainResolveRunConfigOperator)
    spec = op.execute({"params": values})
    assert (
        spec["config"]["elastic"]["chaos"] == [] and spec["gke"] == {} and spec["config"]["optimizer"]["steps"] == 40
    )  # tiny's
    assert spec["config"]["task"] == "lm" and spec["config"]["task_args"] == {}  # empty task: the built-in


def test_sections_are_ours_in_order_and_none_is_called_advanced(dagbag: Any) -> None:
    for dag in dagbag.dags.values():
        order: list[str] = []
        for _, p in dag.params.items():
            section = p.schema.get("section")
            assert section, "every field is in a section"
            if section not in order:
                order.append(section)
        assert order == SECTIONS, dag.dag_id
        assert not any("advanced" in s.lower() for s in order)


def test_every_field_is_titled_and_markdown_is_rendered(dagbag: Any) -> None:
    for dag in dagbag.dags.values():
        for name, p in dag.params.items():
            assert p.schema.get("title"), name
            md = p.schema.get("description_md")
            # Exactly one help text; the form would show a plain ``description`` as it is, backticks and all.
            assert bool(p.description) != bool(md), name
            if any(mark in help_text(p) for mark in ("`", "**", "](")):
                assert md and not p.description, f"{name}: markdown in a plain description"
    params = dagbag.dags[DAG_ID].params
    for name in (
        "run_name",
        "backend",
        "chaos",
        "overrides",
        "gke",
        "resume_from",
        "dataset_source",
        "task",
        "task_args",
    ):
        assert "`" in params.get_param(name).schema["description_md"], name


def test_empty_number_fields_say_what_each_preset_gives(dag: Any) -> None:
    """The values come from the presets' YAML (training/configs), the engine's own layering."""
    from training.config import load_config

    presets = dag.params.get_param("preset").schema["enum"]
    for name in ("steps", "min_workers", "max_workers", "checkpoint_every"):
        text = help_text(dag.params.get_param(name))
        for preset in presets:
            assert f"{preset} {getattr(load_config(preset), name)}" in text, (name, preset, text)
    assert help_text(dag.params.get_param("keep_last")).endswith(f"Empty: {load_config('tiny').checkpoint.keep_last}.")
    assert help_text(dag.params.get_param("local_checkpoint_every")).endswith("Empty: off.")


def test_local_checkpoint_every_is_a_checkpoints_field_wired_to_the_config(dag: Any, tmp_path: Path) -> None:
    p = dag.params.get_param("local_checkpoint_every")
    assert p.schema["section"] == "Checkpoints" and p.schema["type"] == ["null", "integer"]
    assert p.schema["minimum"] == 0 and p.value is None
    op = dag.get_task("resolve_config")
    base = {k: dag.params[k] for k in dag.params} | {"storage_root": str(tmp_path)}
    assert (
        op.execute({"params": {**base, "local_checkpoint_every": 5}})["config"]["checkpoint"]["local_checkpoint_every"]
        == 5
    )
    assert (
        op.execute({"params": base})["config"]["checkpoint"]["local_checkpoint_every"] == 0
    )  # empty: the preset's (off)
    with pytest.raises(Exception, match="local_checkpoint_every"):
        server_params(dag).deep_merge({"local_checkpoint_every": -1}).validate()


EXAMPLE_TASK = "examples/regression/task.py:make_task"


def test_task_and_task_args_are_task_fields_wired_to_the_config(dag: Any, tmp_path: Path) -> None:
    """A user task named by a path relative to the project resolves to that file, absolute; its args as given."""
    from rtrain_airflow.hooks.training import PROJECT_ROOT

    for name, kind in (("task", ["null", "string"]), ("task_args", ["null", "object"])):
        p = dag.params.get_param(name)
        assert p.schema["section"] == "Task" and p.schema["type"] == kind and p.value is None, name
    args = {"seed": 3, "hidden": 32}
    conf = {"task": EXAMPLE_TASK, "task_args": args, "storage_root": str(tmp_path)}
    values = server_params(dag).deep_merge(conf).validate()
    spec = dag.get_task("resolve_config").execute({"params": values})
    assert spec["config"]["task"] == f"{PROJECT_ROOT / 'examples/regression/task.py'}:make_task"
    assert spec["config"]["task_args"] == args
    with pytest.raises(Exception, match="task_args"):
        server_params(dag).deep_merge({"task_args": "hidden=3"}).validate()


def test_task_fields_are_not_also_overrides(dag: Any, tmp_path: Path) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    base = {k: dag.params[k] for k in dag.params} | {"storage_root": str(tmp_path)}
    with pytest.raises(AirflowFailException, match="task are params of their own"):
        dag.get_task("resolve_config").execute({"params": {**base, "overrides": {"task": EXAMPLE_TASK}}})


@pytest.mark.parametrize(
    ("task", "task_args", "says"),
    [
        ("nonexistent.mod:make_task", None, "cannot import nonexistent.mod"),
        (EXAMPLE_TASK, {"hiden": 3}, "unknown key 'hiden'"),
    ],
)
def test_a_task_that_cannot_be_loaded_fails_resolve_config_in_one_line(
    dag: Any, tmp_path: Path, task: str, task_args: Any, says: str
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    base = {k: dag.params[k] for k in dag.params} | {"storage_root": str(tmp_path)}
    with pytest.raises(AirflowFailException) as failed:
        dag.get_task("resolve_config").execute({"params": {**base, "task": task, "task_args": task_args}})
    message = str(failed.value)
    assert says in message and task in message and "\n" not in message, message


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("run_name", "a/b", "only letters, digits and _ . -"),
        ("run_name", "../../etc", "only letters, digits and _ . -"),
        ("run_name", "x..y", "no '..' anywhere"),
        ("run_name", "-x", "the first character is a letter or a digit"),
        ("chaos", ["explode:worker=1,step=3"], "an action (one of these) and a colon"),
        ("chaos", ["explode:worker=1,step=3"], "capacity|corrupt|crash|"),
        ("chaos", ["preempt:worker"], "then key=number pairs: worker=1,step=40"),
    ],
)
def test_a_refused_value_is_named_with_the_rule_in_words(dag: Any, name: str, value: Any, says: str) -> None:
    """What the REST API (and the form, on submit) answers: the field, and what it allows, not one regex."""
    from airflow.sdk.exceptions import ParamValidationError
    from rtrain_airflow.hooks.training import CHAOS_PATTERN, RUN_NAME_PATTERN

    with pytest.raises(ParamValidationError) as refused:
        server_params(dag).deep_merge({name: value}).validate()
    message = str(refused.value)
    assert message.startswith(f"Invalid input for param {name}: ") and says in message, message
    assert RUN_NAME_PATTERN not in message and CHAOS_PATTERN not in message


NAMES = ["demo", "exp-1.v2_a", "a", "A" * 63, "A" * 64, "", "-x", "_x", ".x", "x..y", "a/b", "a b", "é", "x.", "9"]
SPECS = [
    "preempt:worker=1,step=40",
    "capacity:to=4,step=80",
    "lr_spike:step=30,factor=50.5",
    "explode:now",
    "preempt:worker",
    "preempt:worker=1,",
    "preempt:",
    "Preempt:worker=1",
    "preempt:worker=a",
    "nan:step=3,repeat=1",
    " crash:worker=0,step=1",
]


def test_the_worded_rules_accept_exactly_what_the_engines_patterns_accept() -> None:
    import jsonschema
    from rtrain_airflow.hooks.training import CHAOS_PATTERN, CHAOS_RULES, RUN_NAME_PATTERN, RUN_NAME_RULES

    def ok(value: str, schema: dict[str, Any]) -> bool:
        return jsonschema.Draft202012Validator(schema).is_valid(value)

    for name in NAMES:
        assert ok(name, {"type": "string", **RUN_NAME_RULES}) == bool(re.search(RUN_NAME_PATTERN, name)), name
    for spec in SPECS:
        assert ok(spec, CHAOS_RULES) == bool(re.search(CHAOS_PATTERN, spec)), spec


def test_the_graph_draws_the_pipeline_not_the_spec(dagbag: Any) -> None:
    """Every task reads the spec from resolve_config's XCom when it runs: no data edge from resolve_config."""
    expected = {
        "resolve_config": set(),
        "prepare_dataset": {"resolve_config"},
        "provision_capacity": {"prepare_dataset"},
        "training.plan_topology": {"provision_capacity"},
        "training.launch_job": {"training.plan_topology"},
        "training.watch_job": {"training.launch_job"},
        "validate": {"training.watch_job"},
        "promote_or_rollback": {"validate"},
        "promote": {"promote_or_rollback"},
        "rollback_and_resume": {"promote_or_rollback"},
        "prune": {"promote", "rollback_and_resume"},
        "export": {"promote", "rollback_and_resume"},  # skipped unless export_format and export_dir are set
        "report": {"prune", "export", "provision_capacity"},  # provision_capacity: its setup
        "release_capacity": {"report", "provision_capacity"},
    }
    for dag in dagbag.dags.values():
        assert {t.task_id: set(t.upstream_task_ids) for t in dag.tasks} == expected, dag.dag_id
        assert dag.get_task("resolve_config").downstream_task_ids == {"prepare_dataset"}
        for task in dag.tasks:
            if task.task_id != "resolve_config" and hasattr(task, "spec_from"):
                assert task.spec_from == "resolve_config" and task.spec is None, task.task_id


def test_config_fields_of_the_form_take_type_bounds_and_help_from_the_config(dag: Any) -> None:
    """A form field of a config key is made from the config's field: a new one is a line in ``CONFIG_FIELDS``."""
    import importlib.util

    from rtrain_airflow.form import config_param

    from training.config import key_schema

    spec = importlib.util.spec_from_file_location("dag_file", dag.fileloc)
    assert spec is not None and spec.loader is not None
    dag_file = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dag_file)
    keys = [key for _, key, _ in dag_file.CONFIG_FIELDS] + ["optimizer.steps"]
    for key in keys:
        param, field = dag.params.get_param(key.rpartition(".")[2]), key_schema(key)
        assert help_text(param).startswith(field["description"]), key
        for bound in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            assert param.schema.get(bound) == field.get(bound), (key, bound)
        assert param.schema["type"] == ["null", field["type"]], key
    # A config key the form has no field for yet becomes one with its checks, and one that is not a key is refused.
    lr = config_param("learning_rate", "Peak learning rate", "Training", ("tiny",))
    assert lr.schema["exclusiveMinimum"] == 0 and "Above 0." in help_text(lr)
    with pytest.raises(Exception, match="minimum of 0"):
        lr.resolve(-1.0)
    opt = config_param("optimizer", "Optimizer", "Training", ("tiny", "small"))
    assert opt.schema["enum"][0] is None and "adamw" in opt.schema["enum"]
    opt.resolve(None)
    with pytest.raises(KeyError, match="no_such_key"):
        config_param("no_such_key", "X", "Training", ("tiny",))


def test_a_form_field_out_of_the_configs_bounds_is_refused_by_the_server(dag: Any) -> None:
    from training.config import key_schema

    hi = key_schema("elastic.max_workers")["maximum"]
    server_params(dag).deep_merge({"max_workers": hi}).validate()
    with pytest.raises(Exception, match="max_workers"):
        server_params(dag).deep_merge({"max_workers": hi + 1}).validate()


@pytest.mark.parametrize(
    ("bounds", "says"),
    [
        ({"minimum": 1, "maximum": 1_000_000}, "1 to 1,000,000."),
        ({"minimum": 0}, "At least 0."),
        ({"exclusiveMinimum": 0}, "Above 0."),
        ({"maximum": 10}, "At most 10."),
        ({"exclusiveMinimum": 0, "maximum": 10}, "Above 0, at most 10."),
        ({"minimum": 0, "exclusiveMaximum": 1}, "At least 0, below 1."),
        ({}, ""),
    ],
)
def test_a_fields_bounds_in_words_keep_both_ends(bounds: dict[str, Any], says: str) -> None:
    from rtrain_airflow.form import range_text

    assert range_text(bounds) == says
