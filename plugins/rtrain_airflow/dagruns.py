"""The training run a DAG run names: its ``resolve_config`` task's result, else its conf."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RESOLVE_TASK_ID = "resolve_config"  # the task whose result (the RunSpec) names a DAG run's training run


def _spec_run_uri(value: Any) -> str | None:
    """The ``run_uri`` of a stored RunSpec (plain JSON; nothing is deserialized into objects)."""
    import json

    if isinstance(value, bytes | str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, dict) and "__data__" in value and "__classname__" in value:
        value = value["__data__"]
    uri = value.get("run_uri") if isinstance(value, dict) else None
    return uri if isinstance(uri, str) and uri else None


@dataclass(frozen=True)
class Target:
    """What a DAG run says of its training run."""

    name: str  # '' when it does not say (yet)
    root: str | None
    resolved: bool  # from resolve_config's result (else from the conf)
    resolve_state: str | None  # the state of its resolve_config task; None: no such task (not a training DAG)
    has_resolve: bool


def dag_run_target(dag_id: str, run_id: str) -> Target | None:
    """The training run of a DAG run, or None when the DAG run does not exist.

    The ``resolve_config`` task's result when it ran; before that, the conf's ``run_name`` and
    ``storage_root`` (a DAG run triggered with the form's defaults has none: it waits for the result).
    The stored result is read as plain JSON: nothing is deserialized into objects.
    """
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.execute(
            select(DagRun.id, DagRun.conf).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
        ).first()
        if row is None:
            return None
        resolve = session.execute(
            select(TaskInstance.state).where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == RESOLVE_TASK_ID,
                TaskInstance.map_index == -1,
            )
        ).first()
        value = session.scalar(
            select(XComModel.value).where(
                XComModel.dag_id == dag_id,
                XComModel.run_id == run_id,
                XComModel.task_id == RESOLVE_TASK_ID,
                XComModel.key == "return_value",
                XComModel.map_index == -1,
            )
        )
    state = None if resolve is None or resolve[0] is None else str(getattr(resolve[0], "value", resolve[0]))
    uri = _spec_run_uri(value)
    if uri:
        name = uri.rstrip("/").rsplit("/", 1)[-1]
        return Target(name, uri.rstrip("/")[: -len(name) - 1] or None, True, state, resolve is not None)
    given = row[1] if isinstance(row[1], dict) else {}
    given_name, given_root = given.get("run_name"), given.get("storage_root")
    return Target(
        given_name if isinstance(given_name, str) else "",
        given_root if isinstance(given_root, str) and given_root else None,
        False,
        state,
        resolve is not None,
    )
