"""The hook of the training engine: the one place the Airflow side talks to ``training/``.

The hook owns the clients and the operators stay thin.  Here the "client" is
the engine's small API, ``training.api`` (plan, launch, job state, events, the
checkpoint lifecycle, run marks) and the service's verbs
(``training.service.commands``), plus a *backend*, chosen by the run spec:

* :class:`LocalSliceBackend` (the embedded default): N simulated hosts on this
  machine, one host agent each, kept running by the local slice process;
* :class:`SharedPoolBackend`: the same, for a run with a priority: submitted to its
  storage root's shared pool, whose scheduler launches it and moves its hosts;
* :class:`GKEBackend`: TPU node pools and one JobSet per job, one host agent per
  pod, through the hooks in ``rtrain_airflow.hooks.gke_tpu`` (imported only when used).

All three answer the same four verbs (``provision``, ``launch``, ``poll``,
``release``), so the DAG, the operators and the watching trigger do not care
where the workers run.  A job recovers from lost hosts by itself (its agents);
Airflow's retry is the second level, when the job as a whole is gone.

Import cost: ``training.api`` imports nothing heavy at module level; JAX, Orbax
and grain are imported by the engine inside the calls that need them
(validation, dataset preparation), which run inside ``execute()``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from airflow.sdk import BaseHook

from training import api
from training.api import RUN_NAME_PATTERN, Config, ConfigError, JobHandle, mesh_text, readable
from training.service import commands

# The repository root (plugins/rtrain_airflow/hooks/training.py -> parents[3]).  Relative
# local paths in a run config (``var/runs``) are taken from here, not from the
# current directory of whichever Airflow process runs a task.
PROJECT_ROOT = Path(os.environ.get("RTRAIN_PROJECT_ROOT") or Path(__file__).resolve().parents[3])

# DAG params that are not Config keys (the rest map 1:1, or by PARAM_TO_CONFIG).
PARAM_TO_CONFIG = {"storage_root": "root"}
NON_CONFIG_PARAMS = frozenset({"dataset_source", "dataset_max_bytes", "overrides", "gke", "steps_per_run", "priority"})

# The param schemas of the DAGs: one run-name rule and one chaos grammar, the engine's.
CHAOS_PATTERN = api.spec_pattern()
CHAOS_EXAMPLES = (
    "preempt:worker=1,step=40",
    "capacity:to=4,step=80",
    "crash:worker=0,step=12",
    "lr_spike:step=30,factor=50",
)

# The same two rules as JSON-schema parts that each say in words what they allow: a refused value's
# error (Airflow prints the failing part of the schema) names the rule, not one opaque regular expression
# (short words: Airflow's message wraps longer ones).  Together they accept exactly what RUN_NAME_PATTERN
# and CHAOS_PATTERN accept (tested).
RUN_NAME_RULES: dict[str, Any] = {
    "minLength": 1,
    "maxLength": 63,
    "allOf": [
        {"description": "only letters, digits and _ . -", "pattern": "^[A-Za-z0-9_.-]*$"},
        {"description": "the first character is a letter or a digit", "pattern": "^[A-Za-z0-9]"},
        {"description": "no '..' anywhere", "not": {"pattern": "[.][.]"}},
    ],
}
CHAOS_RULES: dict[str, Any] = {
    "type": "string",
    "allOf": [
        {
            "description": "an action (one of these) and a colon",
            "pattern": "^(" + "|".join(sorted(api.CHAOS_ACTIONS)) + "):",
        },
        {
            "description": "then key=number pairs: worker=1,step=40",
            "pattern": "^[a-z_]+:[a-z_]+=[0-9.]+(,[a-z_]+=[0-9.]+)*$",
        },
    ],
}

PRIORITY_LEVELS = list(commands.PRIORITIES)  # the DAG's priority field: lowest first

# Live and final states as the backends report them (``training.api.RunState``).
ALIVE = tuple(sorted({*api.ALIVE_STATES, "queued"}))  # queued: a run of the shared pool waiting for hosts


class RTrainConfigError(ValueError):
    """A DAG run's params that do not make a runnable config (the message names the key)."""


