"""Airflow's local settings for this project: the pipeline's cluster policy.

Airflow imports this module (the plugins folder is on its path) and calls
``task_instance_mutation_hook`` for every task instance it creates or refreshes.
A deployment with local settings of its own calls ``prioritize`` from its hook.
"""

from __future__ import annotations

from typing import Any

from rtrain_airflow.policy import prioritize


def task_instance_mutation_hook(task_instance: Any, dag_run: Any = None) -> None:
    prioritize(task_instance, dag_run)
