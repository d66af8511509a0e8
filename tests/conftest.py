"""Shared fixtures: a real GCS emulator over HTTP, and a small prepared dataset."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Airflow puts the plugins folder on sys.path; so do the tests.
if str(REPO / "plugins") not in sys.path:
    sys.path.insert(0, str(REPO / "plugins"))
BUCKET = "rtrain-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[str]:
    """Start gcp-storage-emulator on 127.0.0.1 and point every client at it.

    Sets the variables google-cloud-storage (STORAGE_EMULATOR_HOST), TensorStore
    (TENSORSTORE_GCS_HTTP_URL, used by Orbax) and gcsfs read, for this process
    and every worker process it starts.
    """
    port = free_port()
    exe = Path(sys.executable).parent / "gcp-storage-emulator"
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"gcs-emulator-{port}.log", "ab")
    proc = subprocess.Popen(
        [str(exe), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "-q"],
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the GCS emulator did not start") from None
            time.sleep(0.2)
    env = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "GOOGLE_CLOUD_PROJECT": "local",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from training.storage import gcs_client

    client = gcs_client()
    client.create_bucket(BUCKET)  # type: ignore[attr-defined]
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def gcs_root(gcs_emulator: str) -> str:
    """A fresh gs:// prefix in the emulator's bucket."""
    return f"gs://{BUCKET}/t-{uuid.uuid4().hex[:10]}"
