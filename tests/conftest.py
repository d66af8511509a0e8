"""Shared fixtures: a real GCS emulator over HTTP, a disk that fills up, and the check that no process a test started
outlives the session."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from processes import started_from

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
def added_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The journaled backend of ``tests/backend_added`` installed for this process and the processes it starts
    (its module and its dist-info on the path, as an install lays them out); taken out after."""
    import os

    from training.backends import remove

    added = REPO / "tests" / "backend_added"
    monkeypatch.syspath_prepend(str(added))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(added), os.environ.get("PYTHONPATH", "")]))
    yield
    remove("journaled")
    sys.modules.pop("journaled_backend", None)


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


LEFT_GRACE_S = 20.0  # how long processes started from the session's temporary directories get to exit at its end


@pytest.fixture(scope="session", autouse=True)
def nothing_outlives_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After the last test: no process started from the session's temporary directories (a job's agents, an Airflow
    component or its LocalExecutor workers in a copy of the project) is left.  Any left after a grace period is
    killed, and the session fails naming each."""
    import psutil

    base = tmp_path_factory.getbasetemp().resolve()
    yield
    deadline = time.monotonic() + LEFT_GRACE_S
    while (left := started_from(base)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not left:
        return
    named = []
    for p in left:
        with contextlib.suppress(psutil.Error):
            named.append(f"pid {p.pid}: {' '.join(p.cmdline()).strip()[:200]} (in {p.cwd()})")
        with contextlib.suppress(psutil.Error):
            p.kill()
    pytest.fail(
        f"{len(left)} process(es) started from {base} outlived the test session (killed now):\n  " + "\n  ".join(named),
        pytrace=False,
    )
