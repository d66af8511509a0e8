"""When the job is gone beyond what its agent absorbs, Airflow takes over: the sensor's retry relaunches
from the newest committed checkpoint; a failed DAG run is rerun by clearing the training group or by
triggering again with ``resume_from`` and overrides.  All with dag.test() and real jobs."""

from __future__ import annotations

from typing import Any

import pytest
from airflow_test_env import alerts, clear_tasks, dag_test_beside, drive, events, task_states, wait_for, xcom

from training.api import Event, set_capacity, status

pytestmark = pytest.mark.slow

# The job needs both hosts (min_workers=2) and loses one at step 14: the agent finds 1 < 2 hosts,
# waits capacity_timeout_s and gives up ("capacity below the minimum past a timeout").  Checkpoint
# 10 is committed by then (synchronous saves).
LOSE_A_HOST = {"min_workers": 2, "max_workers": 2, "chaos": ["preempt:worker=1,step=14"]}
FAST_FAIL = {"async_checkpoint": False, "capacity_timeout_s": 3}


def launches_after(run_uri: str, t: float) -> list[Event]:
    return [e for e in events(run_uri, "launch") if e["time"] > t]


def first_restore_after(run_uri: str, t: float) -> Event:
    return next(e for e in events(run_uri, "restore", "init") if e["time"] > t)


def test_sensor_retry_relaunches_from_the_newest_committed_checkpoint(
    dagbag: Any, run_conf: Any, stop_agents: list[str]
) -> None:
    """Try 1 of watch_job fails with the job; capacity comes back; try 2 relaunches and the run ends well.
    While the first job lives, a second writer is refused (the run lock) and a second launch re-attaches."""
    dag = dagbag.dags["resilient_training"]
    # The agent waits 8 s for capacity: the window in which the checks below talk to it.
    conf = run_conf("retry", **LOSE_A_HOST, overrides={**FAST_FAIL, "capacity_timeout_s": 8})
    run_uri = f"{conf['storage_root']}/retry"
    stop_agents.append(run_uri)

    def operator_at_the_console(seen: dict[str, Any]) -> None:
        st = wait_for(
            lambda: (status(run_uri) or {}).get("state") == "waiting_for_capacity" and status(run_uri),
            240,
            what="the job waiting for capacity",
        )
        # One job per run: a second job is refused by the lock (naming the holder), a relaunch re-attaches.
        from training.api import LaunchRefused, load_run_config
        from training.backends import JobSpec, LocalSliceBackend
        from training.backends.local import launch

        try:
            launch(load_run_config(run_uri))
        except LaunchRefused as e:
            seen["second_job_refused"] = str(e)
        seen["relaunch"] = LocalSliceBackend().launch(JobSpec.local(load_run_config(run_uri)), attempt=1)
        seen["first_job"] = st["job"]
        wait_for(lambda: events(run_uri, "failed"), 240, what="the job giving up")
        seen["capacity_back_at"] = __import__("time").time()
        set_capacity(run_uri, 2, reason="test: hosts are back")

    dr, seen = dag_test_beside(dag, conf, operator_at_the_console)

    states = task_states(dr)
    assert dr.state == "success", states
    assert states["training.watch_job"] == ("success", 2)  # failed once, relaunched by its retry
    assert states["training.launch_job"] == ("success", 1)
    assert f"of job {seen['first_job']}" in seen["second_job_refused"]
    assert seen["relaunch"]["attached"] and seen["relaunch"]["job"] == seen["first_job"]

    [failed] = events(run_uri, "failed")
    assert "capacity stayed below min_workers" in failed["reason"]
    relaunched = launches_after(run_uri, failed["time"])
    assert relaunched, "the retry did not relaunch the job"
    assert first_restore_after(run_uri, failed["time"])["step"] == 10
    assert status(run_uri)["state"] == "finished" and status(run_uri)["step"] == 20
    kinds = [(a["kind"], a["task_id"]) for a in alerts() if a["run_id"] == dr.run_id]
    assert ("retry", "training.watch_job") in kinds and not [k for k in kinds if k[0] == "failure"]
    print(
        f"\nrelaunch by the sensor's retry: capacity back -> training again in "
        f"{next(e for e in events(run_uri, 'resumed') if e['time'] > failed['time'])['time'] - seen['capacity_back_at']:.1f}s"
    )


