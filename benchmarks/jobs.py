"""The bench's jobs: a figure's config, a run in the foreground or detached, waits, and times read from its events."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from training.config import Config, load_config
from training.events import Event

WORKERS = 2
# Steady-state step times are read over STEADY: after a round's first steps, while each host's next standby
# worker warms up (imports, task, data checks) on the same two cores that play the devices here.  The
# round's first steps are FIRST_STEPS; STEADY_STEPS is the run's length.
FIRST_STEPS = (10, 40)
LOG_EVERY = 10  # the engine's default: the cost figure's progress events (every window end is a multiple)
STEADY = (60, 110)
STEADY_STEPS = 115
# A local copy's cost is a few per cent of a step: read over a window five times as long (the steps'
# own spread over STEADY is about as large as the cost).
LOCAL_STEADY = (60, 310)
LOCAL_STEADY_STEPS = 315


def bench_cfg(ws: Path, name: str, preset: str = "tiny", **kw: Any) -> Config:
    """A figure's job config: ``preset`` on 2 local hosts under ``ws``, a progress event every step, overridden by ``kw``."""
    base = {
        "root": str(ws / "runs"),
        "dataset": str(ws / "data"),
        "compilation_cache": str(ws / "jax-cache"),
        "run_name": name,
        "min_workers": WORKERS,
        "max_workers": WORKERS,
        "log_every": 1,
        "hang_timeout_s": 300,
        "spike_factor": 0,
    }
    base.update(kw)
    return load_config(preset, None, base)


def run_job(cfg: Config) -> list[Event]:
    from training import api

    store_dir = Path(cfg.run_uri)
    if store_dir.exists():
        shutil.rmtree(store_dir)
    from training.backends.local import run_here

    _handle, rc = run_here(cfg, provision=True)
    if rc != 0:
        raise RuntimeError(f"bench run {cfg.run_name} failed: see {cfg.run_uri}/logs")
    return api.events(cfg.run_uri)


def first_event(evs: list[Event], type_: str, after: float, **match: Any) -> Event:
    for e in evs:
        if e["type"] == type_ and e["time"] >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    raise LookupError(f"no {type_} event after {after}")


def start_job(cfg: Config) -> dict[str, Any]:
    from training.backends.local import launch

    store_dir = Path(cfg.run_uri)
    if store_dir.exists():
        shutil.rmtree(store_dir)
    return dict(launch(cfg, provision=True))


def wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"bench: timed out waiting for {what}")


def end_job(handle: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    from training import api

    st = wait_for(
        lambda: (s := api.job_state(handle)) and s["state"] in ("finished", "failed") and s, timeout, "the job's end"
    )
    pid = int(handle["controller_pid"])
    wait_for(lambda: gone(pid), 60, "the local slice to exit")
    if st["state"] != "finished":
        raise RuntimeError(f"bench run {handle['run_uri']} {st['state']}: {st.get('reason')}")
    return dict(st["status"])


def gone(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return True


def steady_step_time(evs: list[Event], rnd: int) -> float:
    t = sorted((e["step"], e["time"]) for e in evs if e["type"] == "progress" and e.get("attempt") == rnd)
    if len(t) < 4:
        return float("nan")
    (s0, t0), (s1, t1) = t[1], t[-1]
    return float(t1 - t0) / float(max(s1 - s0, 1))


def window_step_time(evs: list[Event], lo: int, hi: int) -> float:
    t = {e["step"]: e["time"] for e in evs if e["type"] == "progress" and e.get("attempt") == 1}
    return float(t[hi] - t[lo]) / (hi - lo)
