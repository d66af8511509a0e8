"""Ray Train v2's elastic recovery on our model, data and kill: the other side of ``rtrain bench``'s recovery figure.

A local Ray cluster (``ray.cluster_utils.Cluster``) stands in for the hosts: a
head that trains nothing (it holds the driver, Ray Train's controller and its
helper actors, all zero-CPU) and one worker node per simulated host, each with
one CPU and one ``host`` resource, so that each training worker has a node to
itself.  Ray Train v2's ``JaxTrainer`` runs our train step (``training.trainer``)
on our mesh (``training.mesh``) over our input pipeline (``training.data``),
with ``ScalingConfig(num_workers=(1, hosts))`` (elastic) and
``FailureConfig(max_failures=...)``; it checkpoints with Ray Train's own
mechanism (``ray.train.report`` with a ``Checkpoint``, restored with
``ray.train.get_checkpoint()``), the state saved whole as one ``.npz`` file by
rank 0 and resharded onto whatever mesh the restarted group has.

Why ``JaxTrainer`` and our own ``jax.distributed.initialize``: the JAX backend
of Ray 2.60 (``ray.train.v2.jax.config._JaxBackend.on_start``) returns at once
unless ``use_tpu`` or ``use_gpu`` is set, so on CPU every worker is a
single-process JAX (``jax.process_count() == 1``).  The train loop below starts
``jax.distributed`` itself, with the coordinator address broadcast by Ray
Train's collective (``ray.train.collective.broadcast_from_rank_zero``) and the
same heartbeat and initialisation timeouts as our engine's worker.

The kill: once a worker records step ``kill_at_step``, the host of world rank 1
is lost (a follower: rank 0 hosts the JAX coordinator): its training worker
process is SIGKILLed and its node's Ray processes are killed
(``Cluster.remove_node(allow_graceful=False)``); Ray Train goes on with the
``hosts - 1`` left.  (``kill="worker"`` SIGKILLs the worker process only, and
Ray Train restarts on all ``hosts``.)  Each worker writes a line per event
(start, restored, compiled, each completed step), with its wall clock, to a
file under ``workdir``; the recovery time is from the kill to the first step
completed by a worker group started after it.

Where Ray's time goes (read from its controller's log, Ray 2.60): the
controller notices the failure within its poll interval (2 s), but its elastic
policy sizes the new group from the AutoscalingCoordinator's view of the
cluster, which is refreshed every 20 s (``TICK_INTERVAL_S``, not configurable)
from nodes that GCS marks dead only after its health checks (~15 s by
default).  So the first restart asks for the lost host's worker too and waits
``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` (60 s) for a placement group that
cannot be placed, before it retries with what is left; then a fresh worker
process per host imports everything and starts from the checkpoint.
``tuned=True`` sets what Ray offers (``TUNED_*``); the coordinator's 20 s tick
remains.  And ``ray.train.report`` blocks while the previous report waits for
the controller's poll (a queue of one), so reporting every step paces training
at one step per poll interval (``report_every``).

Import light: nothing here imports Ray or JAX at module level.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from training.cpu_devices import cpu_process_env

REPO_ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"  # the address every Ray node of the bench binds
# Each simulated host is a JAX process with D CPU devices and gloo collectives, as on our local slice.
WORKER_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
}
# What Ray offers to get over a lost node sooner: GCS health checks of the raylets (Ray's system config;
# defaults: first check after 5 s, every 3 s, 10 s timeout, 5 misses), how often Ray Train's controller
# polls its workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, default 2 s) and how long it waits for a new
# worker group's placement group (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, default 60 s).
TUNED_SYSTEM_CONFIG: dict[str, Any] = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
TUNED_TRAIN_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "5",
}
PROGRESS_DIR = "progress"


# --- the train loop (runs in each Ray Train worker) -------------------------------------------


class _Progress:
    """One JSON line per event of this worker (start, restored, step) in its own file under ``workdir``."""

    def __init__(self, directory: str, attempt: str, rank: int) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._f = open(Path(directory) / f"{attempt}-{rank}.jsonl", "a", buffering=1)
        self.attempt = attempt
        self.rank = rank

    def __call__(self, event: str, **fields: Any) -> None:
        self._f.write(
            json.dumps({"event": event, "time": time.time(), "attempt": self.attempt, "rank": self.rank} | fields)
            + "\n"
        )
        self._f.flush()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _save_npz(state: Any, path: Path | None) -> None:
    """The whole state, gathered from every process (a collective: all call it), as one .npz at ``path``.

    Leaves in the abstract state's order (arr_0, arr_1, ...); only the process given a path writes.
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    host = multihost_utils.process_allgather(state, tiled=True)
    if path is not None:
        np.savez(path, *[np.asarray(x) for x in jax.tree.leaves(host)])


