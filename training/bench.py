"""``rtrain bench``: the engine's four figures, each a ratio measured side by side in one run.

1. Recovery: SIGKILL of a worker -> first completed step after the resume, split
   into detect, relaunch+init, restore, compile, first step; against a cold start
   of the same job from the same checkpoint (a fresh ``rtrain train`` process).
2. Checkpoint overhead: steady-state step time with async checkpoints every K
   steps / without, runs interleaved A B A B.
3. Cost of resilience: tokens/s of the engine / tokens/s of a minimal plain JAX
   loop on the same model, data and mesh (no agent, no checkpoints, no events).
4. Restore throughput / raw sequential read throughput of the same files.

Timings come from the runs' own event records (worker clocks), not from log lines.
Prints a table and writes JSON.  These are measurements, not tests: machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from training.config import Config, load_config

WORKERS = 2


def _cfg(ws: Path, name: str, **kw: Any) -> Config:
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
    return load_config("tiny", None, base)


def _run(cfg: Config) -> list[dict[str, Any]]:
    from training import api

    store_dir = Path(cfg.run_uri)
    if store_dir.exists():
        shutil.rmtree(store_dir)
    res = api.launch(cfg, detach=False, display=None)
    if res["returncode"] != 0:
        raise RuntimeError(f"bench run {cfg.run_name} failed: see {cfg.run_uri}/logs")
    return api.events(cfg.run_uri)


def _first(evs: list[dict], type_: str, after: float, **match: Any) -> dict[str, Any]:
    for e in evs:
        if e["type"] == type_ and e["time"] >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    raise LookupError(f"no {type_} event after {after}")


# --- 1. recovery ------------------------------------------------------------------------


def bench_recovery(ws: Path, repeats: int) -> dict[str, Any]:
    steps = 10 * (repeats + 1)
    chaos = [f"crash:worker=1,step={10 * (i + 1) + 3}" for i in range(repeats)]
    cfg = _cfg(ws, "recovery", steps=steps, checkpoint_every=5, chaos=chaos, max_failures=repeats)
    evs = _run(cfg)
    rows = []
    for fail in [e for e in evs if e["type"] == "failure"]:
        t0 = fail["fault_at"]
        launch = _first(evs, "launch", fail["time"])
        att = launch["attempt"]
        started = _first(evs, "worker_started", launch["time"], attempt=att, process_id=0)
        restore = _first(evs, "restore", launch["time"], attempt=att)
        # restore["time"] is when it ended; what lies between start-up and the restore
        # is building the mesh, the abstract state and the checkpoint manager.
        compiled = _first(evs, "compiled", launch["time"], attempt=att)
        resumed = _first(evs, "resumed", launch["time"], attempt=att)
        rows.append(
            {
                "restored_step": restore["step"],
                "detect_s": fail["detected_at"] - t0,
                "relaunch_init_s": started["time"] - fail["detected_at"],
                "setup_s": restore["time"] - restore["seconds"] - started["time"],
                "restore_s": restore["seconds"],
                "compile_s": compiled["seconds"],
                "first_step_s": resumed["time"] - compiled["time"],
                "total_s": resumed["time"] - t0,
            }
        )
    colds = [_cold_start(ws, cfg, r["restored_step"], i) for i, r in enumerate(rows)]
    med = statistics.median(r["total_s"] for r in rows)
    cold = statistics.median(colds)
    return {
        "recoveries": rows,
        "cold_starts_s": colds,
        "median_recovery_s": med,
        "median_cold_start_s": cold,
        "median_breakdown_s": {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_s")},
        "ratio": med / cold,
        "target": "<= 1.2",
    }


def _cold_start(ws: Path, src: Config, step: int, i: int) -> float:
    """A fresh `rtrain train` process resuming the same job from the same checkpoint."""
    from training import api

    cfg = src.model_copy(update={"run_name": f"cold-{i}", "chaos": []})
    dst = Path(cfg.run_uri)
    shutil.rmtree(dst, ignore_errors=True)
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(Path(src.run_uri) / "checkpoints" / str(step), dst / "checkpoints" / str(step))
    (dst / "config.json").write_text(cfg.to_json())
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
            resumed = [e for e in api.events(cfg.run_uri, ("resumed",))]
            if resumed:
                return float(resumed[0]["time"]) - t0
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"cold start {i} did not reach its first step")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --- 2. checkpoint overhead ------------------------------------------------------------------


def _window_step_time(evs: list[dict], lo: int, hi: int) -> float:
    t = {e["step"]: e["time"] for e in evs if e["type"] == "progress" and e.get("attempt") == 0}
    return (t[hi] - t[lo]) / (hi - lo)


def bench_checkpoint_overhead(ws: Path, repeats: int, ks: tuple[int, ...] = (5, 20)) -> dict[str, Any]:
    """Interleaved runs: every K in ``ks``, and a run that saves only at its end."""
    steps, lo, hi = 45, 10, 40
    times: dict[int, list[float]] = {k: [] for k in (*ks, 10_000)}
    for r in range(repeats):
        for every in times:
            cfg = _cfg(ws, f"ckpt-{every}-{r}", steps=steps, checkpoint_every=every)
            times[every].append(_window_step_time(_run(cfg), lo, hi))
    base = statistics.median(times[10_000])
    per_k = {k: {"step_s": times[k], "ratio": statistics.median(times[k]) / base} for k in ks}
    return {
        "step_s_without": times[10_000],
        "per_k": per_k,
        "k": ks[-1],
        "ratio": per_k[ks[-1]]["ratio"],
        "target": "<= 1.03",
    }


# --- 3. cost of resilience ---------------------------------------------------------------------


def plain_loop() -> int:
    """A minimal multi-process JAX loop: same model, data and mesh; nothing else."""
    import jax

    cfg = load_config("tiny", None, json.loads(os.environ["BENCH_CFG"]))
    n, pid = int(os.environ["BENCH_N"]), int(os.environ["BENCH_PID"])
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(cfg.compilation_cache))
    jax.distributed.initialize(os.environ["BENCH_COORD"], n, pid)
    from training import data
    from training.mesh import build_mesh, plan_mesh
    from training.trainer import Trainer

    tr = Trainer(cfg, build_mesh(plan_mesh(cfg, n)))
    state = tr.init()
    tr.compile()
    batches = data.make_batches(
        cfg.dataset, "train", seed=cfg.seed, global_batch=cfg.global_batch, process_index=pid, process_count=n
    )
    times = []
    for _ in range(cfg.steps):
        state, m = tr.step(state, *tr.global_batch(next(batches)))
        float(m["loss"])  # the same per-step host sync as the engine at log_every=1
        times.append(time.time())
    if pid == 0:
        print(json.dumps({"times": times}), flush=True)
    return 0


def bench_cost(ws: Path, repeats: int) -> dict[str, Any]:
    from training.agent import _free_port

    steps, lo, hi = 45, 10, 40
    tok = 16 * 64
    engine, plain = [], []
    for r in range(repeats):
        cfg = _cfg(ws, f"cost-{r}", steps=steps, checkpoint_every=10)
        engine.append(tok / _window_step_time(_run(cfg), lo, hi))
        over = {k: v for k, v in cfg.model_dump().items() if k in ("dataset", "compilation_cache", "steps")}
        port = _free_port()
        procs = []
        for pid in range(WORKERS):
            env = {
                **os.environ,
                "BENCH_CFG": json.dumps(over),
                "BENCH_N": str(WORKERS),
                "BENCH_PID": str(pid),
                "BENCH_COORD": f"127.0.0.1:{port}",
                "JAX_PLATFORMS": "cpu",
                "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={cfg.devices_per_worker}",
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "training.bench", "plain"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=600)[0] for p in procs]
        times = json.loads(outs[0].strip().splitlines()[-1])["times"]
        # times[i] is the end of step i+1, as the engine's progress event for step i+1.
        plain.append(tok / ((times[hi - 1] - times[lo - 1]) / (hi - lo)))
    a, b = statistics.median(engine), statistics.median(plain)
    return {"engine_tokens_per_s": engine, "plain_tokens_per_s": plain, "ratio": a / b, "target": ">= 0.95"}


# --- 4. restore throughput -----------------------------------------------------------------------


def bench_restore(ws: Path, repeats: int) -> dict[str, Any]:
    cfg = _cfg(
        ws,
        "restore",
        steps=1,
        checkpoint_every=1,
        d_model=512,
        n_layers=4,
        d_ff=2048,
        n_heads=8,
        min_workers=1,
        max_workers=1,
        devices_per_worker=1,
    )
    _run(cfg)
    ck = Path(cfg.run_uri) / "checkpoints" / "1"
    files = [p for p in ck.rglob("*") if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    code = (
        "import sys,time,json; from training.trainer import load_state_host; import jax;"
        "t=time.time(); s=load_state_host(sys.argv[1],1); jax.block_until_ready(s); print(json.dumps(time.time()-t))"
    )

    def evict() -> None:
        # Both reads start from the disk, not from the page cache (no root needed).
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    restore, raw = [], []
    for _ in range(repeats):
        evict()
        out = subprocess.run(
            [sys.executable, "-c", code, cfg.run_uri],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        restore.append(nbytes / json.loads(out.stdout.strip().splitlines()[-1]))
        evict()
        t = time.time()
        for p in files:
            with open(p, "rb") as f:
                while f.read(1 << 22):
                    pass
        raw.append(nbytes / (time.time() - t))
    a, b = statistics.median(restore), statistics.median(raw)
    return {
        "bytes": nbytes,
        "restore_MBps": [x / 1e6 for x in restore],
        "raw_read_MBps": [x / 1e6 for x in raw],
        "ratio": a / b,
        "target": ">= 0.5",
        "note": "same files, same disk; each read starts with the files evicted from the page cache",
    }


# --- main -----------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    from training import data

    ws = Path("var/bench").resolve()
    ws.mkdir(parents=True, exist_ok=True)
    data.prepare(None, str(ws / "data"), 64, max_bytes=2_000_000)
    repeats = 1 if args.quick else args.repeats
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "workers": WORKERS, "devices_per_worker": 2},
        "repeats": repeats,
        "time": time.time(),
    }
    for name, fn in (
        ("recovery", bench_recovery),
        ("checkpoint_overhead", bench_checkpoint_overhead),
        ("cost_of_resilience", bench_cost),
        ("restore_throughput", bench_restore),
    ):
        print(f"[bench] {name} ...", flush=True)
        results[name] = fn(ws, max(repeats, 3) if name == "recovery" and not args.quick else repeats)
        print(f"[bench] {name}: ratio {results[name]['ratio']:.3f} (target {results[name]['target']})", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(format_table(results))
    print(f"wrote {out}")
    return 0


def format_table(r: dict[str, Any]) -> str:
    rec = r["recovery"]
    b = rec["median_breakdown_s"]
    lines = [
        f"{'figure':<22} {'measured':>40} {'ratio':>8} {'target':>8}",
        f"{'recovery':<22} {rec['median_recovery_s']:>7.2f}s vs cold start {rec['median_cold_start_s']:>6.2f}s"
        f"{'':>8} {rec['ratio']:>8.3f} {rec['target']:>8}",
        f"{'  breakdown':<22} detect {b['detect_s']:.2f}s relaunch+init {b['relaunch_init_s']:.2f}s "
        f"setup {b['setup_s']:.2f}s restore {b['restore_s']:.2f}s compile {b['compile_s']:.2f}s first step {b['first_step_s']:.2f}s",
    ]
    c = r["checkpoint_overhead"]
    for every, v in c["per_k"].items():
        name = f"checkpoint every {every}"
        lines.append(
            f"{name:<22} {statistics.median(v['step_s']) * 1e3:>9.1f} ms/step vs "
            f"{statistics.median(c['step_s_without']) * 1e3:>6.1f} ms/step{'':>7} {v['ratio']:>8.3f} {c['target']:>8}"
        )
    k = r["cost_of_resilience"]
    lines.append(
        f"{'cost of resilience':<22} {statistics.median(k['engine_tokens_per_s']):>9.0f} tok/s vs "
        f"{statistics.median(k['plain_tokens_per_s']):>8.0f} tok/s{'':>8} {k['ratio']:>8.3f} {k['target']:>8}"
    )
    s = r["restore_throughput"]
    lines.append(
        f"{'restore throughput':<22} {statistics.median(s['restore_MBps']):>9.0f} MB/s vs "
        f"{statistics.median(s['raw_read_MBps']):>7.0f} MB/s raw{'':>6} {s['ratio']:>8.3f} {s['target']:>8}"
    )
    return "\n".join(lines)


if __name__ == "__main__" and sys.argv[1:] == ["plain"]:
    sys.exit(plain_loop())