@cache
def preset_config(preset: str) -> Config:
    """A preset's config as the engine builds it (its YAML over the defaults): YAML and pydantic, no JAX."""
    return api.load_config(preset, None, {}, base_dir=PROJECT_ROOT)


def preset_values(key: str, presets: Iterable[str]) -> dict[str, Any]:
    """What a config key is in each preset (the trigger form shows them next to a field left empty)."""
    return {p: getattr(preset_config(p), key) for p in presets}


def format_validations(results: Sequence[Mapping[str, Any]]) -> str:
    """One aligned table of verdicts with rounded numbers (the columns of ``rtrain validate``)."""
    if not results:
        return "no checkpoint waits for a verdict"

    def num(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, int | float) else ("-" if v is None else str(v))

    lines = [f"{'step':>8}  {'verdict':<10} {'loss':>8} {'perplexity':>11} {'accuracy':>9}  reason"]
    for r in results:
        m = r.get("metrics") or {}
        lines.append(
            f"{r.get('step')!s:>8}  {r.get('verdict')!s:<10} {num(m.get('loss'), '.4f'):>8} "
            f"{num(m.get('perplexity'), '.2f'):>11} {num(m.get('accuracy'), '.3f'):>9}  {r.get('reason') or ''}".rstrip()
        )
    return "\n".join(lines)


def plan_text(report: Mapping[str, Any]) -> str:
    """The plan task's report in words: worker counts, meshes at both ends, memory per device."""
    lo, hi = report.get("min_plan") or {}, report.get("max_plan") or {}
    mem = report.get("memory_gib") or {}

    def size(gib: Any) -> str:
        if not isinstance(gib, int | float):
            return "-"
        return f"{gib:.3g} GiB" if gib >= 1 else f"{gib * 1024:.3g} MiB"

    parts = ", ".join(f"{k.removeprefix('bytes_')} {size(v)}" for k, v in mem.items() if k != "total")
    params = report.get("params")
    count = ""
    if isinstance(params, int | float):
        count = f"{params / 1e9:.3g}B parameters; " if params >= 1e9 else f"{params / 1e6:.3g}M parameters; "

    def at(plan: Mapping[str, Any]) -> str:
        n = plan.get("workers")
        return f"{n} worker{'' if n == 1 else 's'}: mesh {mesh_text(plan.get('shape'))} ({plan.get('devices')} devices)"

    return (
        f"feasible worker counts {readable(report.get('feasible_workers'))}; {at(lo)}, {at(hi)}; {count}"
        f"memory per device at the minimum {size(mem.get('total'))} ({parts})"
    )


def rounded(value: Any, digits: int = 4) -> Any:
    """Every float in a JSON-like value rounded (lists and mappings walked), for logs people read."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, Mapping):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def absolute(uri: str, root: Path = PROJECT_ROOT) -> str:
    """A local path made absolute against the project root; gs:// URIs unchanged."""
    return api.absolute(uri, root)


def pid_alive(pid: int | None) -> bool:
    """Whether a local process runs (a zombie does not: it is reaped here when it is our child)."""
    if not pid:
        return False
    pid = int(pid)
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # our own child (a launch from this process): reap it
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        import psutil

        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except Exception:  # noqa: BLE001 - NoSuchProcess, AccessDenied: treat as gone only when it is gone
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


