"""A person's stop in Airflow's terms: the watch is skipped, not failed; validation and promotion after it are
skipped, the teardown runs, the DAG run succeeds, no failure alert goes out; a new DAG run of the same run
resumes from its newest committed checkpoint.  With dag.test() and real jobs."""

from __future__ import annotations

from typing import Any

import pytest
from airflow_test_env import alerts, dag_test_beside, events, task_states, wait_for

from training import api

pytestmark = pytest.mark.slow


def stopped_dag_run(dag: Any, conf: dict[str, Any], run_uri: str) -> Any:
    """A DAG run whose job a person stops after its first commit: checked as Airflow shows it."""

    def stop_after_a_commit(seen: dict[str, Any]) -> None:
        """As a person at the console would: once a checkpoint is committed, ``rtrain stop`` the run."""
        wait_for(lambda: api.committed_steps(run_uri), 300, what="a committed checkpoint")
        api.stop_job(run_uri, "stopped by the test's operator")

    dr, _seen = dag_test_beside(dag, conf, stop_after_a_commit)

    states = task_states(dr)
    assert dr.state == "success", states
    assert states["training.watch_job"] == ("skipped", 1), "a stop is not retried"
    for task in ("validate", "promote_or_rollback", "promote", "rollback_and_resume", "prune"):
        assert states[task][0] == "skipped", (task, states)
    assert states["report"][0] == states["release_capacity"][0] == "success", states
    st = api.status(run_uri) or {}
    assert (st.get("state"), st.get("reason")) == ("stopped", "stopped by the test's operator")
    assert not events(run_uri, "failed")
    assert not [a for a in alerts() if a["run_id"] == dr.run_id and a["kind"] in ("failure", "retry")]
    return dr


def test_a_stopped_run_skips_its_watch_and_what_needs_a_trained_run(
    dagbag: Any, run_conf: Any, stop_agents: list[str]
) -> None:
    conf = run_conf("halt", steps=2000)
    stop_agents.append(f"{conf['storage_root']}/halt")
    stopped_dag_run(dagbag.dags["resilient_training"], conf, f"{conf['storage_root']}/halt")


@pytest.mark.extended
def test_a_new_dag_run_of_a_stopped_run_resumes_it(dagbag: Any, run_conf: Any, stop_agents: list[str]) -> None:
    dag = dagbag.dags["resilient_training"]
    conf = run_conf("resumed", steps=2000)
    run_uri = f"{conf['storage_root']}/resumed"
    stop_agents.append(run_uri)
    stopped_dag_run(dag, conf, run_uri)
    # A new DAG run of the same run resumes from the newest committed checkpoint and finishes.
    committed = max(api.committed_steps(run_uri))
    again = dag.test(run_conf={**conf, "steps": committed + 10}, logical_date=None)
    assert again.state == "success", task_states(again)
    [stopped] = events(run_uri, "stopped")
    restore = next(e for e in events(run_uri, "restore", "init") if e["time"] > stopped["time"])
    assert (restore["type"], restore["step"]) == ("restore", committed)
    assert (api.status(run_uri) or {}).get("state") == "finished"