def _slicer(x: Any) -> Callable[[Any], Any]:
    return lambda index: x[index]


def _restore_npz(abstract: Any, path: Path) -> Any:
    """The state from ``path``, each leaf placed with the sharding of the current mesh (any world size)."""
    import jax
    import numpy as np

    leaves, treedef = jax.tree.flatten(abstract)
    with np.load(path) as saved:
        if len(saved.files) != len(leaves):
            raise RuntimeError(f"checkpoint {path} holds {len(saved.files)} arrays, the state has {len(leaves)}")
        arrays = [saved[f"arr_{i}"] for i in range(len(leaves))]
    out = []
    for a, x in zip(leaves, arrays, strict=True):
        if tuple(x.shape) != tuple(a.shape):
            raise RuntimeError(f"checkpoint {path}: array of shape {x.shape}, the state wants {a.shape}")
        x = x.astype(a.dtype)
        out.append(jax.make_array_from_callback(a.shape, a.sharding, _slicer(x)))
    return jax.tree.unflatten(treedef, out)


def _start_jax(cache: str, coordinator: str, world: int, rank: int) -> None:
    """JAX as the engine's worker starts it: its compilation-cache settings, and jax.distributed's timeouts."""
    import jax

    from training.elastic.worker.programs import share_cpu_compilation_cache

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    share_cpu_compilation_cache()
    if world > 1:
        # The same timeouts as our engine's worker (training/elastic/worker/join.py).
        jax.distributed.initialize(
            coordinator,
            world,
            rank,
            coordinator_bind_address=coordinator if rank == 0 else None,  # this host's address only
            heartbeat_timeout_seconds=10,
            initialization_timeout=120,
        )


def _train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: jax.distributed, our mesh and train step, Ray Train's checkpoints and reports."""
    import tempfile

    import ray
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero

    t_start = time.time()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # One id for this worker group (rank 0's), and the JAX coordinator's address (rank 0's host).
    shared = {"attempt": uuid.uuid4().hex[:12], "coordinator": f"{ray.util.get_node_ip_address()}:{_free_port()}"}
    shared = broadcast_from_rank_zero(shared if rank == 0 else None)
    progress = _Progress(config["progress_dir"], shared["attempt"], rank)
    progress("start", time=t_start, world=world, pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id())

    import jax

    from training.config import load_config
    from training.data import make_batches
    from training.mesh import build_mesh, check_batch, plan_mesh
    from training.tasks import load_task
    from training.trainer import Trainer

    cfg = load_config("tiny", None, config["overrides"])
    _start_jax(cfg.placement.compilation_cache, shared["coordinator"], world, rank)
    plan = plan_mesh(cfg.placement, world)
    check_batch(cfg.optimizer, cfg.checkpoint, plan)
    trainer = Trainer(cfg.optimizer, build_mesh(plan), load_task(cfg))

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = _restore_npz(trainer.abstract, Path(d) / "state.npz")
    else:
        state = trainer.init()
    start = int(jax.device_get(state["step"]))
    progress("restored", step=start, world=world, from_checkpoint=checkpoint is not None)
    trainer.compile()
    progress("compiled", step=start)

    batches = make_batches(
        cfg.data.dataset,
        "train",
        seed=cfg.optimizer.seed,
        global_batch=cfg.optimizer.global_batch,
        process_index=rank,
        process_count=world,
        start_batch=start,
    )
    for step in range(start + 1, cfg.optimizer.steps + 1):
        state, m = trainer.step(state, trainer.global_batch(next(batches)))
        loss = float(m["loss"])
        now = time.time()
        progress("step", time=now, step=step, loss=loss, world=world)
        metrics = {"step": step, "loss": loss, "time": now, "world_size": world}
        if (
            step % cfg.checkpoint.checkpoint_every == 0 or step == cfg.optimizer.steps
        ):  # (a report, with the checkpoint)
            if rank == 0:
                with tempfile.TemporaryDirectory(prefix="rtrain-ray-ckpt-") as tmp:
                    _save_npz(state, Path(tmp) / "state.npz")
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            else:
                _save_npz(state, None)
                ray.train.report(metrics)
            progress("checkpoint", step=step)
        elif step % config["report_every"] == 0:
            ray.train.report(metrics)
    progress("done", step=cfg.optimizer.steps)