def stop_process_tree(pid: int) -> list[int]:
    """SIGKILL a process and everything under it (the local slice, its agents and their workers)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        children = parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    killed = []
    for proc in [parent, *children]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc.pid)
    for proc in [parent, *children]:
        pid_alive(proc.pid)  # reap ours
    psutil.wait_procs([parent, *children], timeout=10)
    return killed


# --- backends ------------------------------------------------------------------------------------


class LocalSliceBackend:
    """The embedded default: a job's host agents (and their workers) on this machine."""

    name = "local"

    def __init__(self, log: Any = None) -> None:
        self.log = log

    def _say(self, msg: str, *args: Any) -> None:
        if self.log is not None:
            self.log.info(msg, *args)

    def provision(self, cfg: Config, spec: Mapping[str, Any]) -> dict[str, Any]:
        """Give the simulated slice its hosts: capacity = max_workers."""
        api.set_capacity(cfg.run_uri, cfg.max_workers, reason="provisioned by Airflow", source="airflow")
        return {"backend": self.name, "hosts": cfg.max_workers, "run_uri": cfg.run_uri}

    def launch(self, cfg: Config, spec: Mapping[str, Any], attempt: int) -> JobHandle:
        """Start a job, or follow the live one (``training.api.launch`` never starts over, never overwrites)."""
        handle = api.launch(cfg, detach=True, allow_attach=True)
        self._say(
            "%s job %s of %s",
            "Following the live" if handle.get("attached") else "Started",
            handle["job"],
            cfg.run_name,
        )
        return handle

    def poll(self, handle: Mapping[str, Any], timeouts: Mapping[str, float], now: float | None = None) -> api.JobLook:
        """One look at the job: ``{"state", "reason", "status"}``; state is one of ALIVE, finished, failed.

        A job whose hosts are all gone is failed by ``training.api.status`` (its lease lapsed); one
        whose leader holds the lease but has not written its status for ``stale_after_s`` is failed here.
        """
        look = api.job_state(handle, timeouts.get("start_timeout_s", 300.0))
        st = look.get("status") or {}
        now = time.time() if now is None else now
        age = now - float(st.get("updated_at", now))
        if look["state"] in ALIVE and look["state"] != "pending" and age > timeouts.get("stale_after_s", 900.0):
            return {**look, "state": "failed", "reason": f"no status update for {age:.0f}s while {look['state']}"}
        return look

    def release(self, cfg: Config, spec: Mapping[str, Any], handles: list[Mapping[str, Any]]) -> dict[str, Any]:
        """Stop the jobs of ``handles`` still running (their leader ends them), kill what is left here, give the hosts back."""

        def running(job: str) -> bool:
            look = api.job_state({"run_uri": cfg.run_uri, "job": job, "launched_at": time.time()})
            return look["state"] in ALIVE and look["state"] != "pending"

        live = [job for job in {str(h["job"]) for h in handles if h.get("job")} if running(job)]
        for job in live:
            api.stop_job(cfg.run_uri, f"stopped by the Airflow teardown (job {job})")
        deadline = time.time() + 3 * cfg.lease_s + 5
        while live and time.time() < deadline:
            live = [job for job in live if running(job)]
            time.sleep(0.5)
        pids = {
            int(h["controller_pid"])
            for h in handles
            if h.get("controller_pid")
            and h.get("host") == socket.gethostname()
            and int(h["controller_pid"]) != os.getpid()
        }
        pids |= set(api.local_job_pids(cfg.run_uri))
        stopped: list[int] = []
        for pid in sorted(pids):
            if pid_alive(pid):
                stopped.extend(stop_process_tree(pid))
        api.release_capacity(cfg.run_uri, "released by the Airflow teardown")
        return {"backend": self.name, "stopped_pids": stopped, "released": True}


