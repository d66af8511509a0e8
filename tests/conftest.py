"""Shared fixtures: a real GCS emulator over HTTP, and a small prepared dataset."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
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
    """gcp-storage-emulator on 127.0.0.1, for this process and every process it starts."""
    from training.emulator import gcs_emulator as emulator

    with emulator(BUCKET) as url:
        yield url


@pytest.fixture
def gcs_root(gcs_emulator: str) -> str:
    """A fresh gs:// prefix in the emulator's bucket."""
    return f"gs://{BUCKET}/t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A 1 MiB tmpfs (root only: skipped otherwise) and a function that fills it up."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("needs a tmpfs mount (root) to make a disk that fills up")

    def fill() -> None:
        with open(mnt / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(bytes(4096))
            except OSError:
                pass

    try:
        yield mnt, fill
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
