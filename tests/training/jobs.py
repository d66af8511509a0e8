"""Helpers to run jobs in tests and read what they left in the run root."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from training.config import Config, load_config


def job_config(root: str, dataset: str, cache: str, **overrides: Any) -> Config:
    base = {
        "root": root,
        "dataset": dataset,
        "compilation_cache": cache,
        "log_every": 5,
        "hang_timeout_s": 120,
        "capacity_timeout_s": 30,
    }
    base.update(overrides)
    return load_config("tiny", None, base)


def run_job(cfg: Config) -> int:
    """Run a job on the local slice to its end (as `rtrain train` does); its exit code."""
    from training.backends.local import run_here

    lines: list[str] = []
    _handle, rc = run_here(cfg, on_line=lines.append)
    return rc


def start_job(cfg: Config) -> dict[str, Any]:
    """Start a job in the background (as `rtrain train --detach` and Airflow do); its handle."""
    from training.backends.local import launch

    return dict(launch(cfg))


def start_agent(
    run_uri: str, job: str, host: str, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """One host agent of ``job``, as a pod runs it: no local pool behind it (its hosts come back by themselves)."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "training.elastic.host.agent", run_uri, "--job", job, "--host", host],
            env=env or {**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_finished(handle: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    from training.api import FINAL_STATES, job_state

    def over() -> Mapping[str, Any] | None:
        look = job_state(handle)
        return look if look["state"] in FINAL_STATES else None

    look = wait_for(over, timeout, f"job {handle['job']} to end", every=0.5)
    pid = handle.get("controller_pid")
    if pid:
        wait_for(lambda: not pid_running(int(pid)), 60, "the local slice to exit", every=0.2)
    return dict(look["status"])


def pid_running(pid: int) -> bool:
    from training.backends.local import pid_alive

    return pid_alive(pid)


def hosts(run_uri: str) -> dict[str, Any]:
    """The rendezvous' host records (heartbeats) by host id."""
    from training.elastic.rendezvous import Rendezvous
    from training.storage import open_store

    return Rendezvous(open_store(run_uri)).hosts()


def kill_host(run_uri: str, host: str, sig: int = signal.SIGKILL) -> int:
    """Take a simulated host down: its agent's process group (agent, worker, standby). Returns the agent pid."""
    pid = hosts(run_uri)[host].pid
    os.killpg(os.getpgid(pid), sig)
    return pid


def step_ids(run_uri: str) -> dict[int, list[int]]:
    """Per step, the sorted example ids the final round covering that step consumed."""
    from training.storage import open_store

    store = open_store(run_uri)
    by_step: dict[int, dict[int, list[int]]] = {}
    for key in store.list("trace/"):
        _, step_s, name = key.split("/")
        attempt = int(name[1:4])
        ids = json.loads(store.get(key))["ids"]
        by_step.setdefault(int(step_s), {}).setdefault(attempt, []).extend(ids)
    return {s: sorted(atts[max(atts)]) for s, atts in sorted(by_step.items())}


def assert_exact_data(run_uri: str, dataset: str, cfg: Config) -> None:
    """Every step consumed exactly its global batch (as one uninterrupted run would), resizes or not."""
    from training.data import global_batch_ids

    ids = step_ids(run_uri)
    assert sorted(ids) == list(range(cfg.optimizer.steps)), "every step consumed exactly one global batch"
    for step, got in ids.items():
        want = global_batch_ids(
            dataset, seed=cfg.optimizer.seed, global_batch=cfg.optimizer.global_batch, batch_index=step
        )
        assert got == sorted(int(i) for i in want), f"step {step}: wrong examples after a resize"


def worker_logs(run_uri: str) -> str:
    logs = Path(run_uri) / "logs"
    return "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(logs.rglob("*.log"))) if logs.exists() else ""