class SharedPoolBackend:
    """The local slice shared by runs: the job is submitted at a priority, and the root's scheduler places it.

    The scheduler (``rtrain queue`` shows it) gives the pool's hosts to runs by priority: this run may
    wait queued, shrink when a higher one arrives (after a preemption notice: no step lost) and grow
    back. Its job is launched by the scheduler, so a handle names the submission, and the job once
    placed: a queued run is alive (``queued``), not pending.
    """

    name = "local"

    def __init__(self, priority: str, log: Any = None) -> None:
        commands.priority_value(priority)
        self.priority = priority
        self.log = log

    def _say(self, msg: str, *args: Any) -> None:
        if self.log is not None:
            self.log.info(msg, *args)

    def provision(self, cfg: Config, spec: Mapping[str, Any]) -> dict[str, Any]:
        """The pool is the root's: made as large as this run's ``max_workers`` when it has no size yet."""
        pool = commands.ensure_pool(cfg.root, cfg.max_workers)
        if cfg.min_workers > pool:
            raise RTrainConfigError(
                f"min_workers={cfg.min_workers} never fits the pool of {pool} host(s) at {cfg.root} "
                "(rtrain submit --pool-hosts N resizes it)"
            )
        return {"backend": self.name, "pool": pool, "priority": self.priority, "run_uri": cfg.run_uri}

    def launch(self, cfg: Config, spec: Mapping[str, Any], attempt: int) -> JobHandle:
        """Submit the run (or follow its live submission): the scheduler launches it when its minimum fits."""
        handle: JobHandle = {
            "backend": self.name,
            "run_uri": cfg.run_uri,
            "root": cfg.root,
            "run_name": cfg.run_name,
            "priority": self.priority,
            "launched_at": time.time(),
            "events_after": api.newest_event_key(cfg.run_uri) if api.run_exists(cfg.run_uri) else None,
        }
        try:
            row = commands.look(cfg.root, cfg.run_name)
        except commands.QueueError:
            row = None
        if row is not None and row.state not in commands.ENDED:
            self._say("Following %s in the queue of %s (%s, %s)", cfg.run_name, cfg.root, row.priority, row.state)
            return {**handle, "attached": True, "priority": row.priority, "job": row.job}
        sub = commands.submit(cfg, self.priority)
        self._say("Submitted %s to the queue of %s at priority %s", cfg.run_name, cfg.root, sub.priority)
        return {**handle, "attached": False, "job": ""}

    def poll(self, handle: Mapping[str, Any], timeouts: Mapping[str, float], now: float | None = None) -> api.JobLook:
        """One look: ``{"state", "reason", "status", "queue"}``; ``queued`` while the run holds no host.

        A run still in the queue whose scheduler is gone (killed) gets a new one.
        """
        row = commands.watch(str(handle["root"]), str(handle["run_name"]))
        queue = row.to_dict()
        if row.job and row.state not in ("queued", "cancelling", *commands.ENDED):
            launched = {**handle, "job": row.job, "launched_at": row.launched_at or handle.get("launched_at")}
            return {**LocalSliceBackend(self.log).poll(launched, timeouts, now), "queue": queue}
        status = api.repair_status(str(handle["run_uri"])) or {}
        if row.state == "finished":
            return {"state": "finished", "reason": "", "status": status, "queue": queue}
        if row.state in commands.ENDED:
            why = f"{row.state} in the queue: {row.reason or 'no reason recorded'}"
            return {"state": "failed", "reason": why, "status": status, "queue": queue}
        return {"state": "queued", "reason": row.reason, "status": status, "queue": queue}

    def release(self, cfg: Config, spec: Mapping[str, Any], handles: list[Mapping[str, Any]]) -> dict[str, Any]:
        """Cancel the run if it is still in the queue (its job stops at a step boundary); the pool stays."""
        try:
            row = commands.look(cfg.root, cfg.run_name)
        except commands.QueueError:
            return {"backend": self.name, "cancelled": False}
        if row.state in commands.ENDED:
            return {"backend": self.name, "cancelled": False, "ended": row.state}
        try:
            commands.cancel(cfg.root, cfg.run_name, "cancelled by the Airflow teardown")
        except commands.QueueError as e:  # it ended meanwhile
            return {"backend": self.name, "cancelled": False, "ended": str(e)}
        deadline = time.time() + 3 * cfg.lease_s + 30
        while time.time() < deadline and commands.look(cfg.root, cfg.run_name).state not in commands.ENDED:
            time.sleep(0.5)
        ended = commands.look(cfg.root, cfg.run_name).state
        self._say("Cancelled %s in the queue of %s: %s", cfg.run_name, cfg.root, ended)
        return {"backend": self.name, "cancelled": True, "ended": ended}


