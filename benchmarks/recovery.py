"""The recovery figures: a lost follower or leader host against a cold start, an unseen mesh, Ray Train v2."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.jobs import (
    WORKERS,
    bench_cfg,
    end_job,
    first_event,
    run_job,
    start_job,
    steady_step_time,
    wait_for,
)
from training.config import Config

# The lost-host jobs: long enough to lose a host in steady state (every agent's next worker warm, STEADY_S
# after the first step), saving every SAVE_EVERY steps.  The warm-up runs have the same steps: the learning
# rate schedule is part of the compiled step.
LOSE_STEPS, SAVE_EVERY, STEADY_S = 300, 25, 8.0
# A recovery's phases, as :func:`lose_host` measures them, with their names in the table.
PHASES = {
    "detect_s": "detect",
    "form_round_s": "round",
    "worker_init_s": "worker start",
    "setup_s": "set-up",
    "restore_s": "restore",
    "compile_s": "compile",
    "first_step_s": "first step",
}


def lose_host(
    ws: Path,
    name: str,
    which: str,
    wait_ahead: bool = False,
    ready: Callable[[Config], bool] | None = None,
    steady_s: float = STEADY_S,
    **kw: Any,
) -> dict[str, Any]:
    """One job on 2 hosts in steady state; then the leader's host, or the other one, is lost (agent and worker).

    ``wait_ahead``: and not before process 0 has compiled the 1-host step ahead.  ``ready``: lost once it
    says so (default: once a persistent checkpoint was saved).
    """
    from training import api
    from training.elastic.capacity import LocalCapacity
    from training.elastic.rendezvous import Rendezvous
    from training.storage import open_store

    cfg = bench_cfg(ws, name, **{"steps": LOSE_STEPS, "checkpoint_every": SAVE_EVERY, "min_workers": 1, **kw})
    handle = start_job(cfg)
    first = wait_for(lambda: api.events(cfg.run_uri, ("resumed",)), 300, "the first step")[0]
    wait_for(lambda: time.time() - first["time"] >= steady_s, 60 + steady_s, "steady state")
    if wait_ahead:
        wait_for(
            lambda: (
                api.events(cfg.run_uri, ("compiled_ahead",)) or api.job_state(handle)["state"] in ("finished", "failed")
            ),
            300,
            "the step compiled ahead",
        )
        if not api.events(cfg.run_uri, ("compiled_ahead",)):
            raise RuntimeError(f"bench run {name}: the job ended before its 1-host step was compiled ahead")
    wait_for(lambda: (ready or _saved)(cfg), 600, f"bench run {name} to be ready to lose a host")
    st = wait_for(lambda: api.status(cfg.run_uri), 60, "the job's status")
    leader = st["leader"]
    records = Rendezvous(open_store(cfg.run_uri)).hosts()
    victim = leader if which == "leader" else next(h for h in records if h != leader)
    # The pool loses that host, by name: shrunk by number, the local slice would stop its newest host,
    # and a lost leader would be two hosts lost at once.
    LocalCapacity(open_store(cfg.run_uri), default=WORKERS).leave(victim, reason="bench: the host is gone")
    t_kill = time.time()
    os.killpg(os.getpgid(records[victim].pid), signal.SIGKILL)
    end_job(handle)
    evs = api.events(cfg.run_uri)
    fail = first_event(evs, "failure", t_kill)
    launch = first_event(evs, "launch", t_kill)
    rnd = launch["round"]
    assert rnd is not None, "a launch names its round"
    started = first_event(evs, "worker_started", launch["time"], attempt=rnd, process_id=0)
    restore = first_event(evs, "restore", launch["time"], attempt=rnd)
    compiled = first_event(evs, "compiled", launch["time"], attempt=rnd)
    resumed = first_event(evs, "resumed", launch["time"], attempt=rnd)
    steady = steady_step_time(evs, rnd)
    return {
        "lost": which,
        "restored_step": restore["step"],
        "restored_tier": restore.get("tier"),
        "total_s": resumed["time"] - t_kill,
        "detect_s": fail["detected_at"] - t_kill,
        "form_round_s": launch["time"] - fail["detected_at"],
        "worker_init_s": started["time"] - launch["time"],
        "setup_s": restore["time"] - restore["seconds"] - started["time"],
        "restore_s": restore["seconds"],
        "compile_s": compiled["seconds"],
        "compile_cached": compiled.get("cache_hit"),
        "first_step_s": resumed["time"] - compiled["time"],
        "steady_step_s": steady,
        "leader_changed": any(e["type"] == "leader" and e["time"] > t_kill for e in evs),
        "bench_cfg": cfg,
    }


def _saved(cfg: Config) -> bool:
    """The job has trained past its first persistent checkpoint."""
    from training import api

    return ((api.status(cfg.run_uri) or {}).get("step") or 0) >= SAVE_EVERY


def bench_recovery(ws: Path, repeats: int, ray: bool = True) -> dict[str, Any]:
    """Lost follower host and lost leader host vs a cold start of the same job from the same checkpoint."""
    # Warm the persistent compilation cache for both meshes first (2 hosts, then 1): every measured
    # recovery and cold start then compiles from the cache, as a job that has run before does.
    for n in (WORKERS, WORKERS - 1):
        run_job(bench_cfg(ws, f"warm-{n}", steps=LOSE_STEPS, checkpoint_every=LOSE_STEPS, min_workers=n, max_workers=n))
    follower, leader = [], []
    for i in range(repeats):  # interleaved: drift on the machine falls on both
        follower.append(lose_host(ws, f"lose-follower-{i}", "follower"))
        leader.append(lose_host(ws, f"lose-leader-{i}", "leader"))
    colds = [cold_start(ws, r.pop("bench_cfg"), r["restored_step"], i) for i, r in enumerate(follower)]
    for r in leader:
        r.pop("bench_cfg")
    out: dict[str, Any] = {"follower": follower, "leader": leader, "cold_starts_s": colds}
    try:
        out["unseen_mesh"] = {"runs": [bench_unseen_mesh(ws) for _ in range(repeats)]}
    except Exception as e:  # noqa: BLE001 - reported in the table, the rest of the bench stands
        out["unseen_mesh"] = {"error": f"{type(e).__name__}: {e}"}
    if ray:
        out["ray"] = bench_ray(ws, repeats)
    return out


def bench_unseen_mesh(ws: Path) -> dict[str, Any]:
    """A lost follower onto a mesh the run never ran on: the recovery's compile, with the step compiled ahead or not.

    Each job has a cache of its own that holds nothing at its start.
    """
    runs = {}
    for ahead in (True, False):
        cache = ws / f"jax-cache-unseen-{'ahead' if ahead else 'not'}"
        shutil.rmtree(cache, ignore_errors=True)
        r = lose_host(
            ws,
            f"unseen-{'ahead' if ahead else 'not'}",
            "follower",
            wait_ahead=ahead,
            compile_ahead=ahead,
            compilation_cache=str(cache),
        )
        r.pop("bench_cfg")
        runs["ahead" if ahead else "not_ahead"] = r
    return runs


def bench_ray(ws: Path, repeats: int) -> dict[str, Any]:
    """Ray Train v2's elastic trainer on the same model, data and kill (benchmarks/ray_baseline.py), once a repeat."""
    try:
        from benchmarks.ray_baseline import ray_recovery

        runs = [ray_recovery(ws / "ray", str(ws / "data"), hosts=WORKERS, devices_per_host=2) for _ in range(repeats)]
    except Exception as e:  # noqa: BLE001 - reported in the table, the rest of the bench stands
        return {"error": f"{type(e).__name__}: {e}"}
    return {"runs": runs}


def cold_start(ws: Path, src: Config, step: int, i: int) -> float:
    """A fresh `rtrain train` process of the same job, from the same checkpoint, on the mesh the recovery ended on."""
    from training import api

    cfg = src.model_copy(
        update={
            "run_name": f"cold-{i}",
            "elastic.chaos": [],
            "elastic.min_workers": 1,
            "elastic.max_workers": WORKERS - 1,
        }
    )
    dst = Path(cfg.run_uri)
    shutil.rmtree(dst, ignore_errors=True)
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(Path(src.run_uri) / "checkpoints" / str(step), dst / "checkpoints" / str(step))
    spec = ws / f"cold-{i}.yml"
    spec.write_text(cfg.to_json())  # JSON is YAML: the whole resolved config as one layer
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "training.cli", "train", "--config", str(spec)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            resumed = api.events(cfg.run_uri, ("resumed",)) if (dst / "events").exists() else []
            if resumed:
                return float(resumed[0]["time"]) - t0
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"cold start {i} did not reach its first step; see {dst}/logs")
    finally:
        for pid in api.local_job_pids(cfg.run_uri):
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