# --- the driver ---------------------------------------------------------------------------------


def _read_progress(directory: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in sorted(directory.glob("*.jsonl")):
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                pass
    return sorted(out, key=lambda r: float(r["time"]))


def _attempts(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per worker group (as its rank 0 saw it): start, world size, restored step, times of restore, compile, steps."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["rank"] != 0:
            continue
        a = out.setdefault(r["attempt"], {"steps": {}})
        if r["event"] == "start":
            a.update(start=r["time"], world=r["world"])
        elif r["event"] == "restored":
            a.update(restored_step=r["step"], restored_at=r["time"])
        elif r["event"] == "compiled":
            a.update(compiled_at=r["time"])
        elif r["event"] == "step":
            a["steps"][r["step"]] = r["time"]
    return out


class _Env:
    """Environment variables set for a while (the driver's: Ray Train propagates its own to the controller)."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self.values = dict(values)
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc: object) -> None:
        for k, old in self.saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def _median_step_s(times: dict[int, float], lo: int, hi: int) -> float | None:
    gaps = sorted(times[s] - times[s - 1] for s in range(lo + 1, hi + 1) if s in times and s - 1 in times)
    return gaps[len(gaps) // 2] if gaps else None


@dataclass
class RaySettings:
    """One Ray recovery run's settings: the job, the kill, Ray's knobs, and where its records go."""

    workdir: Path
    hosts: int
    kill_at_step: int
    kill: str
    timeout_s: float
    max_failures: int
    report_every: int
    overrides: dict[str, Any]
    system_config: dict[str, Any]
    train_env: dict[str, str]
    worker_env: dict[str, str]

    @property
    def progress_dir(self) -> Path:
        return self.workdir / PROGRESS_DIR

    def notes(self) -> list[str]:
        """How the run was set up, for the result."""
        hosts = self.hosts
        return [
            "JaxTrainer: its JAX backend starts jax.distributed only with use_tpu/use_gpu, so on CPU the train loop "
            "starts it (coordinator address from ray.train.collective.broadcast_from_rank_zero; heartbeat 10 s, "
            "initialisation 120 s, as our worker)",
            f"cluster: ray.cluster_utils.Cluster; a head with 0 CPUs (driver, Train controller), {hosts} worker nodes "
            "of {CPU: 1, host: 1}; resources_per_worker={CPU: 1, host: 1}: one worker per node",
            f"ScalingConfig(num_workers=(1, {hosts})), FailureConfig(max_failures={self.max_failures})",
            "kill: SIGKILL of world rank 1's worker process"
            + (
                ", then Cluster.remove_node(allow_graceful=False) of its node"
                if self.kill == "node"
                else " (node kept)"
            ),
            "checkpoints: ray.train.report(metrics, Checkpoint.from_directory(d)) every checkpoint_every steps, d "
            "holding one state.npz (process_allgather, written by rank 0); restored from ray.train.get_checkpoint() "
            "onto the new world size's mesh",
            "tuned: " + json.dumps({"_system_config": self.system_config, "env": self.train_env})
            if self.system_config or self.train_env
            else "Ray's defaults (GCS health checks every 3 s, 5 misses; Train controller poll 2 s; worker group "
            "start timeout 60 s)",
        ]


def _check_ray() -> Any:
    """The ray module, once Ray Train v2 is known to run here; RuntimeError naming why not."""
    # A cluster on one machine: Ray then takes the loopback address as every node's address (read when
    # Ray is imported, and by every process it starts), so no Ray server listens on another interface.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        import ray
        from ray.train.v2._internal.constants import is_v2_enabled
    except ImportError as e:
        raise RuntimeError(f"Ray Train v2 cannot be imported here: {e}") from e
    if not is_v2_enabled():
        raise RuntimeError("Ray Train v2 is turned off here (RAY_TRAIN_V2_ENABLED=0)")
    if ray.is_initialized():
        raise RuntimeError("this process is already connected to a Ray cluster; the bench starts its own")
    return ray


def _settings(workdir: Path, dataset: str, hosts: int, devices_per_host: int, **kw: Any) -> RaySettings:
    """The run's settings, its job's config checked on both world sizes and its records' folder emptied."""
    from training.config import load_config
    from training.data import load_manifest
    from training.mesh import check_batch, plan_mesh

    workdir = Path(workdir).resolve()
    dataset = os.path.abspath(dataset)
    load_manifest(dataset)  # a missing dataset is an error here, not in a Ray worker
    survivors = hosts - 1 if kw["kill"] == "node" else hosts
    overrides: dict[str, Any] = {
        "dataset": dataset,
        "devices_per_worker": devices_per_host,
        "min_workers": 1,
        "max_workers": hosts,
        "steps": kw["steps"],
        "checkpoint_every": kw["checkpoint_every"],
        "compilation_cache": os.path.abspath(kw["compilation_cache"] or workdir / "jax-cache"),
        "spike_factor": 0,
    }
    cfg = load_config("tiny", None, overrides)
    for n in sorted({hosts, survivors}):
        check_batch(cfg.optimizer, cfg.checkpoint, plan_mesh(cfg.placement, n))  # the PlanError names the numbers
    for sub in (PROGRESS_DIR, "ray_results"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    (workdir / PROGRESS_DIR).mkdir(parents=True)
    worker_env = {**WORKER_ENV, **cpu_process_env(devices_per_host)}  # as the engine's workers
    worker_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return RaySettings(
        workdir=workdir,
        hosts=hosts,
        kill_at_step=kw["kill_at_step"],
        kill=kw["kill"],
        timeout_s=kw["timeout_s"],
        max_failures=kw["max_failures"],
        report_every=kw["report_every"],
        overrides=overrides,
        system_config=dict(TUNED_SYSTEM_CONFIG) if kw["tuned"] else {},
        train_env=dict(TUNED_TRAIN_ENV) if kw["tuned"] else {},
        worker_env=worker_env,
    )


def _start_cluster(ray: Any, st: RaySettings) -> Any:
    """A local Ray cluster: a head with no CPUs, and one worker node per host; this process connected to it."""
    from ray.cluster_utils import Cluster

    try:
        # Every Ray node on the loopback address: nothing listens on another interface.
        head_args: dict[str, Any] = {"num_cpus": 0, "include_dashboard": False, "node_ip_address": LOOPBACK}
        if st.system_config:
            head_args["_system_config"] = dict(st.system_config)  # (Ray adds its own keys to it)
        cluster = Cluster(initialize_head=True, connect=False, head_node_args=head_args)
        for _ in range(st.hosts):
            cluster.add_node(num_cpus=1, resources={"host": 1}, node_ip_address=LOOPBACK)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=bool(os.environ.get("RTRAIN_RAY_LOGS")))
    except Exception as e:
        raise RuntimeError(f"a local Ray cluster cannot start here: {type(e).__name__}: {e}") from e
    return cluster


def _fit_in_thread(st: RaySettings) -> tuple[threading.Event, list[BaseException]]:
    """JaxTrainer's fit of our train loop, in a thread: the event set when it ends, and its errors."""
    from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxTrainer

    trainer = JaxTrainer(
        _train_loop,
        train_loop_config={
            "progress_dir": str(st.progress_dir),
            "overrides": st.overrides,
            "report_every": st.report_every,
        },
        scaling_config=ScalingConfig(num_workers=(1, st.hosts), resources_per_worker={"CPU": 1, "host": 1}),
        run_config=RunConfig(
            name="ray-recovery",
            storage_path=str(st.workdir / "ray_results"),
            failure_config=FailureConfig(max_failures=st.max_failures),
            worker_runtime_env={"env_vars": st.worker_env},
        ),
    )
    errors: list[BaseException] = []
    done = threading.Event()

    def fit() -> None:
        try:
            res = trainer.fit()
            if res.error is not None:
                errors.append(res.error)
        except BaseException as e:  # noqa: BLE001 - handed to the driver's thread
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=fit, name="ray-train-fit", daemon=True).start()
    return done, errors


def _kill_rank_1(cluster: Any, st: RaySettings, records: list[dict[str, Any]], first: str) -> None:
    """Lose world rank 1 of worker group ``first``: its process SIGKILLed, and its node removed (``kill="node"``)."""
    victim = next((r for r in records if r["event"] == "start" and r["attempt"] == first and r["rank"] == 1), None)
    node = next((n for n in cluster.worker_nodes if victim is not None and n.node_id == victim["node_id"]), None)
    if victim is None or node is None:
        raise RuntimeError(f"world rank 1 of the first worker group, or its node, not found ({victim})")
    try:
        os.kill(int(victim["pid"]), signal.SIGKILL)
    except ProcessLookupError:
        pass
    if st.kill == "node":
        cluster.remove_node(node, allow_graceful=False)


def _recovered(a: dict[str, Any], t_kill: float) -> dict[str, Any]:
    """The result's fields of a recovery: worker group ``a``, the first started after the kill."""
    first_step = min(a["steps"])
    return {
        "recovery_s": a["steps"][first_step] - t_kill,
        "restored_step": a.get("restored_step"),
        "first_step_after": first_step,
        "workers_after": a["world"],
        # Cumulative from the kill, as the new worker group's rank 0 saw it.
        "breakdown_s": {
            "train_fn_started": a["start"] - t_kill,
            "restored": a["restored_at"] - t_kill,
            "compiled": a["compiled_at"] - t_kill,
            "first_step": a["steps"][first_step] - t_kill,
        },
    }


def _watch(cluster: Any, st: RaySettings, done: threading.Event, result: dict[str, Any]) -> float | None:
    """Follow the workers' records: kill at ``kill_at_step``, then time the first step after; the kill's time."""
    deadline = time.monotonic() + st.timeout_s
    t_kill: float | None = None
    while not done.is_set() and time.monotonic() < deadline:
        records = _read_progress(st.progress_dir)
        attempts = _attempts(records)
        if t_kill is None:
            ready = [(k, a) for k, a in attempts.items() if st.kill_at_step in a["steps"]]
            if ready:
                first, a = ready[0]
                t_kill = time.time()
                _kill_rank_1(cluster, st, records, first)
                result.update(
                    workers_before=a["world"],
                    killed_after_step=max(a["steps"]),
                    step_s=_median_step_s(a["steps"], 2, max(a["steps"])),
                )
        elif result["recovery_s"] is None:
            after = [a for a in attempts.values() if a.get("start", 0.0) > t_kill and a["steps"]]
            if after:
                result.update(_recovered(min(after, key=lambda a: float(a["start"])), t_kill))
        time.sleep(0.05)
    return t_kill


def _outcome(st: RaySettings, done: threading.Event, errors: list[BaseException], t_kill: float | None) -> bool:
    """Whether the fit finished every step; RuntimeError where it failed before the kill or never reached it."""
    if errors:
        err = errors[0]
        if t_kill is None:
            raise RuntimeError(f"Ray Train failed before the kill: {type(err).__name__}: {err}") from err
    elif t_kill is None:
        raise RuntimeError(
            f"Ray Train did not reach step {st.kill_at_step} in {st.timeout_s:.0f} s"
            if not done.is_set()
            else f"training ended without a record of step {st.kill_at_step} (see {st.progress_dir})"
        )
    finished = any(r["event"] == "done" for r in _read_progress(st.progress_dir))
    return done.is_set() and not errors and finished


def _blank_result(ray_version: str, st: RaySettings, *, steps: int, tuned: bool) -> dict[str, Any]:
    """The result before the run: its settings and notes, every measurement still None."""
    return {
        "framework": "ray-train",
        "ray_version": ray_version,
        "trainer": "JaxTrainer",
        "kill": st.kill,
        "tuned": tuned,
        "recovery_s": None,
        "kill_at_step": st.kill_at_step,
        "killed_after_step": None,
        "restored_step": None,
        "first_step_after": None,
        "workers_before": None,
        "workers_after": None,
        "finished": False,
        "steps": steps,
        "seconds_total": None,
        "step_s": None,
        "breakdown_s": None,
        "settings": {"system_config": st.system_config, "env": st.train_env, "report_every": st.report_every},
        "notes": st.notes(),
    }


def ray_recovery(
    workdir: Path,
    dataset: str,
    *,
    hosts: int = 2,
    devices_per_host: int = 2,
    steps: int = 30,
    kill_at_step: int = 12,
    checkpoint_every: int = 5,
    timeout_s: float = 600,
    kill: Literal["node", "worker"] = "node",
    tuned: bool = False,
    max_failures: int = 3,
    report_every: int = 1,
    compilation_cache: str | None = None,
) -> dict[str, Any]:
    """Ray Train v2's elastic recovery from a lost host, on our model and data, as a JSON-serialisable dict.

    ``recovery_s``: from the kill to the first step completed by a worker group started after it
    (the workers' clocks).  ``kill="node"`` loses world rank 1's host (its worker process SIGKILLed,
    its node's Ray processes killed): Ray Train goes on with ``hosts - 1`` workers; ``kill="worker"``
    only SIGKILLs that worker process (our bench's ``crash:worker=1``): the node stays and Ray Train
    restarts all ``hosts``.  ``tuned``: Ray's knobs for noticing a loss sooner (``TUNED_SYSTEM_CONFIG``,
    ``TUNED_TRAIN_ENV``); otherwise Ray's defaults.  ``report_every``: steps between
    ``ray.train.report`` calls (each blocks while the previous one waits for the controller's poll).
    Raises RuntimeError when Ray Train cannot run here, with the reason.
    """
    if hosts < 2:
        raise ValueError(f"hosts must be >= 2 (one is lost), got {hosts}")
    if not 0 < kill_at_step < steps:
        raise ValueError(f"kill_at_step must be in 1..{steps - 1}, got {kill_at_step}")
    if kill not in ("node", "worker"):
        raise ValueError(f"kill must be 'node' or 'worker', got {kill!r}")
    ray = _check_ray()
    st = _settings(
        workdir,
        dataset,
        hosts,
        devices_per_host,
        steps=steps,
        kill_at_step=kill_at_step,
        checkpoint_every=checkpoint_every,
        timeout_s=timeout_s,
        kill=kill,
        tuned=tuned,
        max_failures=max_failures,
        report_every=report_every,
        compilation_cache=compilation_cache,
    )
    result = _blank_result(ray.__version__, st, steps=steps, tuned=tuned)
    cluster: Any = None
    with _Env(st.train_env):
        try:
            cluster = _start_cluster(ray, st)
            t_fit = time.time()
            done, errors = _fit_in_thread(st)
            t_kill = _watch(cluster, st, done, result)
            result["seconds_total"] = time.time() - t_fit
            if not done.is_set():
                result["notes"].append(f"stopped after timeout_s={timeout_s:.0f} s")
            result["finished"] = _outcome(st, done, errors, t_kill)
            if errors:
                result["notes"].append(f"fit ended with {type(errors[0]).__name__}: {str(errors[0])[:400]}")
            return result
        finally:
            try:
                ray.shutdown()
            finally:
                if cluster is not None:
                    cluster.shutdown()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Ray Train v2's elastic recovery on our model, data and kill (JSON out).")
    p.add_argument("--workdir", default="var/bench/ray", help="progress records, Ray's results, the JAX cache")
    p.add_argument("--dataset", default="", help="a prepared dataset (default: a small one under the workdir)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--devices-per-host", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-at-step", type=int, default=12)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--kill", choices=("node", "worker"), default="node")
    p.add_argument("--tuned", action="store_true", help="Ray's knobs for noticing a loss sooner (TUNED_*)")
    p.add_argument("--report-every", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="", help="also write the JSON here (Ray prints its own messages to stdout)")
    args = p.parse_args(argv)
    workdir = Path(args.workdir).resolve()
    dataset = args.dataset
    if not dataset:
        from training.data import prepare

        dataset = str(workdir / "data")
        prepare(None, dataset, 64, max_bytes=300_000)
    res = ray_recovery(
        workdir,
        dataset,
        hosts=args.hosts,
        devices_per_host=args.devices_per_host,
        steps=args.steps,
        kill_at_step=args.kill_at_step,
        checkpoint_every=args.checkpoint_every,
        timeout_s=args.timeout,
        kill=args.kill,
        tuned=args.tuned,
        report_every=args.report_every,
    )
    text = json.dumps(res, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    # Through the module's own name, so that Ray pickles the train loop by reference.
    from benchmarks.ray_baseline import main as _main

    sys.exit(_main())
