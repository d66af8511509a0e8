"""A DAG run with a priority shares its storage root's pool: the service's scheduler places its job.

Real Airflow task runs (dag.test), a real scheduler process, real elastic jobs on the local slice.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from airflow_test_env import events, task_states, wait_for, xcom

from training import api
from training.service import commands
from training.service.queue import Queue

pytestmark = pytest.mark.slow


def test_a_high_priority_dag_run_takes_hosts_from_a_low_run_which_grows_back(
    dagbag: Any, run_conf: Any, stop_agents: list[str], shared: dict[str, str]
) -> None:
    """A low-priority run holds the pool's 2 hosts; a DAG run at priority high (1 host) is submitted by
    launch_job: the low run gets a notice and shrinks to 1 (no step lost), the DAG run trains, validates
    and ends, and the low run grows back to 2. The DAG run's training tasks carry its priority's weight."""
    from rtrain_airflow.hooks.training import RTrainHook

    conf = run_conf("hi", priority="high", steps=20, min_workers=1, max_workers=1)
    root = conf["storage_root"]
    stop_agents.extend([f"{root}/hi", f"{root}/bg"])
    hook = RTrainHook()
    bg = hook.build_config(
        {**conf["overrides"], "root": root, "dataset": shared["dataset"], "run_name": "bg", "steps": 2000}
        | {"min_workers": 1, "max_workers": 2, "checkpoint_every": 10}
    )
    hook.prepare_dataset("stdlib", shared["dataset"], bg.model.seq_len, conf["dataset_max_bytes"])
    try:
        commands.submit(bg, "low", pool_hosts=2)
        wait_for(
            lambda: (st := api.status(bg.run_uri) or {}).get("workers") == 2 and (st.get("step") or 0) >= 3,
            240,
            what="the low run training on the pool's 2 hosts",
        )

        dr = dagbag.dags["resilient_training"].test(run_conf=conf, logical_date=None)

        states = task_states(dr)
        assert dr.state == "success", states
        handle = xcom(dr, "training.launch_job")
        assert handle["priority"] == "high" and handle["root"] == root and not handle["attached"]
        placed = Queue(root).placement("hi")
        assert placed.ended == "finished" and placed.launches == 1 and placed.history[0][1] == 1
        assert (api.status(f"{root}/hi") or {}).get("step") == 20
        # The low run was shrunk by a notice (its step committed, nothing trained twice), and grew back.
        notices = events(bg.run_uri, "preemption_notice")
        assert notices and all(n["committed"] for n in notices), notices
        assert not events(bg.run_uri, "failure"), "a move by the scheduler is not a failure"
        hi_end = max(e["time"] for e in events(f"{root}/hi", "finished"))
        wait_for(
            lambda: [e for e in events(bg.run_uri, "resize") if e["time"] >= hi_end - 1.0 and e["new_workers"] == 2],
            120,
            what="the low run to grow back to 2 hosts",
        )
        assert [(e["old_workers"], e["new_workers"]) for e in events(bg.run_uri, "resize")] == [(2, 1), (1, 2)]
        assert all(e["steps_lost"] == 0 for e in events(bg.run_uri, "recovered"))
    finally:
        if commands.look(root, "bg").state not in commands.ENDED:
            commands.cancel(root, "bg", "the test is over")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and commands.look(root, "bg").state not in commands.ENDED:
                time.sleep(0.5)

    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as s:
        tis = s.query(TaskInstance).filter(TaskInstance.dag_id == dr.dag_id, TaskInstance.run_id == dr.run_id)
        weight = {ti.task_id: int(ti.priority_weight or 0) for ti in tis}
    assert 3000 <= weight["training.watch_job"] < 4000, weight  # high is the third level
