"""The plugin tests run against the same throwaway Airflow as the DAG tests (tests/dags/airflow_test_env.py).

Configured on import, before any test module here imports airflow.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dags"))
import airflow_test_env  # noqa: E402

airflow_test_env.configure()


# The fake GKE cluster of the provisioning tests (test_gke_tpu.py's PROJECT, LOCATION and CLUSTER).
CLUSTER_PATH = "projects/rtrain-prod/locations/us-east5/clusters/train"


@pytest.fixture
def pools() -> Iterator[tuple[Any, Any]]:
    """An in-process ClusterManager over gRPC (tests/cluster_manager.py), and the real client connected to it."""
    from cluster_manager import FakeClusterManager, serve

    fake = FakeClusterManager(clusters=(CLUSTER_PATH,))
    with serve(fake) as client:
        yield fake, client


@pytest.fixture(scope="module")
def gs_data(gcs_emulator: str) -> str:
    """A prepared gs:// dataset in the emulator, shared by a module's provisioning tests (the check before
    billing opens it)."""
    from training import data

    dataset = f"gs://rtrain-test/gke-data-{uuid.uuid4().hex[:8]}"
    data.prepare(None, dataset, 64, max_bytes=60_000)
    return dataset
