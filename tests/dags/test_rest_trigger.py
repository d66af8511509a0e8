"""The REST API refuses a trigger with invalid conf, with the reason, and creates no DAG run.

Against a real ``airflow api-server`` started here on 127.0.0.1 (a free port, one worker), with
bounded waits, and always stopped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from airflow_test_env import api_server

DAG_ID = "resilient_training"


@pytest.fixture(scope="module")
def api(airflow_db: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with api_server(tmp_path_factory.mktemp("api")) as server:
        yield {"base": server.base, "headers": server.headers}


def trigger(api: dict[str, Any], conf: dict[str, Any]) -> requests.Response:
    return requests.post(
        f"{api['base']}/api/v2/dags/{DAG_ID}/dagRuns",
        headers=api["headers"],
        json={"logical_date": None, "conf": conf},
        timeout=30,
    )


def runs(api: dict[str, Any]) -> list[dict[str, Any]]:
    r = requests.get(f"{api['base']}/api/v2/dags/{DAG_ID}/dagRuns", headers=api["headers"], timeout=30)
    r.raise_for_status()
    return list(r.json()["dag_runs"])


@pytest.mark.parametrize(
    ("conf", "reason"),
    [
        ({"run_name": "../../etc"}, "run_name"),
        ({"run_name": "a/b"}, "run_name"),
        ({"steps": -5}, "steps"),
        ({"max_workers": "four"}, "max_workers"),
        ({"backend": "slurm"}, "backend"),
        ({"resume_from": "yesterday"}, "resume_from"),
        ({"chaos": ["explode:now"]}, "chaos"),
        ({"task_args": "hidden=3"}, "task_args"),
        ({"task": ""}, "task"),
    ],
)
def test_invalid_conf_is_refused_with_the_reason(api: dict[str, Any], conf: dict[str, Any], reason: str) -> None:
    before = len(runs(api))
    r = trigger(api, conf)
    assert r.status_code == 400, r.text
    assert reason in r.json()["detail"]
    assert len(runs(api)) == before  # nothing was created, so nothing runs


def test_valid_conf_is_accepted_and_the_plugin_api_is_mounted(api: dict[str, Any]) -> None:
    r = trigger(
        api,
        {
            "run_name": "rest-ok",
            "steps": 20,
            "resume_from": "latest",
            "chaos": ["preempt:worker=1,step=12"],
            "overrides": {"learning_rate": 0.001},
            "task": "examples/regression/task.py:make_task",
            "task_args": {"hidden": 32},
        },
    )
    assert r.status_code == 200, r.text
    run = r.json()
    assert run["conf"]["run_name"] == "rest-ok" and run["state"] == "queued"
    assert run["conf"]["task_args"] == {"hidden": 32}
    # No scheduler runs here: remove the run so it never starts.
    d = requests.delete(
        f"{api['base']}/api/v2/dags/{DAG_ID}/dagRuns/{run['dag_run_id']}", headers=api["headers"], timeout=30
    )
    assert d.status_code == 204
    # The rtrain plugin's read-only run API, served by the same server.
    url = f"{api['base']}/rtrain/runs/no-such-run-{time.time_ns()}/status"
    assert requests.get(url, timeout=30).status_code == 401  # the plugin's API is behind Airflow's login
    missing = requests.get(url, headers=api["headers"], timeout=30)
    assert missing.status_code == 404 and "no run" in missing.text