def fail_a_run(dag: Any, conf: dict[str, Any]) -> Any:
    """A DAG run whose job loses a host for good: all three tries of watch_job fail."""
    dr = dag.test(run_conf=conf, logical_date=None)
    states = task_states(dr)
    assert dr.state == "failed", states
    assert states["training.watch_job"] == ("failed", 3)
    assert states["validate"][0] == "upstream_failed"
    assert states["release_capacity"][0] == "success"  # the teardown ran anyway
    assert states["report"][0] == "success"
    failed = events(conf["storage_root"] + "/" + conf["run_name"], "failed")
    assert len(failed) == 3 and all("capacity stayed below" in e["reason"] for e in failed)
    return dr


@pytest.mark.extended
def test_failed_run_then_trigger_with_resume_from_and_overrides(
    dagbag: Any, run_conf: Any, stop_agents: list[str]
) -> None:
    dag = dagbag.dags["resilient_training"]
    conf = run_conf("rerun", **LOSE_A_HOST, overrides=FAST_FAIL)
    run_uri = f"{conf['storage_root']}/rerun"
    stop_agents.append(run_uri)
    failed_run = fail_a_run(dag, conf)
    assert [a["kind"] for a in alerts() if a["run_id"] == failed_run.run_id].count("failure") >= 1
    t_rerun = events(run_uri, "failed")[-1]["time"]

    # The documented parameterised rerun: same run_name, resume_from=latest, overrides (more steps, no chaos).
    rerun = run_conf(
        "rerun",
        resume_from="latest",
        chaos=[],
        steps=30,
        min_workers=1,
        max_workers=2,
        overrides={"async_checkpoint": False},
    )
    dr = dag.test(run_conf=rerun, logical_date=None)
    assert dr.state == "success", task_states(dr)
    assert first_restore_after(run_uri, t_rerun)["step"] == 10  # the newest committed, not scratch
    assert [e["type"] for e in events(run_uri, "init", "restore")].count("init") == 1  # scratch only once, ever
    assert status(run_uri)["step"] == 30
    assert xcom(dr, "validate")["step"] == 30 and xcom(dr, "promote")["step"] == 30


@pytest.mark.extended
def test_failed_run_then_clear_the_training_group(dagbag: Any, run_conf: Any, stop_agents: list[str]) -> None:
    dag = dagbag.dags["resilient_training"]
    conf = run_conf("cleared", **LOSE_A_HOST, overrides=FAST_FAIL)
    run_uri = f"{conf['storage_root']}/cleared"
    stop_agents.append(run_uri)
    dr = fail_a_run(dag, conf)
    t_clear = events(run_uri, "failed")[-1]["time"]

    # What "Clear" on the training group does in the UI (downstream included): the group, everything
    # after it, and the setup/teardown that belong to it; not resolve_config or prepare_dataset.
    cleared = clear_tasks(
        dag.dag_id, dr.run_id, ["training.plan_topology", "training.launch_job", "training.watch_job"]
    )
    assert {"training.launch_job", "training.watch_job", "validate", "prune", "release_capacity"} <= set(cleared)
    assert "resolve_config" not in cleared and "prepare_dataset" not in cleared
    dr = drive(dag, dr.run_id)

    assert dr.state == "success", task_states(dr)
    assert first_restore_after(run_uri, t_clear)["step"] == 10
    assert status(run_uri)["state"] == "finished" and status(run_uri)["step"] == 20
    assert xcom(dr, "promote")["step"] == 20