class GKEBackend:
    """TPU node pools and one JobSet per job on GKE (``rtrain_airflow.hooks.gke_tpu``).

    ``spec["gke"]`` carries the cluster and the slice shape: ``project_id``, ``location``,
    ``cluster_name``, ``machine_type``, ``tpu_topology``, ``image``, ``node_pools`` (one per
    slice), and optionally ``namespace``, ``spot``, ``node_locations``, ``service_account``,
    ``gcp_conn_id``.  The JobSet runs one host agent per pod; the agents recover from lost
    hosts among themselves (a lost pod is recreated and rejoins), and write the run's
    status to the gs:// run root, which the sensor follows.
    """

    name = "gke"
    REQUIRED = ("location", "cluster_name", "machine_type", "tpu_topology", "image", "node_pools")

    def __init__(self, gke: Mapping[str, Any], log: Any = None, priority: str | None = None) -> None:
        missing = [k for k in self.REQUIRED if not gke.get(k)]
        if missing:
            raise RTrainConfigError(f"gke: backend 'gke' needs {', '.join('gke.' + k for k in missing)}")
        if gke.get("queued_provisioning") and not gke.get("kueue_queue"):
            raise RTrainConfigError(
                "gke.queued_provisioning: a queued pool makes nodes only for a ProvisioningRequest, which Kueue's "
                "admission check makes for the JobSet: it needs gke.kueue_queue (docs/gke.md)"
            )
        if gke.get("queued_provisioning") and not gke.get("flex_start"):
            raise RTrainConfigError("gke.queued_provisioning: GKE queues the provisioning of flex-start pools only")
        if priority is not None and not gke.get("kueue_queue"):
            raise RTrainConfigError(
                f"priority {priority!r} on GKE is a Kueue priority: it needs gke.kueue_queue (the LocalQueue's name)"
            )
        self.gke = dict(gke)
        self.log = log
        self.priority = priority

    def _gke_hook(self) -> Any:
        from rtrain_airflow.hooks.gke_tpu import GKETPUHook

        return GKETPUHook(
            gcp_conn_id=self.gke.get("gcp_conn_id", "google_cloud_default"), location=self.gke["location"]
        )

    def _jobsets(self) -> Any:
        from rtrain_airflow.hooks.gke_tpu import JobSetHook

        kube = self._gke_hook().get_kubernetes_hook(
            cluster_name=self.gke["cluster_name"], project_id=self.gke.get("project_id")
        )
        return JobSetHook(kube)

    def provision(self, cfg: Config, spec: Mapping[str, Any]) -> dict[str, Any]:
        """Create every node pool at once; done when enough for ``min_workers`` are up (the rest join later)."""
        from rtrain_airflow.hooks.gke_tpu import TPUNodePoolSpec

        specs = [
            TPUNodePoolSpec(
                name=pool,
                machine_type=self.gke["machine_type"],
                tpu_topology=self.gke["tpu_topology"],
                spot=bool(self.gke.get("spot", False)),
                node_locations=tuple(self.gke.get("node_locations", ())),
                service_account=self.gke.get("node_service_account"),
                flex_start=bool(self.gke.get("flex_start", False)),
                queued_provisioning=bool(self.gke.get("queued_provisioning", False)),
            )
            for pool in self.gke["node_pools"]
        ]
        hosts_per_pool = specs[0].node_count
        need = -(-cfg.min_workers // hosts_per_pool)
        up = self._gke_hook().create_tpu_node_pools(
            cluster_name=self.gke["cluster_name"],
            specs=specs,
            need=need,
            project_id=self.gke.get("project_id"),
            timeout_s=float(self.gke.get("provision_timeout_s", 3600.0)),
        )
        return {
            "backend": self.name,
            "need": need,
            "node_pools_up": up.ready,
            "node_pools_creating": up.creating,
            "node_pools_failed": up.failed,
        }

    def placement(self) -> api.GKELaunch:
        """Where and how the JobSet's pods run (image, namespace, node pools, Spot, Kueue queue and priority)."""
        return api.GKELaunch(
            image=self.gke["image"],
            namespace=self.gke.get("namespace", "default"),
            service_account=self.gke.get("service_account", "rtrain-worker"),
            node_pools=tuple(self.gke["node_pools"]),
            spot=bool(self.gke.get("spot", False)),
            kueue_queue=self.gke.get("kueue_queue"),
            priority=self.priority,
            gcs_fuse=bool(self.gke.get("gcs_fuse", False)),
        )

    def launch(self, cfg: Config, spec: Mapping[str, Any], attempt: int) -> JobHandle:
        launch = self.placement()
        tpu = api.TPUSlice(self.gke["machine_type"], self.gke["tpu_topology"])
        handle = self._jobsets().start_job(cfg, tpu, launch, by=f"Airflow (try {attempt})")
        handle["gke"] = self.gke
        return handle

    def poll(self, handle: Mapping[str, Any], timeouts: Mapping[str, float], now: float | None = None) -> api.JobLook:
        """One look at the job, its JobSet and why its pods wait.

        A job that has not started fails after ``start_timeout_s``, but not while Kueue holds its
        JobSet, and only after ``gke.provision_timeout_s`` while its pods wait for nodes the cluster
        is still to make (flex-start pools are created empty; a stockout may clear).
        """
        look = api.job_state(handle, float("inf"))  # the start timeout is applied below, knowing why pods wait
        if look["state"] in ("finished", "failed"):
            return look
        jobsets = self._jobsets()
        state = jobsets.state(handle["jobset"], handle["namespace"])
        if state in ("failed", "missing"):
            return {**look, "state": "failed", "reason": f"JobSet {handle['jobset']} is {state}"}
        if state == "suspended":
            queue = self.gke.get("kueue_queue")
            return {**look, "waiting": f"the JobSet is suspended: waiting for Kueue to admit it (queue {queue})"}
        try:
            waiting = jobsets.waiting(handle["jobset"], handle["namespace"])
        except Exception as e:  # noqa: BLE001 - why pods wait is a diagnosis: a failed look is no failure of the job
            if self.log is not None:
                self.log.warning("Reading the pods of %s failed: %s", handle["jobset"], e)
            waiting = ""
        if look["state"] == "pending":
            limit = float(timeouts.get("start_timeout_s", 900.0))
            if "Unschedulable" in waiting:
                limit = max(limit, float(self.gke.get("provision_timeout_s", 3600.0)))
            age = (time.time() if now is None else now) - float(handle.get("launched_at", time.time()))
            if age > limit:
                why = f"job {handle.get('job')} did not start within {limit:.0f}s"
                return {**look, "state": "failed", "reason": why + (f"; pods waiting: {waiting}" if waiting else "")}
        return {**look, "waiting": waiting} if waiting else look

    def release(self, cfg: Config, spec: Mapping[str, Any], handles: list[Mapping[str, Any]]) -> dict[str, Any]:
        deleted = []
        jobsets = self._jobsets()
        for h in handles:
            if h.get("jobset") and jobsets.delete(h["jobset"], h.get("namespace", "default")):
                deleted.append(h["jobset"])
        hook = self._gke_hook()
        for pool in self.gke["node_pools"]:
            hook.delete_tpu_node_pool(
                cluster_name=self.gke["cluster_name"],
                node_pool_name=pool,
                project_id=self.gke.get("project_id"),
                wait_to_complete=True,
            )
        return {"backend": self.name, "jobsets_deleted": deleted, "node_pools_deleted": list(self.gke["node_pools"])}


# --- the hook -------------------------------------------------------------------------------------


class RTrainHook(BaseHook):
    """The engine's API and the run's backend, for operators, sensors and triggers.

    No connection is needed for the local slice; the GKE backend uses the Google
    connection named in ``spec["gke"]["gcp_conn_id"]`` (default ``google_cloud_default``).
    """

    conn_name_attr = "rtrain_conn_id"
    hook_name = "Resilient training"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    # --- configs ---------------------------------------------------------------------------

    @staticmethod
    def overrides_from_params(params: Mapping[str, Any]) -> dict[str, Any]:
        """DAG params -> Config overrides.  ``None`` means "the preset's value" and is left out.

        Keys of ``params["overrides"]`` are Config keys too (checked by the config itself:
        an unknown key is an error that names it).
        """
        out: dict[str, Any] = {}
        for key, value in params.items():
            if key in NON_CONFIG_PARAMS or value is None:
                continue
            out[PARAM_TO_CONFIG.get(key, key)] = value
        extra = params.get("overrides") or {}
        if not isinstance(extra, Mapping):
            raise RTrainConfigError(f"overrides: a mapping of Config key -> value, got {type(extra).__name__}")
        named = {PARAM_TO_CONFIG.get(k, k) for k in params if k not in NON_CONFIG_PARAMS}
        clash = sorted(set(extra) & named)
        if clash:
            raise RTrainConfigError(f"overrides: {', '.join(clash)} are params of their own; set them there")
        out.update(extra)
        return out

    def build_config(self, overrides: Mapping[str, Any]) -> Config:
        """The validated Config (``training.api.load_config``), local paths absolute against the project."""
        ov = dict(overrides)
        name = str(ov.get("run_name", ""))
        if name and not re.match(RUN_NAME_PATTERN, name):
            raise RTrainConfigError(f"run_name: {name!r}: letters, digits and _.- (no '..', no '/')")
        try:
            return api.load_config(str(ov.get("preset") or "tiny"), None, ov, base_dir=PROJECT_ROOT)
        except (ConfigError, ValueError) as e:
            raise RTrainConfigError(str(e)) from None

    @staticmethod
    def check_task(cfg: Config, data: bool = True) -> None:
        """Build the config's task and, unless ``data`` is False, open its data (imports JAX: from a task's execute)."""
        try:
            api.check_task(cfg, data)
        except api.TaskError as e:
            raise RTrainConfigError(str(e)) from None

    @staticmethod
    def config_from_dict(data: Mapping[str, Any]) -> Config:
        return api.config_from_dict(data)

    # --- planning and data -------------------------------------------------------------------

    def plan(self, cfg: Config) -> dict[str, Any]:
        """Mesh plans and the memory-fit check; raises ``training.api.PlanError`` with the numbers."""
        return dict(api.plan(cfg))

    def prepare_dataset(
        self,
        source: str | None,
        output: str,
        seq_len: int,
        max_bytes: int | None,
        progress: Callable[[str], None] | None = None,
        refresh: bool = False,
        tokenizer: str = "bytes",
        vocab_size: int | None = None,
    ) -> api.PreparedDataset:
        """Prepare (idempotently) the token dataset; imports numpy/array_record, so call it in execute().

        ``refresh``: a source whose content changed replaces the prepared dataset (continual training);
        otherwise a different dataset at ``output`` is refused.  ``tokenizer``: bytes, bpe (of
        ``vocab_size``) or a tokenizer file, as the run's config says.
        """
        src = None if source in (None, "", "stdlib") else (source if source.startswith("gs://") else absolute(source))
        return api.prepare_dataset(
            src,
            output,
            seq_len,
            max_bytes=max_bytes,
            progress=progress,
            refresh=refresh,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
        )

    # --- the job -------------------------------------------------------------------------------

    def backend(
        self, name: str, gke: Mapping[str, Any] | None = None, priority: str | None = None
    ) -> LocalSliceBackend | SharedPoolBackend | GKEBackend:
        """The backend of a run: ``priority`` puts a local run in its root's shared pool (GKE: Kueue's)."""
        if name == "local":
            return SharedPoolBackend(priority, self.log) if priority else LocalSliceBackend(self.log)
        if name == "gke":
            return GKEBackend(gke or {}, self.log, priority)
        raise RTrainConfigError(f"backend: 'local' or 'gke', not {name!r}")

    def backend_for(self, spec: Mapping[str, Any]) -> LocalSliceBackend | SharedPoolBackend | GKEBackend:
        """The backend a run spec names (its ``backend``, ``gke`` and ``priority``)."""
        return self.backend(spec["backend"], spec.get("gke"), spec.get("priority"))

    def status(self, run_uri: str) -> dict[str, Any] | None:
        return api.status(run_uri)

    def events(
        self, run_uri: str, types: tuple[str, ...] | None = None, after: str | None = None
    ) -> list[dict[str, Any]]:
        return api.events(run_uri, types, after)

    def events_since(
        self, run_uri: str, cursor: str | None, seen: Collection[str], start: str | None = None
    ) -> list[dict[str, Any]]:
        return api.events_since(run_uri, cursor, seen, start)

    def newest_event_key(self, run_uri: str) -> str | None:
        return api.newest_event_key(run_uri)

    def run_exists(self, run_uri: str) -> bool:
        return api.run_exists(run_uri)

    def committed_steps(self, run_uri: str) -> list[int]:
        return list(api.committed_steps(run_uri))

    def newest_validated(self, run_uri: str) -> int | None:
        return api.newest_validated(run_uri)

    def checkpoint_state(self, run_uri: str, step: int) -> dict[str, Any]:
        return api.checkpoint_states(run_uri).get(step, {})

    def dag_run_mark(self, run_uri: str, dag_run_id: str) -> dict[str, Any] | None:
        return api.dag_run_mark(run_uri, dag_run_id)

    def set_dag_run_mark(self, run_uri: str, dag_run_id: str, **info: Any) -> None:
        api.set_dag_run_mark(run_uri, dag_run_id, **info)

    # --- the checkpoint lifecycle ------------------------------------------------------------------

    def validate_pending(self, run_uri: str) -> list[api.Verdict]:
        return api.validate_pending(run_uri)

    def rollback(self, run_uri: str, to: int | None = None, reason: str = "") -> api.Rollback:
        return api.rollback(run_uri, to=to, reason=reason or "rollback from Airflow")

    def promote(self, run_uri: str, step: int | None = None) -> api.Promotion:
        return api.promote(run_uri, step)

    def prune(self, run_uri: str, dry_run: bool = False) -> api.Pruned:
        return api.prune(run_uri, dry_run=dry_run)

    def report(self, run_uri: str) -> dict[str, Any]:
        return dict(api.report(run_uri))

    @staticmethod
    def format_report(report: Mapping[str, Any]) -> str:
        """The run's story as ``rtrain report`` prints it, every number rounded (a report kept in an XCom, or
        one read back from an older run, may carry a loss or a time to the last bit) and meshes by the axes
        that split something."""
        r = dict(rounded(report))

        def short(mesh: Any) -> Any:  # the axes that split something (data4xfsdp2, not data4xfsdp2xtensor1)
            if not isinstance(mesh, Mapping):
                return mesh
            return {k: v for k, v in mesh.items() if v != 1 or k == "data"}

        for key, fields in (
            ("launches", ("mesh",)),
            ("recoveries", ("mesh_after",)),
            ("resizes", ("old_mesh", "new_mesh")),
        ):
            r[key] = [{**x, **{f: short(x.get(f)) for f in fields if f in x}} for x in r.get(key) or []]
        return api.format_report(r)
