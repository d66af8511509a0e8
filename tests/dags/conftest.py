"""Fixtures for the DAG tests: a throwaway Airflow (set up before airflow is imported), DAG runs, run roots."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import airflow_test_env  # noqa: E402

airflow_test_env.configure()


@pytest.fixture(scope="session")
def airflow_db() -> None:
    airflow_test_env.migrate()


@pytest.fixture(scope="session")
def dagbag(airflow_db: None) -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(airflow_test_env.REPO / "dags"))


@pytest.fixture(scope="session")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One dataset and one JAX compilation cache for every DAG run of the session."""
    base = tmp_path_factory.mktemp("rtrain-shared")
    return {"dataset": str(base / "data"), "cache": str(base / "jax-cache")}


@pytest.fixture
def run_conf(shared: dict[str, str], tmp_path: Path) -> Any:
    """Build a DAG run conf for a tiny local run under this test's tmp dir."""

    def make(run_name: str, **params: Any) -> dict[str, Any]:
        overrides = {
            "compilation_cache": shared["cache"],
            "log_every": 5,
            "hang_timeout_s": 120,
            "capacity_timeout_s": 30,
            **params.pop("overrides", {}),
        }
        conf = {
            "run_name": run_name,
            "preset": "tiny",
            "storage_root": str(tmp_path / "runs"),
            "dataset": shared["dataset"],
            "dataset_max_bytes": 1_000_000,
            "steps": 20,
            "checkpoint_every": 10,
            "min_workers": 1,
            "max_workers": 2,
            "overrides": overrides,
        }
        conf.update(params)
        return conf

    return make


@pytest.fixture
def stop_agents() -> Iterator[list[str]]:
    """Run roots whose jobs' processes (the local slice, agents, workers) are stopped after the test, whatever happened."""
    uris: list[str] = []
    yield uris
    import psutil

    from training.backends.local import stop_process_tree

    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        job_process = "training.elastic" in cmdline or cmdline.startswith("rtrain ")  # as started, or as titled
        if job_process and any(uri in cmdline for uri in uris):
            stop_process_tree(proc.info["pid"])
