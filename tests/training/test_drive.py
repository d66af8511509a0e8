"""``rtrain train``'s one driver: Ctrl-C in the foreground stops the job at a step boundary, followed to its end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training import api
from training.backends.local import pid_alive
from training.cli import Exit, main
from training.layout import CAPACITY

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ctrl_c_stops_the_job_at_a_step_boundary_and_the_driver_follows_it_to_its_end(
    tmp_path: Path, tiny_dataset: str, jax_cache: str
) -> None:
    args = [f"root={tmp_path}", "run_name=c", f"dataset={tiny_dataset}", f"compilation_cache={jax_cache}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "training.cli", "train", *args, "steps=5000", "max_workers=2", "checkpoint_every=4"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # (the test's own Ctrl-C stays its own)
    )
    run_uri = str(tmp_path / "c")
    deadline = time.time() + 180
    while time.time() < deadline and int((api.status(run_uri) or {}).get("step") or 0) < 3:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.3)
    # A second rtrain train of the run is refused while this job holds it, and its driver releases nothing of it.
    pids = api.local_job_pids(run_uri)
    assert main(["train", *args, "steps=5000", "max_workers=2"]) == Exit.REFUSED
    assert pids and all(pid_alive(p) for p in pids) and (api.status(run_uri) or {}).get("state") == "running"
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 7, (out[-2000:], err[-2000:])
    assert "interrupted: the job stops at its next step boundary and commits it" in out
    assert "rtrain: the job was stopped: interrupted (Ctrl-C)" in err and "resumes from it" in err
    st = api.status(run_uri) or {}
    assert st.get("state") == "stopped" and st.get("latest_committed") == st.get("step"), st
    assert not [p for p in api.local_job_pids(run_uri) if pid_alive(p)], "the job's processes are gone"
    assert (tmp_path / "c" / CAPACITY).exists() and not api.events(run_uri, ("capacity",)), "no teardown's release"
