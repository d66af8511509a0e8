"""The cluster policy of the pipeline: a run's priority also orders its tasks in Airflow's queues.

A DAG run triggered with ``priority`` (``low`` .. ``urgent``) gets the tasks of this
plugin's operators ahead of lower runs' when worker or pool slots are short: their
``priority_weight`` becomes ``rank * WEIGHT_STEP`` plus the task's own weight (its
place in the DAG). Loaded by Airflow through ``airflow_local_settings`` (plugins/).
"""

from __future__ import annotations

from typing import Any

from training.priorities import PRIORITIES

WEIGHT_STEP = 1000  # a DAG's own weights (downstream task counts) stay below this
RANKS = {name: rank for rank, name in enumerate(PRIORITIES, 1)}  # low 1 .. urgent 4


def run_priority(dag_run: Any) -> str | None:
    """The priority level a DAG run was triggered with, or None (none, or not one of the levels)."""
    conf = getattr(dag_run, "conf", None)
    level = conf.get("priority") if isinstance(conf, dict) else None
    return level if isinstance(level, str) and level in RANKS else None  # any other DAG's conf may hold anything


def prioritize(task_instance: Any, dag_run: Any) -> None:
    """Weigh a training task by its run's priority; any other task, or a run without one, is left as it is."""
    if not str(getattr(task_instance, "operator", "") or "").startswith("RTrain"):
        return
    level = run_priority(dag_run)
    if level is None:
        return
    own = int(task_instance.priority_weight or 0) % WEIGHT_STEP  # idempotent: Airflow applies policies repeatedly
    task_instance.priority_weight = RANKS[level] * WEIGHT_STEP + own
