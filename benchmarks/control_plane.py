"""The control plane figure: storage requests per host per minute of a job's agents and workers, against the model."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from benchmarks.jobs import (
    WORKERS,
    bench_cfg,
    gone,
    wait_for,
)
from training.store_calls import OPS_ENV

CONTROL_AREAS = ("rendezvous", "lock", "status.json", "control.json")  # the agents' own objects
OPS_WINDOW_S = 30.0  # --quick: 10 s


def _tallies(sink: Path) -> dict[str, dict[str, dict[str, int]]]:
    """Each counting process's calls so far, by role: ``{role: {pid: {"op area": n}}}``."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for f in sink.glob("*.json"):
        if f.stem == str(os.getpid()):
            continue  # the bench's own looks
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        out.setdefault(str(doc["role"]), {})[f.stem] = {k: int(v) for k, v in doc["counts"].items()}
    return out


def _ops_by_op(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], control: bool) -> dict[str, int]:
    """Calls made between two looks, by operation, on the control plane's objects (or on the others)."""
    ops: dict[str, int] = {}
    for pid, counts in after.items():
        for name, n in counts.items():
            op, area = name.split(" ", 1)
            if (area in CONTROL_AREAS) == control:
                ops[op] = ops.get(op, 0) + n - before.get(pid, {}).get(name, 0)
    return ops


def _control_plane_on(ws: Path, root: str, kind: str, window_s: float) -> dict[str, Any]:
    """One 2-host job on ``root``, its agents' and workers' store calls counted over a window of steady training."""
    from training import api
    from training.backends.local import launch
    from training.cadence import billed, cadence, steady_ops

    sink = ws / f"ops-{kind}"
    shutil.rmtree(sink, ignore_errors=True)
    cfg = bench_cfg(ws, f"cp-{kind}", root=root, steps=100_000, checkpoint_every=100_000, log_every=10)
    if kind == "local":
        shutil.rmtree(Path(cfg.run_uri), ignore_errors=True)
    os.environ[OPS_ENV] = str(sink)
    try:
        handle: dict[str, Any] = dict(launch(cfg, provision=True))
    finally:
        os.environ.pop(OPS_ENV, None)
    try:
        wait_for(lambda: ((api.status(cfg.run_uri) or {}).get("step") or 0) >= 20, 600, "steady training")
        t0, before = time.monotonic(), _tallies(sink)
        time.sleep(window_s)
        t1, after = time.monotonic(), _tallies(sink)
        step = (api.status(cfg.run_uri) or {}).get("step")
    finally:
        api.stop_job(cfg.run_uri, "the bench's window is over")
        wait_for(lambda: gone(int(handle["controller_pid"])), 120, "the job to stop")
    per_min = 60.0 / (t1 - t0) / WORKERS
    agents = {pid: c for role in ("agent", "worker") for pid, c in after.get(role, {}).items()}
    agents_before = {pid: c for role in ("agent", "worker") for pid, c in before.get(role, {}).items()}
    measured = billed({op: n * per_min for op, n in _ops_by_op(agents_before, agents, True).items()})
    other = billed({op: n * per_min for op, n in _ops_by_op(agents_before, agents, False).items()})
    model = steady_ops(cadence(WORKERS, kind == "gcs", cfg.elastic.heartbeat_s, cfg.elastic.lease_s))
    return {
        "root": root,
        "window_s": t1 - t0,
        "step_at_end": step,
        "measured": {"class_a": measured.class_a, "class_b": measured.class_b},
        "model": {"class_a": model.class_a, "class_b": model.class_b},
        "other": {"class_a": other.class_a, "class_b": other.class_b},
        "ratio": measured.total / model.total,
    }


def budget(hosts: tuple[int, ...] = (64, 256)) -> dict[int, dict[str, float]]:
    """The model's control plane of a gs:// job of each size: per host per minute, and the job's per day."""
    from training.cadence import cadence, gcs_timing, steady_ops

    out = {}
    for n in hosts:
        t = gcs_timing(n)
        ops = steady_ops(cadence(n, True, t.heartbeat_s, t.lease_s))
        out[n] = {
            "heartbeat_s": t.heartbeat_s,
            "heartbeat_timeout_s": t.heartbeat_timeout_s,
            "class_a": ops.class_a,
            "class_b": ops.class_b,
            "class_a_per_day": ops.class_a * n * 60 * 24,
            "class_b_per_day": ops.class_b * n * 60 * 24,
        }
    return out


def bench_control_plane(ws: Path, repeats: int, window_s: float = OPS_WINDOW_S) -> dict[str, Any]:
    """Storage requests per host per minute of a training job's control plane, measured against its model.

    A 2-host job trains on a local root and on gs:// (an emulator on 127.0.0.1);
    every store call of its agents and workers is counted (``RTRAIN_STORE_OPS``)
    over a window of steady training. The ratio is the measured requests on the
    control plane's objects (rendezvous, lease, status, control) over what the
    cadence's model says for the same job; the model's figures at 64 and 256
    hosts are the budget ``docs/gke.md`` documents.
    """
    from training.emulator import gcs_emulator

    runs = []
    for _ in range(repeats):
        local = _control_plane_on(ws, str(ws / "runs"), "local", window_s)
        with gcs_emulator("rtrain-bench"):
            gcs = _control_plane_on(ws, "gs://rtrain-bench/runs", "gcs", window_s)
        runs.append({"local": local, "gcs": gcs})
    return {"runs": runs, "target": "<= 1.10", "budget": {str(k): v for k, v in budget().items()}}
