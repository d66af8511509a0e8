"""A throwaway Airflow for the tests: its own AIRFLOW_HOME (SQLite), this repo's dags/ and plugins/.

Airflow reads its configuration once, when ``airflow`` is first imported, so
:func:`configure` must run before that: the conftests of tests/dags and
tests/plugins call it when they are imported, before any test module is
collected.  It is idempotent (a second call keeps the first home).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.api import Event

REPO = Path(__file__).resolve().parents[2]
MARK = "RTRAIN_TEST_AIRFLOW_HOME"


def configure() -> Path:
    if os.environ.get(MARK):
        return Path(os.environ[MARK])
    if "airflow.configuration" in sys.modules:
        raise RuntimeError("airflow was imported before the test Airflow home was configured")
    home = Path(tempfile.mkdtemp(prefix="rtrain-airflow-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    os.environ.update(
        {
            MARK: str(home),
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            # A failed training task is retried (the job relaunched) after 1 s, not 30.
            "RTRAIN_RETRY_DELAY_S": "1",
            "RTRAIN_ALERTS_FILE": str(home / "alerts.jsonl"),
        }
    )
    if str(REPO / "plugins") not in sys.path:
        sys.path.insert(0, str(REPO / "plugins"))
    return home


_migrated = False


def migrate() -> None:
    """``airflow db migrate`` once per session (a few seconds)."""
    global _migrated
    if _migrated:
        return
    exe = Path(sys.executable).parent / "airflow"
    subprocess.run([str(exe), "db", "migrate"], check=True, capture_output=True, timeout=300, env=os.environ.copy())
    _migrated = True


def alerts() -> list[dict[str, Any]]:
    import json

    path = Path(os.environ["RTRAIN_ALERTS_FILE"])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate: Any, timeout: float, interval: float = 0.2, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not met within {timeout}s")


def task_states(dr: Any) -> dict[str, tuple[str | None, int]]:
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as s:
        tis = s.query(TaskInstance).filter(TaskInstance.dag_id == dr.dag_id, TaskInstance.run_id == dr.run_id).all()
        return {ti.task_id: (getattr(ti.state, "value", ti.state), ti.try_number) for ti in tis}


def xcom(dr: Any, task_id: str, key: str = "return_value") -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as s:
        row = (
            s.query(XComModel)
            .filter(
                XComModel.dag_id == dr.dag_id,
                XComModel.run_id == dr.run_id,
                XComModel.task_id == task_id,
                XComModel.key == key,
            )
            .one_or_none()
        )
        if row is None:
            return None
        return XComModel.deserialize_value(row)


def events(run_uri: str, *types: str) -> list[Event]:
    from training.api import events as read

    return read(run_uri, types or None)


def clear_tasks(dag_id: str, run_id: str, task_ids: list[str]) -> list[str]:
    """Clear tasks of a finished DAG run with their downstream, as the UI's "Clear" (downstream on) does.

    The same calls as the REST endpoint ``clearTaskInstances``: the relevant relatives
    (downstream, with the setups and teardowns that belong to them), ``dag.clear`` and
    ``clear_task_instances`` (which re-queues the DAG run).  Returns the cleared task ids.
    """
    from airflow.models.dagbag import DBDagBag
    from airflow.models.taskinstance import clear_task_instances, find_relevant_relatives
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState

    with create_session() as session:
        sdag = DBDagBag().get_latest_version_of_dag(dag_id, session=session)
        ids: set[str] = set(task_ids)
        relatives = find_relevant_relatives(ids, [], direction="downstream", dag=sdag, run_id=run_id, session=session)
        ids.update(t for t in relatives if not isinstance(t, tuple))
        tis = sdag.clear(dry_run=True, task_ids=sorted(ids), run_id=run_id, session=session)
        clear_task_instances(list(tis), session, DagRunState.QUEUED)
        return sorted(ti.task_id for ti in tis)


def drive(dag: Any, run_id: str) -> Any:
    """Run a queued DAG run to its end in this process: ``dag.test()``'s own loop, for an existing run.

    (``dag.test()`` always clears every task of the run first; a cleared group must run alone.)
    """
    from airflow.models.dagbag import DBDagBag
    from airflow.models.dagrun import DagRun
    from airflow.sdk.definitions.dag import _run_task
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState
    from sqlalchemy import select

    with create_session() as session:
        dr = session.scalar(select(DagRun).where(DagRun.dag_id == dag.dag_id, DagRun.run_id == run_id))
        dr.dag = DBDagBag().get_dag_for_run(dr, session=session)
        dr.state = DagRunState.RUNNING
        session.commit()
        while dr.state == DagRunState.RUNNING:
            session.expire_all()
            schedulable, _ = dr.update_state(session=session)
            for ti in schedulable:
                if ti.state != TaskInstanceState.UP_FOR_RESCHEDULE:
                    ti.try_number += 1
                ti.state = TaskInstanceState.SCHEDULED
            session.commit()
            scheduled = [ti for ti in dr.get_task_instances(session=session) if ti.state == TaskInstanceState.SCHEDULED]
            if not scheduled:
                time.sleep(0.5)
            for ti in scheduled:
                _run_task(ti=ti, task=dag.task_dict[ti.task_id], run_triggerer=True)
        return dr


@dataclass(frozen=True)
class APIServer:
    """A running ``airflow api-server`` on 127.0.0.1: its URL, an admin's JWT, its log file."""

    base: str
    token: str
    log: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@contextlib.contextmanager
def api_server(log_dir: Path, env: Mapping[str, str] | None = None) -> Iterator[APIServer]:
    """A real ``airflow api-server`` (one worker, a free port) with one admin, this repo's DAGs serialized first
    (it serves DAGs from the metadata DB); ``env`` is added to its environment.  Always stopped, workers and all."""
    import requests
    from processes import stop_process_group

    from tests.conftest import free_port

    exe = str(Path(sys.executable).parent / "airflow")
    passwords = log_dir / "passwords.json"
    password = os.urandom(8).hex()
    passwords.write_text(json.dumps({"admin": password}))
    env = {
        **os.environ,
        **(env or {}),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
    }
    subprocess.run([exe, "dags", "reserialize"], env=env, check=True, capture_output=True, timeout=180)
    port = free_port()
    log = open(log_dir / "api-server.log", "wb")
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
        yield APIServer(base, str(token), log.name)
    finally:
        stop_process_group(proc)  # the API server and its workers
        log.close()


def dag_test_beside(
    dag: Any, conf: dict[str, Any], console: Callable[[dict[str, Any]], None]
) -> tuple[Any, dict[str, Any]]:
    """``dag.test()`` of ``conf`` while ``console(seen)`` acts as a person at the console, in a thread, noting what it
    saw in ``seen``; an error it raised fails the test.  The DAG run and ``seen``."""
    seen: dict[str, Any] = {}

    def act() -> None:
        try:
            console(seen)
        except Exception as e:  # noqa: BLE001 - reported below, in the test's thread
            seen["error"] = repr(e)

    helper = threading.Thread(target=act, daemon=True)
    helper.start()
    dr = dag.test(run_conf=conf, logical_date=None)
    helper.join(timeout=30)
    assert "error" not in seen, seen
    return dr, seen
