"""``rtrain bench``: the engine's figures, each a ratio of two things measured side by side in one run.

1. Recovery from a lost follower or leader host (agent and worker SIGKILLed) to the first step on the
   new mesh, by phase, against a cold start from the same checkpoint and against Ray Train v2's
   elastic trainer on the same model, data and kill (``benchmarks/ray_baseline.py``).
2. Checkpoint overhead: step time with async checkpoints every K steps / without.
3. Cost of resilience: tokens/s of the engine / of a hand-written ``jit`` loop; and MFU.
4. Restore throughput / raw sequential read throughput of the same files.
5. The local tier: its step-time cost; steps trained again after a lost host with it / without;
   steps lost to a preemption notice (should be none).
6. The service: a queued job's priority raised on a shared pool: time to free hosts, ETA vs end.
7. The control plane: storage requests per host per minute, against the cadence's model.

Timings come from the runs' own event records (process clocks), not log lines.  Each figure prints
its repeats and their spread; then a table, and JSON.  Measurements, not tests: machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.rows import rows_of
from benchmarks.table import format_rows, ratio_text
from training.config import Config, load_config
from training.cpu_devices import cpu_xla_flags
from training.events import Event
from training.storage import OPS_ENV

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


def _run(cfg: Config) -> list[Event]:
    from training import api

    store_dir = Path(cfg.run_uri)
    if store_dir.exists():
        shutil.rmtree(store_dir)
    res = api.launch(cfg, detach=False, provision=True)
    if res.get("returncode") != 0:
        raise RuntimeError(f"bench run {cfg.run_name} failed: see {cfg.run_uri}/logs")
    return api.events(cfg.run_uri)


def _first(evs: list[Event], type_: str, after: float, **match: Any) -> Event:
    for e in evs:
        if e["type"] == type_ and e["time"] >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    raise LookupError(f"no {type_} event after {after}")


# --- 1. recovery -------------------------------------------------------------------------------


def _start(cfg: Config) -> dict[str, Any]:
    from training import api

    store_dir = Path(cfg.run_uri)
    if store_dir.exists():
        shutil.rmtree(store_dir)
    return dict(api.launch(cfg, detach=True, provision=True))


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"bench: timed out waiting for {what}")


def _end(handle: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    from training import api

    st = _wait(
        lambda: (s := api.job_state(handle)) and s["state"] in ("finished", "failed") and s, timeout, "the job's end"
    )
    pid = int(handle["controller_pid"])
    _wait(lambda: _gone(pid), 60, "the local slice to exit")
    if st["state"] != "finished":
        raise RuntimeError(f"bench run {handle['run_uri']} {st['state']}: {st.get('reason')}")
    return dict(st["status"])


def _gone(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return True


# The lost-host jobs: long enough to lose a host in steady state (every agent's next worker warm, STEADY_S
# after the first step), saving every SAVE_EVERY steps.  The warm-up runs have the same steps: the learning
# rate schedule is part of the compiled step.
LOSE_STEPS, SAVE_EVERY, STEADY_S = 300, 25, 8.0


def _lose_host(ws: Path, name: str, which: str, wait_ahead: bool = False, **kw: Any) -> dict[str, Any]:
    """One job on 2 hosts in steady state; then the leader's host, or the other one, is lost (agent and worker).

    ``wait_ahead``: and not before process 0 has compiled the 1-host step ahead.
    """
    from training import api
    from training.elastic.capacity import LocalCapacity
    from training.elastic.rendezvous import Rendezvous
    from training.storage import open_store

    cfg = _cfg(ws, name, steps=LOSE_STEPS, checkpoint_every=SAVE_EVERY, min_workers=1, **kw)
    handle = _start(cfg)
    first = _wait(lambda: api.events(cfg.run_uri, ("resumed",)), 300, "the first step")[0]
    _wait(lambda: time.time() - first["time"] >= STEADY_S, 60, "steady state")
    if wait_ahead:
        _wait(
            lambda: (
                api.events(cfg.run_uri, ("compiled_ahead",)) or api.job_state(handle)["state"] in ("finished", "failed")
            ),
            300,
            "the step compiled ahead",
        )
        if not api.events(cfg.run_uri, ("compiled_ahead",)):
            raise RuntimeError(f"bench run {name}: the job ended before its 1-host step was compiled ahead")
    st = _wait(lambda: (s := api.status(cfg.run_uri)) and (s.get("step") or 0) >= SAVE_EVERY and s, 300, "a save")
    leader = st["leader"]
    records = Rendezvous(open_store(cfg.run_uri)).hosts()
    victim = leader if which == "leader" else next(h for h in records if h != leader)
    # The pool loses that host, by name: shrunk by number, the local slice would stop its newest host,
    # and a lost leader would be two hosts lost at once.
    LocalCapacity(open_store(cfg.run_uri), default=WORKERS).leave(victim, reason="bench: the host is gone")
    t_kill = time.time()
    os.killpg(os.getpgid(records[victim].pid), signal.SIGKILL)
    _end(handle)
    evs = api.events(cfg.run_uri)
    fail = _first(evs, "failure", t_kill)
    launch = _first(evs, "launch", t_kill)
    rnd = launch["round"]
    assert rnd is not None, "a launch names its round"
    started = _first(evs, "worker_started", launch["time"], attempt=rnd, process_id=0)
    restore = _first(evs, "restore", launch["time"], attempt=rnd)
    compiled = _first(evs, "compiled", launch["time"], attempt=rnd)
    resumed = _first(evs, "resumed", launch["time"], attempt=rnd)
    steady = _steady_step_time(evs, rnd)
    return {
        "lost": which,
        "restored_step": restore["step"],
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
        "_cfg": cfg,
    }


def _steady_step_time(evs: list[Event], rnd: int) -> float:
    t = sorted((e["step"], e["time"]) for e in evs if e["type"] == "progress" and e.get("attempt") == rnd)
    if len(t) < 4:
        return float("nan")
    (s0, t0), (s1, t1) = t[1], t[-1]
    return float(t1 - t0) / float(max(s1 - s0, 1))


def bench_recovery(ws: Path, repeats: int, ray: bool = True) -> dict[str, Any]:
    """Lost follower host and lost leader host vs a cold start of the same job from the same checkpoint."""
    # Warm the persistent compilation cache for both meshes first (2 hosts, then 1): every measured
    # recovery and cold start then compiles from the cache, as a job that has run before does.
    for n in (WORKERS, WORKERS - 1):
        _run(_cfg(ws, f"warm-{n}", steps=LOSE_STEPS, checkpoint_every=LOSE_STEPS, min_workers=n, max_workers=n))
    follower, leader = [], []
    for i in range(repeats):  # interleaved: drift on the machine falls on both
        follower.append(_lose_host(ws, f"lose-follower-{i}", "follower"))
        leader.append(_lose_host(ws, f"lose-leader-{i}", "leader"))
    colds = [_cold_start(ws, r.pop("_cfg"), r["restored_step"], i) for i, r in enumerate(follower)]
    for r in leader:
        r.pop("_cfg")
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
        r = _lose_host(
            ws,
            f"unseen-{'ahead' if ahead else 'not'}",
            "follower",
            wait_ahead=ahead,
            compile_ahead=ahead,
            compilation_cache=str(cache),
        )
        r.pop("_cfg")
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


def _cold_start(ws: Path, src: Config, step: int, i: int) -> float:
    """A fresh `rtrain train` process of the same job, from the same checkpoint, on the mesh the recovery ended on."""
    from training import api

    cfg = src.model_copy(update={"run_name": f"cold-{i}", "chaos": [], "min_workers": 1, "max_workers": WORKERS - 1})
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


# --- 2. checkpoint overhead ------------------------------------------------------------------


def _window_step_time(evs: list[Event], lo: int, hi: int) -> float:
    t = {e["step"]: e["time"] for e in evs if e["type"] == "progress" and e.get("attempt") == 1}
    return float(t[hi] - t[lo]) / (hi - lo)


def bench_checkpoint_overhead(ws: Path, repeats: int, ks: tuple[int, ...] = (5, 20)) -> dict[str, Any]:
    """Interleaved runs: every K in ``ks``, every ``ks[0]`` in Orbax's format, and a run that saves only at its end."""
    from training.checkpoint.lifecycle import save_costs

    steps, (lo, hi) = STEADY_STEPS, STEADY
    runs: dict[str, dict[str, Any]] = {
        **{str(k): {"checkpoint_every": k} for k in ks},
        "orbax": {"checkpoint_every": ks[0], "checkpoint_format": "ocdbt"},
        "none": {"checkpoint_every": 10_000},
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    pauses, bounds = [], []
    for r in range(repeats):
        for name, kw in runs.items():
            evs = _run(_cfg(ws, f"ckpt-{name}-{r}", steps=steps, **kw))
            times[name].append(_window_step_time(evs, lo, hi))
            costs = save_costs(evs)
            if name in map(str, ks) and costs and costs["paused_s"] is not None and costs["copy_bound_s"] is not None:
                pauses.append(costs["paused_s"])
                bounds.append(costs["copy_bound_s"])
    return {
        "step_s_without": times["none"],
        # The loop's pause per save (median of each run's saves) against the least time copying this
        # process's bytes takes at the host's memory bandwidth.
        "save_pause_s": pauses,
        "copy_bound_s": bounds,
        "per_k": {str(k): {"step_s": times[str(k)]} for k in sorted(ks, reverse=True)},  # the figure first
        # The same cadence as ks[0] in Orbax's format (OCDBT): what the default lean format saves.
        "orbax": {"every": ks[0], "step_s": times["orbax"]},
    }


# --- 3. cost of resilience ---------------------------------------------------------------------


def plain_loop() -> int:
    """A minimal multi-process JAX loop: the same model, loss, optimizer, data and mesh; nothing else.

    Written against the task and optax directly (no Trainer, no agent, no checkpoints, no events,
    no learning-rate scale or notice flags), as a user would write it by hand.
    """
    import flax.linen as nn
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    cfg = load_config("tiny", None, json.loads(os.environ["BENCH_CFG"]))
    n, pid = int(os.environ["BENCH_N"]), int(os.environ["BENCH_PID"])
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(cfg.compilation_cache))
    jax.distributed.initialize(os.environ["BENCH_COORD"], n, pid)
    from training.elastic.cpu_slice import TransportThreads

    transport = TransportThreads()  # before the backend starts: gloo's threads come with it
    from training.data import pipeline
    from training.mesh import LOGICAL_RULES, build_mesh, plan_mesh
    from training.optim import make_optimizer
    from training.ready import wait_ready
    from training.tasks import load_task
    from training.trainer import state_shardings

    task = load_task(cfg)
    mesh = build_mesh(plan_mesh(cfg, n))
    if os.environ.get("BENCH_LOWER") == "1":  # as the engine's workers do, once the backend started
        transport.lower()
    tx = make_optimizer(cfg)
    layout = state_shardings(task, tx, mesh)
    param_sh, opt_sh = layout.param_shardings, layout.opt_shardings
    batch_sh = NamedSharding(mesh, P(("data", "fsdp")))
    spec = task.example_spec()
    fields = list(spec)

    def init(key: jax.Array) -> Any:
        params = nn.unbox(task.init(key))
        return params, tx.init(params)

    def step(params: Any, opt_state: Any, batch: Any, key: jax.Array) -> Any:
        (loss, _), grads = jax.value_and_grad(task.loss, has_aux=True)(params, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):  # the model's activation constraints
        params, opt_state = jax.jit(init, out_shardings=(param_sh, opt_sh))(jax.random.key(cfg.seed))
        shapes = {
            k: jax.ShapeDtypeStruct((cfg.global_batch, *s.shape), np.dtype(s.dtype), sharding=batch_sh)
            for k, s in spec.items()
        }
        jstep = (
            jax.jit(step, out_shardings=(param_sh, opt_sh, NamedSharding(mesh, P())), donate_argnums=(0, 1))
            .lower(params, opt_state, shapes, jax.random.key(cfg.seed + 1))
            .compile()
        )
    batches = pipeline.batches(
        task.data().train, seed=cfg.seed, global_batch=cfg.global_batch, process_index=pid, process_count=n
    )
    key = jax.random.key(cfg.seed + 1)
    # No host sync per step (the engine reads each step's metrics one step late, so the device runs
    # ahead): the loop waits for the device only at the window's two ends, where it is timed.
    window = {int(x) for x in os.environ["BENCH_WINDOW"].split(",")}
    poll = os.environ.get("BENCH_POLL") == "1"  # wait for each step as the engine does (training.ready)
    times, before = [], None
    for i in range(1, cfg.steps + 1):
        local = next(batches)
        batch = {
            k: jax.make_array_from_process_local_data(batch_sh, local[k], (cfg.global_batch, *local[k].shape[1:]))
            for k in fields
        }
        params, opt_state, loss = jstep(params, opt_state, batch, key)
        if poll and before is not None:
            wait_ready([before])  # the step before this one, as the engine reads its metrics
        before = loss
        if i in window:
            if poll:
                wait_ready([loss, *jax.tree.leaves(params)])
            jax.block_until_ready((params, loss))
        times.append(time.time())
    if pid == 0:
        print(json.dumps({"times": times}), flush=True)
    return 0


