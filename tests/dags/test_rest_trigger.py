"""The REST API refuses a trigger with invalid conf, with the reason, and creates no DAG run.

Against a real ``airflow api-server`` started here on 127.0.0.1 (a free port, one worker), with
bounded waits, and always stopped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from airflow_test_env import wait_for
from processes import stop_process_group

DAG_ID = "resilient_training"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def api(airflow_db: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    home = Path(os.environ["AIRFLOW_HOME"])
    exe = str(Path(sys.executable).parent / "airflow")
    passwords = home / "passwords.json"
    password = os.urandom(8).hex()
    passwords.write_text(json.dumps({"admin": password}))
    env = {
        **os.environ,
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
    }
    # The API server serves DAGs from the metadata DB: serialize ours first (what the DAG processor does).
    subprocess.run([exe, "dags", "reserialize"], env=env, check=True, capture_output=True, timeout=180)
    port = free_port()
    log = open(tmp_path_factory.mktemp("api") / "api-server.log", "wb")
    proc = subprocess.Popen(
        [exe, "api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the API server exited with {proc.returncode}; see {log.name}")
            try:
                return requests.get(f"{base}/api/v2/monitor/health", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_for(up, 120, interval=0.5, what="the API server")
        token = requests.post(
            f"{base}/auth/token", json={"username": "admin", "password": password}, timeout=10
        ).json()["access_token"]
        yield {"base": base, "headers": {"Authorization": f"Bearer {token}"}}
    finally:
        stop_process_group(proc)  # the API server and its workers
        log.close()


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
