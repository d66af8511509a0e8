"""The checkpoint figures: the cost of saves every K steps, restore throughput, the local tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.jobs import (
    LOCAL_STEADY,
    LOCAL_STEADY_STEPS,
    bench_cfg,
    first_event,
    run_job,
    window_step_time,
)
from training.events import Event

# The cost of saves is judged at a realistic step: the small preset (d 128, 4 layers, sequences of 128
# tokens of a BPE of 1024), 250 ms a step or more on these 2 cores.  At the tiny model's ~60 ms a step,
# a format's fixed CPU per save (Orbax's ~100 ms) was most of what the figure measured.
CKPT_PRESET = "small"
CKPT_STEPS, CKPT_WINDOW = 65, (20, 60)
CKPT_QUICK_STEPS, CKPT_QUICK_WINDOW = 35, (10, 30)  # --quick
REALISTIC_STEP_S = 0.25


def preset_dataset(ws: Path, preset: str) -> str:
    """A dataset for ``preset``'s sequence length and tokenizer under ``ws`` (prepared once, from Python's sources)."""
    from training import data
    from training.config import load_config

    cfg = load_config(preset, None, {})
    path = ws / f"data-{preset}"
    data.prepare(
        None,
        str(path),
        cfg.model.seq_len,
        tokenizer=cfg.data.tokenizer,
        vocab_size=cfg.model.vocab_size,
        max_bytes=2_000_000,
    )
    return str(path)


def bench_checkpoint_overhead(
    ws: Path, repeats: int, ks: tuple[int, ...] = (5, 20), quick: bool = False
) -> dict[str, Any]:
    """Interleaved runs of the small preset: every K in ``ks`` in the default format and a run that saves only at
    its end; and Orbax's fixed cost per save against lean's (a tiny state's: the formats themselves are compared
    by the format row, ``benchmarks/formats.py``)."""
    from benchmarks.formats import bench_fixed
    from training.checkpoint.goodput import save_costs
    from training.config import load_config

    steps, (lo, hi) = (CKPT_QUICK_STEPS, CKPT_QUICK_WINDOW) if quick else (CKPT_STEPS, CKPT_WINDOW)
    default = load_config(CKPT_PRESET, None, {}).checkpoint.checkpoint_format
    common: dict[str, Any] = {"steps": steps, "dataset": preset_dataset(ws, CKPT_PRESET), "preset": CKPT_PRESET}
    runs: dict[str, dict[str, Any]] = {
        **{str(k): {"checkpoint_every": k} for k in ks},
        "none": {"checkpoint_every": 10_000},
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    pauses, bounds = [], []
    for r in range(repeats):
        for name, kw in runs.items():
            evs = run_job(bench_cfg(ws, f"ckpt-{name}-{r}", **common, **kw))
            times[name].append(window_step_time(evs, lo, hi))
            costs = save_costs(evs)
            if name in map(str, ks) and costs and costs["paused_s"] is not None and costs["copy_bound_s"] is not None:
                pauses.append(costs["paused_s"])
                bounds.append(costs["copy_bound_s"])
    fixed, error = bench_fixed(repeats)
    return {
        "preset": CKPT_PRESET,
        "window": [lo, hi],
        "format": default,
        "step_s_without": times["none"],
        "realistic_step_s": REALISTIC_STEP_S,
        # The loop's pause per save (median of each run's saves) against the least time copying this
        # process's bytes takes at the host's memory bandwidth.
        "save_pause_s": pauses,
        "copy_bound_s": bounds,
        "per_k": {str(k): {"step_s": times[str(k)]} for k in sorted(ks, reverse=True)},  # the figure first
        # Each format's fixed cost per save: a state of 65 arrays of a few KiB saved alone (formats.py).
        "fixed": fixed,
        "fixed_error": error,
    }


# Each read is timed in a process of its own, after the same start: the libraries imported, JAX's
# backend up, the step's files evicted from the page cache (no root needed) and a moment to settle.
RESTORE_COLD = (
    "import os,sys,time,json,pathlib; import jax; jax.devices()\n"
    "for p in pathlib.Path(sys.argv[1]).rglob('*'):\n"
    " if p.is_file():\n"
    "  fd=os.open(p,os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)\n"
    "time.sleep(0.5); t=time.time()\n"
)
# The figure: the whole state read onto one device (what audits and validation read), as this
# figure has always measured.  Beside it, a worker's restore: the same state as the trainer lays
# it out, copied into buffers the device owns (its step donates them).
RESTORE_SETUP = (
    "from training.checkpoint import manager as ckpt; from training.config import config_from_json;"
    "from training.mesh import build_mesh, plan_mesh; from training.tasks import load_task;"
    "from training.trainer import Trainer; import sys\n"
    "cfg=config_from_json(open(sys.argv[2]+'/config.json').read()); m=ckpt.checkpoint_manager(cfg, sys.argv[2])\n"
    "abstract=Trainer(cfg.optimizer, build_mesh(plan_mesh(cfg.placement, 1)), load_task(cfg)).abstract\n"
)
RESTORE_WORKER = (
    RESTORE_SETUP
    + RESTORE_COLD
    + "s,_=ckpt.restore(m,1,abstract); jax.block_until_ready(s); print(json.dumps(time.time()-t))"
)
RESTORE_ONE_DEVICE = (
    "from training.checkpoint.manager import load_state_host\n"
    + RESTORE_COLD
    + "s=load_state_host(sys.argv[2],1); jax.block_until_ready(s); print(json.dumps(time.time()-t))"
)
RESTORE_RAW = (
    RESTORE_COLD + "for p in sorted(pathlib.Path(sys.argv[1]).rglob('*')):\n"
    " if p.is_file():\n"
    "  with open(p,'rb') as f:\n"
    "   while f.read(1<<22): pass\n"
    "print(json.dumps(time.time()-t))"
)

# The same arrays read by tensorstore alone, through Orbax's own tensorstore context: the most a
# restore through Orbax can get (it adds reading its metadata, allocating and placing on devices).
RESTORE_TS_ALONE = (
    "import asyncio; import tensorstore as ts;"
    "from orbax.checkpoint._src.serialization.tensorstore_utils import get_ts_context\n"
    + RESTORE_COLD
    + "base={'driver':'ocdbt','base':'file://'+sys.argv[2]};"
    "keys=[k.decode() for k in ts.KvStore.open(base).result().list().result()];"
    "arrays=[(k.rsplit('/',1)[0], 'zarr3' if k.endswith('zarr.json') else 'zarr') for k in keys"
    " if k.endswith(('/.zarray','/zarr.json'))]; ctx=get_ts_context(use_ocdbt=True)\n"
    "async def one(p,d):\n"
    " s=await ts.open({'driver':d,'kvstore':{**base,'path':p+'/'}},open=True,context=ctx); return await s.read()\n"
    "async def all_():\n return await asyncio.gather(*[one(p,d) for p,d in arrays])\n"
    "out=asyncio.run(all_()); print(json.dumps([time.time()-t, sum(a.nbytes for a in out)]))"
)


def _timed_read(script: str, step: Path, *args: str) -> Any:
    """The JSON a script printed last, run in a fresh process on ``step`` (its files evicted first)."""
    out = subprocess.run(
        [sys.executable, "-c", script, str(step), *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_restore(ws: Path, repeats: int) -> dict[str, Any]:
    """Restore throughput of the default format (Orbax's OCDBT) against a raw sequential read of the same files.

    The figure reads the step whole onto one device, as audits and validation do.  Beside it: a
    worker's restore of the same step onto the trainer's own layout, and tensorstore alone reading
    its arrays.  (Before lean's retirement the figure read a lean step, Orbax's beside it.)
    """
    shape: dict[str, Any] = {"d_model": 512, "n_layers": 4, "d_ff": 2048, "n_heads": 8}
    one: dict[str, Any] = {"min_workers": 1, "max_workers": 1, "devices_per_worker": 1}
    cfg = bench_cfg(ws, "restore-default", steps=1, checkpoint_every=1, **shape, **one)
    run_job(cfg)
    step, run = Path(cfg.run_uri) / "checkpoints" / "1", cfg.run_uri
    nbytes = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
    mbps: dict[str, list[float]] = {k: [] for k in ("restore", "raw", "worker", "ts_alone")}
    for _ in range(repeats):
        mbps["restore"].append(nbytes / _timed_read(RESTORE_ONE_DEVICE, step, run) / 1e6)
        mbps["raw"].append(nbytes / _timed_read(RESTORE_RAW, step) / 1e6)
        mbps["worker"].append(nbytes / _timed_read(RESTORE_WORKER, step, run) / 1e6)
        seconds, read = _timed_read(RESTORE_TS_ALONE, step, str(step / "state"))
        if read < 0.95 * nbytes:  # it must have read the arrays, all of them
            raise RuntimeError(f"tensorstore read {read} bytes of a {nbytes}-byte checkpoint")
        mbps["ts_alone"].append(nbytes / seconds / 1e6)
    return {
        "format": cfg.checkpoint.checkpoint_format,
        "bytes": nbytes,
        "restore_MBps": mbps["restore"],
        "raw_read_MBps": mbps["raw"],
        "worker_restore_MBps": mbps["worker"],
        "tensorstore_alone_MBps": mbps["ts_alone"],
        "target": ">= 0.5",
        "note": "the default format's step; each read is timed in a fresh process, its files evicted",
    }


# --- 5. the local tier ---------------------------------------------------------------------------


def _recovered(evs: list[Event]) -> Event:
    return first_event(evs, "recovered", 0.0)


def bench_local_tier(ws: Path, repeats: int) -> dict[str, Any]:
    """Local copies every 2 steps: their cost in steady state, and the steps they save after a lost host."""
    steps, (lo, hi) = LOCAL_STEADY_STEPS, LOCAL_STEADY
    with_local: list[float] = []
    without: list[float] = []
    for r in range(repeats):  # A B A B
        for every, out in ((2, with_local), (0, without)):
            cfg = bench_cfg(
                ws, f"local-{every}-{r}", steps=steps, checkpoint_every=10_000, local_checkpoint_every=every
            )
            out.append(window_step_time(run_job(cfg), lo, hi))
    # One host of two is lost at step 17; persistent checkpoints every 10 steps.
    lost: dict[int, list[int]] = {2: [], 0: []}
    recovery_s: dict[int, list[float]] = {2: [], 0: []}
    notice: list[dict[str, Any]] = []
    for r in range(repeats):
        for every in lost:
            cfg = bench_cfg(
                ws,
                f"local-lost-{every}-{r}",
                steps=24,
                checkpoint_every=10,
                local_checkpoint_every=every,
                min_workers=1,
                chaos=["preempt:worker=1,step=17"],
            )
            rec = _recovered(run_job(cfg))
            lost[every].append(int(rec["steps_lost"]))
            recovery_s[every].append(float(rec["seconds"]))
        cfg = bench_cfg(
            ws,
            f"local-notice-{r}",
            steps=24,
            checkpoint_every=10,
            local_checkpoint_every=2,
            min_workers=1,
            chaos=["preempt_notice:worker=1,step=17"],
        )
        evs = run_job(cfg)
        ev = first_event(evs, "preemption_notice", 0.0)
        notice.append({"steps_lost": int(_recovered(evs)["steps_lost"]), "commit_s": ev["seconds"], "step": ev["step"]})
    return {
        "step_s_with_local": with_local,
        "step_s_without": without,
        "overhead_target": "<= 1.10",
        "steps_lost_with_local": lost[2],
        "steps_lost_persistent_only": lost[0],
        "recovery_s_with_local": recovery_s[2],
        "recovery_s_persistent_only": recovery_s[0],
        "notice": notice,
        # Steps lost per lost host, in units of local_checkpoint_every: at most one interval is lost.
        "target": "<= 1",
    }