def model_flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token of the built-in model: 6 x parameters (matmuls, forward and backward)
    plus the attention scores' 12 x layers x width x sequence length."""
    from training.mesh import param_count

    n = param_count(cfg) - cfg.vocab_size * cfg.d_model  # the embedding lookup is no matmul
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * cfg.seq_len


def matmul_flops_per_s() -> float:
    """The FLOP/s a large float32 matmul reaches on this machine's CPU (all cores): the peak for MFU."""
    code = (
        "import time,json,jax,jax.numpy as jnp; n=2048; a=jnp.ones((n,n),jnp.float32);"
        "f=jax.jit(lambda x:x@x); f(a).block_until_ready(); best=1e9\n"
        "for _ in range(5):\n t=time.perf_counter(); f(a).block_until_ready(); best=min(best,time.perf_counter()-t)\n"
        "print(json.dumps(2*n**3/best))"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _plain_times(cfg: Config, window: tuple[int, ...], lower: bool, poll: bool = False) -> list[float]:
    """Run the plain loop on ``WORKERS`` processes; process 0's end time of each step.

    ``lower``: the loop lowers its collectives' transport threads as the engine's workers do.
    ``poll``: it waits for each step the engine's way (sleeping between looks), not in JAX's wait.
    """
    from training.elastic.supervisor import free_port

    over = {k: v for k, v in cfg.model_dump().items() if k in ("dataset", "compilation_cache", "steps")}
    port = free_port()
    procs = []
    for pid in range(WORKERS):
        env = {
            **os.environ,
            "BENCH_CFG": json.dumps(over),
            "BENCH_N": str(WORKERS),
            "BENCH_PID": str(pid),
            "BENCH_COORD": f"127.0.0.1:{port}",
            "BENCH_WINDOW": ",".join(map(str, window)),
            "BENCH_LOWER": "1" if lower else "0",
            "BENCH_POLL": "1" if poll else "0",
            "JAX_PLATFORMS": "cpu",
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            "XLA_FLAGS": cpu_xla_flags(cfg.devices_per_worker),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.bench", "plain"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    return [float(t) for t in json.loads(outs[0].strip().splitlines()[-1])["times"]]


def bench_cost(ws: Path, repeats: int) -> dict[str, Any]:
    """Tokens/s of the engine against a hand-written ``jit`` loop (same model, loss, optimizer, data and mesh;
    no agent, no checkpoints, no events) in steady state; a round's first steps (each host's next standby
    warming up on the same cores) reported apart; and MFU against a large matmul's FLOP/s here.

    The figure's plain loop waits for each step as the engine does (sleeping between looks,
    ``training.ready``) and lowers its collectives' transport threads as the engine does: the ratio
    compares the loops, not the waits or the thread priorities.  Beneath it, weaker baselines: the
    same loop waiting in JAX's blocking wait, and that loop with gloo's threads as they come.

    The engine runs with its default ``log_every`` (a progress event every 10 steps; the windows' ends
    are multiples of it), not the other figures' 1: an event and a status write per step cost its
    agents and the local slice 3.6 ms of CPU a step more on these two cores, which the steps share."""
    steps, (lo, hi), (flo, fhi) = STEADY_STEPS, STEADY, FIRST_STEPS
    tok = 16 * 64

    def rate(times: list[float], a: int, b: int) -> float:  # times[i] ends step i+1, as the progress event i+1
        return tok / ((times[b - 1] - times[a - 1]) / (b - a))

    engine, unsaved, plain, as_is, polled, engine_first, plain_first = [], [], [], [], [], [], []
    for r in range(repeats):
        cfg = _cfg(ws, f"cost-{r}", steps=steps, checkpoint_every=10, log_every=LOG_EVERY)
        evs = _run(cfg)
        engine.append(tok / _window_step_time(evs, lo, hi))
        engine_first.append(tok / _window_step_time(evs, flo, fhi))
        # The same engine with no save in the window: what the engine's own machinery costs.
        quiet = _cfg(ws, f"cost-unsaved-{r}", steps=steps, checkpoint_every=steps, log_every=LOG_EVERY)
        unsaved.append(tok / _window_step_time(_run(quiet), lo, hi))
        times = _plain_times(cfg, (flo, fhi, lo, hi), lower=True, poll=True)
        polled.append(rate(times, lo, hi))
        plain_first.append(rate(times, flo, fhi))
        plain.append(rate(_plain_times(cfg, (lo, hi), lower=True), lo, hi))
        as_is.append(rate(_plain_times(cfg, (lo, hi), lower=False), lo, hi))
    cfg = _cfg(ws, "cost-0")
    return {
        "devices": WORKERS * cfg.devices_per_worker,
        "model_flops_per_token": model_flops_per_token(cfg),
        "matmul_flops_per_s": matmul_flops_per_s(),
        "engine_tokens_per_s": engine,
        "engine_without_saves_tokens_per_s": unsaved,
        # The figure's baseline: the plain loop waiting for each step as the engine does.
        "plain_polled_tokens_per_s": polled,
        # Weaker baselines: the plain loop in JAX's blocking wait; and with gloo's threads at their priority.
        "plain_tokens_per_s": plain,
        "plain_as_is_tokens_per_s": as_is,
        # The round's first steps, while the standbys warm up beside them: a cost paid once a round.
        "engine_first_steps_tokens_per_s": engine_first,
        "plain_first_steps_tokens_per_s": plain_first,
        "windows": {"steady": list(STEADY), "first_steps": list(FIRST_STEPS)},
    }


# --- 4. restore throughput -----------------------------------------------------------------------


def bench_restore(ws: Path, repeats: int) -> dict[str, Any]:
    """Restore throughput against a raw sequential read of the same files, for each checkpoint format.

    The figure reads the default (lean) format's step whole onto one device, as audits and
    validation do.  Beside it: a worker's restore of the same step onto the trainer's own layout,
    Orbax's format, and tensorstore alone reading its arrays, on the same state.
    """
    shape = {"d_model": 512, "n_layers": 4, "d_ff": 2048, "n_heads": 8}
    one = {"min_workers": 1, "max_workers": 1, "devices_per_worker": 1}
    steps: dict[str, Path] = {}
    for fmt in ("lean", "ocdbt"):
        cfg = _cfg(ws, f"restore-{fmt}", steps=1, checkpoint_every=1, checkpoint_format=fmt, **shape, **one)
        _run(cfg)
        steps[fmt] = Path(cfg.run_uri) / "checkpoints" / "1"
    # Each read is timed in a process of its own, after the same start: the libraries imported, JAX's
    # backend up, the step's files evicted from the page cache (no root needed) and a moment to settle.
    cold = (
        "import os,sys,time,json,pathlib; import jax; jax.devices()\n"
        "for p in pathlib.Path(sys.argv[1]).rglob('*'):\n"
        " if p.is_file():\n"
        "  fd=os.open(p,os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)\n"
        "time.sleep(0.5); t=time.time()\n"
    )
    # The figure: the whole state read onto one device (what audits and validation read), as this
    # figure has always measured.  Beside it, a worker's restore: the same state as the trainer lays
    # it out, copied into buffers the device owns (its step donates them).
    setup = (
        "from training.checkpoint import manager as ckpt; from training.config import config_from_json;"
        "from training.mesh import build_mesh, plan_mesh; from training.tasks import load_task;"
        "from training.trainer import Trainer; import sys\n"
        "cfg=config_from_json(open(sys.argv[2]+'/config.json').read()); m=ckpt.checkpoint_manager(cfg, sys.argv[2])\n"
        "abstract=Trainer(cfg, build_mesh(plan_mesh(cfg, 1)), load_task(cfg)).abstract\n"
    )
    worker = setup + cold + "s,_=ckpt.restore(m,1,abstract); jax.block_until_ready(s); print(json.dumps(time.time()-t))"
    code = (
        "from training.checkpoint.manager import load_state_host\n"
        + cold
        + "s=load_state_host(sys.argv[2],1); jax.block_until_ready(s); print(json.dumps(time.time()-t))"
    )
    raw = (
        cold + "for p in sorted(pathlib.Path(sys.argv[1]).rglob('*')):\n"
        " if p.is_file():\n"
        "  with open(p,'rb') as f:\n"
        "   while f.read(1<<22): pass\n"
        "print(json.dumps(time.time()-t))"
    )

    # The same arrays read by tensorstore alone, through Orbax's own tensorstore context: the most a
    # restore through Orbax can get (it adds reading its metadata, allocating and placing on devices).
    alone = (
        "import asyncio; import tensorstore as ts;"
        "from orbax.checkpoint._src.serialization.tensorstore_utils import get_ts_context\n"
        + cold
        + "base={'driver':'ocdbt','base':'file://'+sys.argv[2]};"
        "keys=[k.decode() for k in ts.KvStore.open(base).result().list().result()];"
        "arrays=[(k.rsplit('/',1)[0], 'zarr3' if k.endswith('zarr.json') else 'zarr') for k in keys"
        " if k.endswith(('/.zarray','/zarr.json'))]; ctx=get_ts_context(use_ocdbt=True)\n"
        "async def one(p,d):\n"
        " s=await ts.open({'driver':d,'kvstore':{**base,'path':p+'/'}},open=True,context=ctx); return await s.read()\n"
        "async def all_():\n return await asyncio.gather(*[one(p,d) for p,d in arrays])\n"
        "out=asyncio.run(all_()); print(json.dumps([time.time()-t, sum(a.nbytes for a in out)]))"
    )

    def timed(script: str, step: Path, *args: str) -> Any:
        out = subprocess.run(
            [sys.executable, "-c", script, str(step), *args],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    files = {fmt: [p for p in d.rglob("*") if p.is_file()] for fmt, d in steps.items()}
    nbytes = {fmt: sum(p.stat().st_size for p in fs) for fmt, fs in files.items()}
    mbps: dict[str, list[float]] = {k: [] for k in ("lean", "raw", "worker", "orbax", "orbax_raw", "ts_alone")}
    for _ in range(repeats):
        for fmt, key in (("lean", "lean"), ("ocdbt", "orbax")):
            mbps[key].append(nbytes[fmt] / timed(code, steps[fmt], str(steps[fmt].parents[1])) / 1e6)
            mbps["raw" if fmt == "lean" else "orbax_raw"].append(nbytes[fmt] / timed(raw, steps[fmt]) / 1e6)
        mbps["worker"].append(nbytes["lean"] / timed(worker, steps["lean"], str(steps["lean"].parents[1])) / 1e6)
        seconds, read = timed(alone, steps["ocdbt"], str(steps["ocdbt"] / "state"))
        if read < 0.95 * nbytes["ocdbt"]:  # it must have read the arrays, all of them
            raise RuntimeError(f"tensorstore read {read} bytes of a {nbytes['ocdbt']}-byte checkpoint")
        mbps["ts_alone"].append(nbytes["ocdbt"] / seconds / 1e6)
    return {
        "bytes": nbytes["lean"],
        "restore_MBps": mbps["lean"],
        "raw_read_MBps": mbps["raw"],
        "worker_restore_MBps": mbps["worker"],
        "orbax_bytes": nbytes["ocdbt"],
        "orbax_restore_MBps": mbps["orbax"],
        "orbax_raw_read_MBps": mbps["orbax_raw"],
        "tensorstore_alone_MBps": mbps["ts_alone"],
        "target": ">= 0.5",
        "note": "same state in each format, same disk; each read is timed in a fresh process, its files evicted",
    }


# --- 5. the local tier ---------------------------------------------------------------------------


def _recovered(evs: list[Event]) -> Event:
    return _first(evs, "recovered", 0.0)


def bench_local_tier(ws: Path, repeats: int) -> dict[str, Any]:
    """Local copies every 2 steps: their cost in steady state, and the steps they save after a lost host."""
    steps, (lo, hi) = LOCAL_STEADY_STEPS, LOCAL_STEADY
    with_local: list[float] = []
    without: list[float] = []
    for r in range(repeats):  # A B A B
        for every, out in ((2, with_local), (0, without)):
            cfg = _cfg(ws, f"local-{every}-{r}", steps=steps, checkpoint_every=10_000, local_checkpoint_every=every)
            out.append(_window_step_time(_run(cfg), lo, hi))
    # One host of two is lost at step 17; persistent checkpoints every 10 steps.
    lost: dict[int, list[int]] = {2: [], 0: []}
    recovery_s: dict[int, list[float]] = {2: [], 0: []}
    notice: list[dict[str, Any]] = []
    for r in range(repeats):
        for every in lost:
            cfg = _cfg(
                ws,
                f"local-lost-{every}-{r}",
                steps=24,
                checkpoint_every=10,
                local_checkpoint_every=every,
                min_workers=1,
                chaos=["preempt:worker=1,step=17"],
            )
            rec = _recovered(_run(cfg))
            lost[every].append(int(rec["steps_lost"]))
            recovery_s[every].append(float(rec["seconds"]))
        cfg = _cfg(
            ws,
            f"local-notice-{r}",
            steps=24,
            checkpoint_every=10,
            local_checkpoint_every=2,
            min_workers=1,
            chaos=["preempt_notice:worker=1,step=17"],
        )
        evs = _run(cfg)
        ev = _first(evs, "preemption_notice", 0.0)
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


# --- main -----------------------------------------------------------------------------------

# --- 6. the service: a priority change moves hosts, and the ETA of a job shrunk and grown back ----------


def bench_service(ws: Path, repeats: int) -> dict[str, Any]:
    """The service's figures, once a repeat (:func:`service_once`)."""
    return {"runs": [service_once(ws, i) for i in range(repeats)], "target": "<= 0.15", "moved_target": "<= 1.0"}


def service_once(ws: Path, i: int = 0) -> dict[str, Any]:
    """A low-priority job on a pool of 4 hosts; a queued job's priority is raised, so it takes the whole pool.

    Measured: the seconds from the priority change to the low job's hosts freed
    (its notices committed) and to the other job's first step; the low job's ETA
    as ``rtrain queue`` gives it right after the change (it is queued, then grown
    back) against when it really finished: |predicted - actual| / actual, over the
    time that was left.
    """
    from training import api
    from training.service import commands
    from training.service.queue import Queue

    root = ws / f"service-{i}"  # each repeat's runs kept apart: their events replay the forecast
    if root.exists():
        shutil.rmtree(root)
    every = 10
    common = {"root": str(root), "checkpoint_every": every, "max_workers": 4}
    low = _cfg(ws, "svc-low", steps=160, min_workers=2, **common)
    big = _cfg(ws, "svc-big", steps=40, min_workers=4, **common)
    commands.submit(low, "low", pool_hosts=4)
    _wait(lambda: ((api.status(low.run_uri) or {}).get("step") or 0) >= 5, 600, "the low job to train")
    commands.submit(big, "low")  # min 4 does not fit beside the low job's 2: queued
    time.sleep(2.0)
    changed_at = time.time()
    commands.set_priority(str(root), "svc-big", "urgent")
    _wait(lambda: Queue(str(root)).placement("svc-big").job, 120, "the urgent job's launch")
    predicted_at = time.time()  # the view reads each run's state from here on
    queue = commands.view(str(root)).rows
    row = next(r for r in queue if r.run == "svc-low")
    predicted_end = predicted_at + float(row.eta_s or 0.0)
    _wait(lambda: (api.status(low.run_uri) or {}).get("state") in ("finished", "failed"), 1200, "the low job's end")
    evs = api.events(low.run_uri)
    big_evs = api.events(big.run_uri)
    freed = max(e["time"] for e in evs if e["type"] == "preemption_notice")
    big_first = min(e["time"] for e in big_evs if e["type"] == "resumed")
    ended = max(e["time"] for e in evs if e["type"] in ("finished", "failed"))
    step_s = _steady_step_time(evs, 1)
    error = abs(predicted_end - ended) / max(ended - predicted_at, 1e-9)
    bound = every * step_s + max(float(e.get("seconds") or 0) for e in evs if e["type"] == "preemption_notice")
    return {
        "eta_error": error,
        "eta_predicted_s": predicted_end - predicted_at,
        "eta_actual_s": ended - predicted_at,
        "eta_assumptions": list(row.eta_notes),
        "predicted_at": predicted_at,
        "queue_at_prediction": [r.to_dict() for r in queue],  # with the runs' events, a replay of the forecast
        "priority_to_hosts_freed_s": freed - changed_at,
        "priority_to_first_step_s": big_first - changed_at,
        "hosts_moved_bound_s": bound,
    }


# --- 7. the control plane ----------------------------------------------------------------------

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
    from training.cadence import billed, cadence, steady_ops

    sink = ws / f"ops-{kind}"
    shutil.rmtree(sink, ignore_errors=True)
    cfg = _cfg(ws, f"cp-{kind}", root=root, steps=100_000, checkpoint_every=100_000, log_every=10)
    if kind == "local":
        shutil.rmtree(Path(cfg.run_uri), ignore_errors=True)
    os.environ[OPS_ENV] = str(sink)
    try:
        handle: dict[str, Any] = dict(api.launch(cfg, detach=True, provision=True))
    finally:
        os.environ.pop(OPS_ENV, None)
    try:
        _wait(lambda: ((api.status(cfg.run_uri) or {}).get("step") or 0) >= 20, 600, "steady training")
        t0, before = time.monotonic(), _tallies(sink)
        time.sleep(window_s)
        t1, after = time.monotonic(), _tallies(sink)
        step = (api.status(cfg.run_uri) or {}).get("step")
    finally:
        api.stop_job(cfg.run_uri, "the bench's window is over")
        _wait(lambda: _gone(int(handle["controller_pid"])), 120, "the job to stop")
    per_min = 60.0 / (t1 - t0) / WORKERS
    agents = {pid: c for role in ("agent", "worker") for pid, c in after.get(role, {}).items()}
    agents_before = {pid: c for role in ("agent", "worker") for pid, c in before.get(role, {}).items()}
    measured = billed({op: n * per_min for op, n in _ops_by_op(agents_before, agents, True).items()})
    other = billed({op: n * per_min for op, n in _ops_by_op(agents_before, agents, False).items()})
    model = steady_ops(cadence(WORKERS, kind == "gcs", cfg.heartbeat_s, cfg.lease_s))
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


FIGURES = (
    "recovery",
    "checkpoint_overhead",
    "cost_of_resilience",
    "restore_throughput",
    "local_tier",
    "service",
    "control_plane",
    "accelerator",
    "formats",
)


def cpu_counters() -> tuple[int, int] | None:
    """(steal, all) CPU time of this machine so far, in clock ticks (Linux); None where unknown."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time a virtual machine's host gave to others between two readings (None: unknown).

    A figure measured while it was high is a figure of a busy neighbour as much as of this code.
    """
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def figure_runs(
    ws: Path, repeats: int, quick: bool, formats_mib: list[int] | None = None
) -> dict[str, Callable[[], dict[str, Any]]]:
    """Each figure's measurement, by name, every one repeated ``repeats`` times (``formats_mib``: the formats
    figure's state sizes)."""
    return {
        "recovery": lambda: bench_recovery(ws, repeats, ray=not quick),
        "checkpoint_overhead": lambda: bench_checkpoint_overhead(ws, repeats),
        "cost_of_resilience": lambda: bench_cost(ws, repeats),
        "restore_throughput": lambda: bench_restore(ws, repeats),
        "local_tier": lambda: bench_local_tier(ws, repeats),
        "service": lambda: bench_service(ws, repeats),
        "control_plane": lambda: bench_control_plane(ws, repeats, 10.0 if quick else OPS_WINDOW_S),
        "accelerator": lambda: _accelerator(repeats, quick),
        "formats": lambda: _formats(repeats, quick, formats_mib),
    }


def _accelerator(repeats: int, quick: bool) -> dict[str, Any]:
    """The accelerator row (``benchmarks/accelerator.py``): the built-in Llama on this JAX backend."""
    from benchmarks.accelerator import bench_accelerator

    return bench_accelerator(repeats, quick)


def _formats(repeats: int, quick: bool, sizes_mib: list[int] | None) -> dict[str, Any]:
    """The format row (``benchmarks/formats.py``): lean against Orbax's OCDBT, locally and on gs:// (the emulator)."""
    from benchmarks.formats import bench_formats

    return bench_formats(repeats, quick, sizes_mib)


def main(args: argparse.Namespace) -> int:
    from training import data

    repeats = args.repeats if args.repeats is not None else 1 if args.quick else 3
    only = set(args.only or FIGURES)
    unknown = only - set(FIGURES)
    if unknown:
        raise ValueError(f"--only: unknown figure(s) {sorted(unknown)}; known: {', '.join(FIGURES)}")
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, not {repeats}")
    formats_mib = getattr(args, "formats_mib", None)
    if formats_mib and min(formats_mib) < 1:
        raise ValueError(f"--formats-mib must be at least 1, not {min(formats_mib)}")
    ws = Path("var/bench").resolve()
    ws.mkdir(parents=True, exist_ok=True)
    data.prepare(None, str(ws / "data"), 64, max_bytes=2_000_000)
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "workers": WORKERS, "devices_per_worker": 2},
        "repeats": repeats,
        "time": time.time(),
    }
    runs = figure_runs(ws, repeats, args.quick, formats_mib)
    for name in FIGURES:
        if name not in only:
            continue
        print(f"[bench] {name} ...", flush=True)
        before = cpu_counters()
        results[name] = summarise(name, runs[name](), steal_fraction(before, cpu_counters()))
        ratio, target = results[name]["ratio"], results[name]["target"]
        said = f"ratio {ratio_text(ratio).strip()} (target {target})" if ratio is not None else "not measured"
        print(f"[bench] {name}: {said}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(format_table(results))
    print(f"wrote {out}")
    return 0


def summarise(name: str, result: dict[str, Any], steal: float | None) -> dict[str, Any]:
    """A figure's result with its rows (each ratio's median, minimum and maximum over the repeats), its
    headline ratio and target (its first row with a ratio; None where no row has one), and the CPU steal
    while it was measured."""
    rows = rows_of(name, result)
    head = next((r for r in rows if r["ratio"] is not None), None)
    ratio, target = (head["ratio"], head["target"]) if head is not None else (None, "")
    return {**result, "ratio": ratio, "target": target, "table_rows": rows, "cpu_steal": steal}


def format_table(r: dict[str, Any]) -> str:
    """The table of every figure in ``r`` (as :func:`main` writes it), in the order of :data:`FIGURES`."""
    names = [name for name in FIGURES if name in r]
    rows = [row for name in names for row in r[name]["table_rows"]]
    return format_rows(r["repeats"], rows, {name: r[name].get("cpu_steal") for name in names})


if __name__ == "__main__" and sys.argv[1:] == ["plain"]:
    sys.exit(plain_loop())
