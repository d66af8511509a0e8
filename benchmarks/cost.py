"""The cost of resilience: the engine against a hand-written ``jit`` loop on the same model, data and mesh; MFU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.checkpoints import CKPT_PRESET, REALISTIC_STEP_S, preset_dataset
from benchmarks.jobs import (
    FIRST_STEPS,
    LOG_EVERY,
    STEADY,
    STEADY_STEPS,
    WORKERS,
    bench_cfg,
    run_job,
    window_step_time,
)
from training.config import Config, load_config
from training.cpu_devices import cpu_process_env
from training.sections import ModelSection, OptimizerSection


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

    cfg = load_config(os.environ.get("BENCH_PRESET", "tiny"), None, json.loads(os.environ["BENCH_CFG"]))
    n, pid = int(os.environ["BENCH_N"]), int(os.environ["BENCH_PID"])
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(cfg.placement.compilation_cache))
    jax.distributed.initialize(os.environ["BENCH_COORD"], n, pid)
    from training.elastic.worker.cpu_slice import TransportThreads

    transport = TransportThreads()  # before the backend starts: gloo's threads come with it
    from training.data import pipeline
    from training.mesh import LOGICAL_RULES, build_mesh, plan_mesh
    from training.optim import make_optimizer
    from training.tasks import load_task
    from training.trainer import state_shardings

    task = load_task(cfg)
    mesh = build_mesh(plan_mesh(cfg.placement, n))
    if os.environ.get("BENCH_LOWER") == "1":  # as the engine's workers do, once the backend started
        transport.lower()
    tx = make_optimizer(cfg.optimizer)
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
        params, opt_state = jax.jit(init, out_shardings=(param_sh, opt_sh))(jax.random.key(cfg.optimizer.seed))
        shapes = {
            k: jax.ShapeDtypeStruct((cfg.optimizer.global_batch, *s.shape), np.dtype(s.dtype), sharding=batch_sh)
            for k, s in spec.items()
        }
        jstep = (
            jax.jit(step, out_shardings=(param_sh, opt_sh, NamedSharding(mesh, P())), donate_argnums=(0, 1))
            .lower(params, opt_state, shapes, jax.random.key(cfg.optimizer.seed + 1))
            .compile()
        )
    batches = pipeline.batches(
        task.data().train,
        seed=cfg.optimizer.seed,
        global_batch=cfg.optimizer.global_batch,
        process_index=pid,
        process_count=n,
    )
    times = _timed_steps(cfg.optimizer, jstep, (params, opt_state), batches, batch_sh, fields)
    if pid == 0:
        print(json.dumps({"times": times}), flush=True)
    return 0


def _timed_steps(
    optimizer: OptimizerSection, jstep: Any, state: tuple[Any, Any], batches: Any, batch_sh: Any, fields: list[str]
) -> list[float]:
    """The plain loop's steps: each step's end time (the device waited for only at the window's ends)."""
    import jax

    from training.ready import wait_ready

    params, opt_state = state
    key = jax.random.key(optimizer.seed + 1)
    # No host sync per step (the engine reads each step's metrics one step late, so the device runs
    # ahead): the loop waits for the device only at the window's two ends, where it is timed.
    window = {int(x) for x in os.environ["BENCH_WINDOW"].split(",")}
    poll = os.environ.get("BENCH_POLL") == "1"  # wait for each step as the engine does (training.ready)
    times, before = [], None
    for i in range(1, optimizer.steps + 1):
        local = next(batches)
        batch = {
            k: jax.make_array_from_process_local_data(batch_sh, local[k], (optimizer.global_batch, *local[k].shape[1:]))
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
    return times


def model_flops_per_token(model: ModelSection) -> float:
    """Training FLOPs per token of the built-in model: 6 x parameters (matmuls, forward and backward)
    plus the attention scores' 12 x layers x width x sequence length.

    The embedding lookup is no matmul, but the output head is one: an untied model's embedding is left out
    of the parameters; a tied model's one matrix is the head's matmul too, so it stays in.
    """
    from training.mesh import param_count

    lookup = 0 if model.tie_embeddings else model.vocab_size * model.d_model
    return 6.0 * (param_count(model) - lookup) + 12.0 * model.n_layers * model.d_model * model.seq_len


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
    from training.elastic.host.supervisor import free_port

    over = {
        "data": {"dataset": cfg.data.dataset},
        "placement": {"compilation_cache": cfg.placement.compilation_cache},
        "optimizer": {"steps": cfg.optimizer.steps},
    }
    port = free_port()
    procs = []
    for pid in range(WORKERS):
        env = {
            **os.environ,
            "BENCH_CFG": json.dumps(over),
            "BENCH_PRESET": cfg.preset,
            "BENCH_N": str(WORKERS),
            "BENCH_PID": str(pid),
            "BENCH_COORD": f"127.0.0.1:{port}",
            "BENCH_WINDOW": ",".join(map(str, window)),
            "BENCH_LOWER": "1" if lower else "0",
            "BENCH_POLL": "1" if poll else "0",
            **cpu_process_env(cfg.placement.devices_per_worker),  # as the engine's workers: a fair baseline
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.cost", "plain"],
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
    no agent, no checkpoints, no events) in steady state, at a realistic step (the ``small`` preset, as the
    checkpoint rows); a round's first steps (each host's next standby warming up on the same cores) reported
    apart; the same pair on the tiny model, whose steps are shorter than a save's fixed CPU; and MFU against a
    large matmul's FLOP/s here.

    The figure's plain loop waits for each step as the engine does (sleeping between looks,
    ``training.ready``) and lowers its collectives' transport threads as the engine does: the ratio
    compares the loops, not the waits or the thread priorities.  Beneath it, weaker baselines: the
    same loop waiting in JAX's blocking wait, and that loop with gloo's threads as they come.

    The engine runs with its default ``log_every`` (a progress event every 10 steps; the windows' ends
    are multiples of it), not the other figures' 1: an event and a status write per step cost its
    agents and the local slice 3.6 ms of CPU a step more on these two cores, which the steps share."""
    steps, (lo, hi), (flo, fhi) = STEADY_STEPS, STEADY, FIRST_STEPS
    realistic = {"preset": CKPT_PRESET, "dataset": preset_dataset(ws, CKPT_PRESET)}
    cfg = bench_cfg(ws, "cost-0", **realistic)
    tok = cfg.optimizer.global_batch * cfg.model.seq_len

    def rate(times: list[float], a: int, b: int, per_step: int = tok) -> float:  # times[i] ends step i+1
        return per_step / ((times[b - 1] - times[a - 1]) / (b - a))

    engine, unsaved, plain, as_is, polled, engine_first, plain_first, step_s = [], [], [], [], [], [], [], []
    tiny_engine, tiny_polled = [], []
    for r in range(repeats):
        cfg = bench_cfg(ws, f"cost-{r}", **realistic, steps=steps, checkpoint_every=10, log_every=LOG_EVERY)
        evs = run_job(cfg)
        step_s.append(window_step_time(evs, lo, hi))
        engine.append(tok / step_s[-1])
        engine_first.append(tok / window_step_time(evs, flo, fhi))
        # The same engine with no save in the window: what the engine's own machinery costs.
        quiet = bench_cfg(
            ws, f"cost-unsaved-{r}", **realistic, steps=steps, checkpoint_every=steps, log_every=LOG_EVERY
        )
        unsaved.append(tok / window_step_time(run_job(quiet), lo, hi))
        times = _plain_times(cfg, (flo, fhi, lo, hi), lower=True, poll=True)
        polled.append(rate(times, lo, hi))
        plain_first.append(rate(times, flo, fhi))
        plain.append(rate(_plain_times(cfg, (lo, hi), lower=True), lo, hi))
        as_is.append(rate(_plain_times(cfg, (lo, hi), lower=False), lo, hi))
        # The tiny model at the same cadence: its ~65 ms steps are shorter than Orbax's fixed CPU per save.
        tiny = bench_cfg(ws, f"cost-tiny-{r}", steps=steps, checkpoint_every=10, log_every=LOG_EVERY)
        tiny_tok = tiny.optimizer.global_batch * tiny.model.seq_len
        tiny_engine.append(tiny_tok / window_step_time(run_job(tiny), lo, hi))
        tiny_polled.append(rate(_plain_times(tiny, (lo, hi), lower=True, poll=True), lo, hi, tiny_tok))
    return {
        "preset": CKPT_PRESET,
        "step_s": step_s,
        "realistic_step_s": REALISTIC_STEP_S,
        "devices": WORKERS * cfg.placement.devices_per_worker,
        "model_flops_per_token": model_flops_per_token(cfg.model),
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
        # The tiny model, engine and plain loop given the same wait: the same cadence at a step too short.
        "tiny_engine_tokens_per_s": tiny_engine,
        "tiny_plain_polled_tokens_per_s": tiny_polled,
        "windows": {"steady": list(STEADY), "first_steps": list(FIRST_STEPS)},
    }


if __name__ == "__main__" and sys.argv[1:] == ["plain"]:
    sys.exit(plain_loop())
