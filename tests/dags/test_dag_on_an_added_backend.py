"""A backend added beside the engine (``tests/backend_added``, found by its entry point) runs a DAG run end to end:
the trigger's params offer it, the resolve task readies its config, the hook makes it for every task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from airflow_test_env import REPO, task_states

from training import api

pytestmark = pytest.mark.slow


def test_a_dag_run_trains_on_an_installed_backend(
    added_backend: None, airflow_db: None, run_conf: Any, stop_agents: list[str], tmp_path: Path
) -> None:
    from airflow.dag_processing.dagbag import DagBag
    from journaled_backend import read_journal

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["resilient_training"]  # parsed with it installed
    assert "journaled" in dag.params.get_param("backend").schema["enum"]
    conf = run_conf("jd", backend="journaled", steps=10, checkpoint_every=5, max_workers=2)
    run_uri = f"{conf['storage_root']}/jd"
    stop_agents.append(run_uri)
    dr = dag.test(run_conf=conf, logical_date=None)
    states = task_states(dr)
    assert dr.state == "success", states
    assert (api.status(run_uri) or {}).get("state") == "finished"
    verbs = [(e["verb"], e["by"]) for e in read_journal(run_uri)]
    assert verbs[:2] == [("provision", "Airflow"), ("launch", "Airflow")], verbs
    assert ("poll", "Airflow") in verbs and verbs[-1] == ("release", "Airflow"), verbs
    # Its preparation refuses at the resolve task, before anything is provisioned.
    refused = dag.test(run_conf=run_conf("jr", backend="journaled", max_workers=6), logical_date=None)
    assert task_states(refused)["resolve_config"][0] == "failed"
    assert not read_journal(f"{conf['storage_root']}/jr")
