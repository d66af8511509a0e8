"""The hook of the training engine: the one place the Airflow side talks to ``training/``.

In the Google provider's manner the hook owns the clients and the operators
stay thin.  Here the "client" is the small engine API (``training.api``: plan,
launch, status, events, validate, rollback, promote, prune, report) plus a
*backend*, chosen by the run config:

* :class:`LocalSliceBackend` (the embedded default): N simulated hosts on this
  machine; capacity is ``<run>/capacity.json``; a job is the elastic agent
  process ``training.agent`` and its workers;
* :class:`GKEBackend`: TPU node pools and a JobSet per launch attempt, through
  the hooks in ``rtrain_airflow.hooks.gke_tpu`` (imported only when used).

Both answer the same four verbs (``provision``, ``launch``, ``poll``,
``release``), so the DAG, the operators and the watching trigger do not care
where the workers run.

Import cost: this module imports nothing heavy.  ``training.api`` and the
other modules it reaches at module level are plain Python; JAX, Orbax and grain
are imported by the engine only inside the calls that need them (validation,
dataset preparation), which run inside ``execute()``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from airflow.sdk import BaseHook

# The repository root (plugins/rtrain_airflow/hooks/training.py -> parents[3]).  Relative
# local paths in a run config (``var/runs``) are taken from here, not from the
# current directory of whichever Airflow process runs a task.
PROJECT_ROOT = Path(os.environ.get("RTRAIN_PROJECT_ROOT") or Path(__file__).resolve().parents[3])

# DAG params that are not Config keys (the rest map 1:1, or by PARAM_TO_CONFIG).
PARAM_TO_CONFIG = {"storage_root": "root"}
NON_CONFIG_PARAMS = frozenset({"dataset_source", "dataset_max_bytes", "overrides", "gke", "steps_per_run"})
LOCAL_PATH_KEYS = ("root", "dataset", "compilation_cache")
RUN_NAME_PATTERN = r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"

# Terminal and live job states as the backends report them (training.events.STATES).
ALIVE = ("pending", "starting", "running", "recovering", "waiting_for_capacity")


class RTrainConfigError(ValueError):
    """A DAG run's params that do not make a runnable config (the message names the key)."""


def absolute(uri: str, root: Path = PROJECT_ROOT) -> str:
    """A local path made absolute against the project root; gs:// URIs unchanged."""
    if uri.startswith("gs://") or os.path.isabs(uri):
        return uri
    return str((root / uri).resolve())


def safe_key(text: str) -> str:
    """A store key component from free text (an Airflow run id has ``:`` and ``+``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:200]


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


# --- backends ------------------------------------------------------------------------------------


class LocalSliceBackend:
    """The embedded default: the elastic agent and its workers on this machine."""

    name = "local"

    def __init__(self, log: Any = None) -> None:
        self.log = log

    def _say(self, msg: str, *args: Any) -> None:
        if self.log is not None:
            self.log.info(msg, *args)

    def provision(self, cfg: Any, spec: Mapping[str, Any]) -> dict[str, Any]:
        """Give the simulated slice its hosts: capacity = max_workers."""
        from training.capacity import LocalCapacity
        from training.events import EventLog
        from training.storage import open_store

        store = open_store(cfg.run_uri)
        LocalCapacity(store, default=cfg.max_workers).set(cfg.max_workers, reason="provisioned by Airflow")
        EventLog(store, source="airflow").emit("capacity", available=cfg.max_workers, reason="provisioned")
        return {"backend": self.name, "hosts": cfg.max_workers, "run_uri": cfg.run_uri}

    def wait_for_stale_lock(self, run_uri: str, max_wait_s: float = 90.0) -> None:
        """Launch only when no other live writer holds the run.

        A live holder on this host is the agent launch() re-attaches to; a holder on another
        host is refused (two writers never share a run).  A dead holder on this host loses its
        lease at once (training.ledger); one the lock still sees alive (our own unreaped child,
        a zombie) is reaped here, or at worst waited out (<= the 60 s lease).
        """
        from training.ledger import RunLock
        from training.storage import open_store

        lock = RunLock(open_store(run_uri), owner="airflow-probe")
        deadline = time.time() + max_wait_s
        while True:
            holder = lock.held_by()
            if holder is None:
                return
            local = holder.get("host") == socket.gethostname()
            if local and pid_alive(holder.get("pid")):
                return  # a live agent: launch() re-attaches to it
            if local and lock.held_by() is None:
                return  # it was our own unreaped child; reaped now, the lock sees it dead
            if not local:
                raise RuntimeError(
                    f"run {run_uri} is locked by {holder.get('owner')} on host {holder.get('host')} "
                    f"until {holder.get('expires_at'):.0f}; not launching a second writer"
                )
            wait = float(holder["expires_at"]) - time.time() + 0.5
            if time.time() + wait > deadline:
                raise RuntimeError(f"run {run_uri}: the lease of dead agent pid {holder.get('pid')} outlasts {max_wait_s}s")
            self._say("The lock of %s is held by dead agent pid %s; waiting %.0fs for its lease to expire",
                      run_uri, holder.get("pid"), wait)
            time.sleep(max(wait, 0.1))

    def launch(self, cfg: Any, spec: Mapping[str, Any], attempt: int) -> dict[str, Any]:
        """Launch the agent, or re-attach to the live one (``training.api.launch`` is idempotent)."""
        from training import api

        self.wait_for_stale_lock(cfg.run_uri)
        after = RTrainHook().newest_event_key(cfg.run_uri)
        launched_at = time.time()
        # The agent's log lives with the run (its workers' logs are in <run>/logs/attempt-*/ already).
        logs = str(Path(cfg.run_uri) / "logs") if not cfg.run_uri.startswith("gs://") else absolute("var/logs")
        res = api.launch(cfg, detach=True, log_dir=logs)
        return {
            "backend": self.name,
            "run_uri": cfg.run_uri,
            "attached": bool(res.get("attached")),
            "agent_pid": int(res["agent_pid"]),
            "launched_at": launched_at,
            "host": socket.gethostname(),
            "events_after": after,
        }

    def poll(self, handle: Mapping[str, Any], timeouts: Mapping[str, float], now: float | None = None) -> dict[str, Any]:
        """One look at the job: ``{"state", "reason", "status"}``; state is one of ALIVE, finished, failed."""
        from training import api

        now = time.time() if now is None else now
        st = api.status(handle["run_uri"]) or {}
        pid = handle.get("agent_pid")
        ours = bool(st) and (handle.get("attached") or st.get("agent_pid") == pid or
                             float(st.get("updated_at", 0)) >= float(handle.get("launched_at", 0)))
        if not ours:
            if pid and not pid_alive(pid):
                return {"state": "failed", "status": st,
                        "reason": f"agent pid {pid} exited before it reported; see {handle['run_uri']}/logs/agent-*.log"}
            if now - float(handle.get("launched_at", now)) > timeouts.get("start_timeout_s", 300):
                return {"state": "failed", "status": st,
                        "reason": f"the agent did not report within {timeouts.get('start_timeout_s')}s"}
            return {"state": "pending", "status": st, "reason": ""}
        state = st.get("state")
        if state in ("finished", "failed"):
            return {"state": state, "status": st, "reason": st.get("reason", "")}
        agent = st.get("agent_pid")
        if st.get("host") == socket.gethostname() and not pid_alive(agent):
            return {"state": "failed", "status": st,
                    "reason": f"agent pid {agent} is gone while the job was {state} (killed?)"}
        age = now - float(st.get("updated_at", now))
        if age > timeouts.get("stale_after_s", 900):
            return {"state": "failed", "status": st, "reason": f"no status update for {age:.0f}s while {state}"}
        return {"state": state or "pending", "status": st, "reason": ""}

    def release(self, cfg: Any, spec: Mapping[str, Any], handles: list[Mapping[str, Any]]) -> dict[str, Any]:
        """Stop the jobs of ``handles`` still running (agent first, so it relaunches nothing); give the hosts back."""
        from training.events import EventLog
        from training.storage import open_store

        stopped: list[int] = []
        pids = {int(h["agent_pid"]) for h in handles if h.get("agent_pid") and h.get("host") == socket.gethostname()}
        for pid in sorted(pids):
            if pid_alive(pid):
                stopped.extend(stop_process_tree(pid))
        store = open_store(cfg.run_uri)
        store.delete("capacity.json")
        EventLog(store, source="airflow").emit("capacity", available=0, reason="released by Airflow teardown",
                                               stopped=stopped)
        return {"backend": self.name, "stopped_pids": stopped, "released": True}


def stop_process_tree(pid: int) -> list[int]:
    """SIGKILL an agent, then its workers (each is its own session leader)."""
    import signal

    import psutil

    try:
        parent = psutil.Process(pid)
        children = parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    killed = []
    for proc in [parent, *children]:
        try:
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc.pid)
        except ProcessLookupError:
            pass
    for proc in [parent, *children]:
        pid_alive(proc.pid)  # reap ours
    psutil.wait_procs([parent, *children], timeout=10)
    return killed


class GKEBackend:
    """TPU node pools and one JobSet per launch attempt on GKE (``rtrain_airflow.hooks.gke_tpu``).

    ``spec["gke"]`` carries the cluster and the slice shape: ``project_id``, ``location``,
    ``cluster_name``, ``machine_type``, ``tpu_topology``, ``image``, ``node_pools`` (one per
    slice), and optionally ``namespace``, ``spot``, ``node_locations``, ``service_account``,
    ``gcp_conn_id``.  The workers write the run's events to the gs:// run root; the
    JobSet's state says whether the attempt is alive.  A lost host fails the JobSet
    (``maxRestarts: 0``) and the sensor's retry relaunches a new attempt that resumes
    from the newest committed checkpoint.
    """

    name = "gke"
    REQUIRED = ("location", "cluster_name", "machine_type", "tpu_topology", "image", "node_pools")

    def __init__(self, gke: Mapping[str, Any], log: Any = None) -> None:
        missing = [k for k in self.REQUIRED if not gke.get(k)]
        if missing:
            raise RTrainConfigError(f"gke: backend 'gke' needs {', '.join('gke.' + k for k in missing)}")
        self.gke = dict(gke)
        self.log = log

    def _gke_hook(self) -> Any:
        from rtrain_airflow.hooks.gke_tpu import GKETPUHook

        return GKETPUHook(gcp_conn_id=self.gke.get("gcp_conn_id", "google_cloud_default"), location=self.gke["location"])

    def _jobsets(self) -> Any:
        from rtrain_airflow.hooks.gke_tpu import JobSetHook

        kube = self._gke_hook().get_kubernetes_hook(cluster_name=self.gke["cluster_name"],
                                                    project_id=self.gke.get("project_id"))
        return JobSetHook(kube)

    def _tpu(self) -> Any:
        from training.backends.gke import TPUSlice

        return TPUSlice(self.gke["machine_type"], self.gke["tpu_topology"])

    def provision(self, cfg: Any, spec: Mapping[str, Any]) -> dict[str, Any]:
        from rtrain_airflow.hooks.gke_tpu import TPUNodePoolSpec

        hook = self._gke_hook()
        created = []
        for pool in self.gke["node_pools"]:
            pool_spec = TPUNodePoolSpec(
                name=pool, machine_type=self.gke["machine_type"], tpu_topology=self.gke["tpu_topology"],
                spot=bool(self.gke.get("spot", False)), node_locations=tuple(self.gke.get("node_locations", ())),
                service_account=self.gke.get("node_service_account"),
            )
            op = hook.create_tpu_node_pool(cluster_name=self.gke["cluster_name"], spec=pool_spec,
                                           project_id=self.gke.get("project_id"), wait_to_complete=True)
            created.append({"node_pool": pool, "created": op is not None})
        return {"backend": self.name, "node_pools": created}

    def launch(self, cfg: Any, spec: Mapping[str, Any], attempt: int) -> dict[str, Any]:
        from training.api import prepare_run
        from training.backends.gke import GKELaunch, check_config, jobset_state, plan_slices, render
        from training.mesh import check_fit

        tpu = self._tpu()
        check_config(cfg, tpu)
        check_fit(cfg)
        jobsets = self._jobsets()
        available = jobsets.capacity(tpu, self.gke["node_pools"]).available()
        num_slices = plan_slices(cfg, tpu, available)
        if num_slices == 0:
            raise RuntimeError(f"capacity: {available} ready hosts, fewer than min_workers={cfg.min_workers}")
        launch = GKELaunch(image=self.gke["image"], namespace=self.gke.get("namespace", "default"),
                           service_account=self.gke.get("service_account", "rtrain-worker"),
                           node_pools=tuple(self.gke["node_pools"]), spot=bool(self.gke.get("spot", False)))
        manifests = render(cfg, tpu, launch, num_slices, attempt)
        after = RTrainHook().newest_event_key(cfg.run_uri)
        prepare_run(cfg)
        obj = jobsets.create(manifests)
        return {"backend": self.name, "run_uri": cfg.run_uri, "attached": False, "jobset": manifests.name,
                "namespace": manifests.namespace, "num_slices": num_slices, "launched_at": time.time(),
                "state": jobset_state(obj), "gke": self.gke, "events_after": after}

    def poll(self, handle: Mapping[str, Any], timeouts: Mapping[str, float], now: float | None = None) -> dict[str, Any]:
        from training import api

        state = self._jobsets().state(handle["jobset"], handle["namespace"])
        finished = [e for e in api.events(handle["run_uri"], ("finished", "failed"))
                    if e["time"] >= float(handle.get("launched_at", 0))]
        if state == "completed" or (finished and finished[-1]["type"] == "finished"):
            return {"state": "finished", "status": {"jobset": state}, "reason": ""}
        if state in ("failed", "missing"):
            return {"state": "failed", "status": {"jobset": state}, "reason": f"JobSet {handle['jobset']} is {state}"}
        return {"state": "running" if state == "running" else "pending", "status": {"jobset": state}, "reason": ""}

    def release(self, cfg: Any, spec: Mapping[str, Any], handles: list[Mapping[str, Any]]) -> dict[str, Any]:
        deleted = []
        jobsets = self._jobsets()
        for h in handles:
            if h.get("jobset") and jobsets.delete(h["jobset"], h.get("namespace", "default")):
                deleted.append(h["jobset"])
        hook = self._gke_hook()
        for pool in self.gke["node_pools"]:
            hook.delete_tpu_node_pool(cluster_name=self.gke["cluster_name"], node_pool_name=pool,
                                      project_id=self.gke.get("project_id"), wait_to_complete=True)
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

    def build_config(self, overrides: Mapping[str, Any]) -> Any:
        """The validated Config (``training.config.load_config``), local paths made absolute."""
        from training.config import ConfigError, load_config

        ov = dict(overrides)
        name = str(ov.get("run_name", ""))
        if name and not re.match(RUN_NAME_PATTERN, name):
            raise RTrainConfigError(f"run_name: {name!r} must match {RUN_NAME_PATTERN} (no '..', no '/')")
        try:
            cfg = load_config(str(ov.get("preset") or "tiny"), None, ov)
        except ConfigError as e:
            raise RTrainConfigError(str(e)) from None
        except ValueError as e:  # chaos grammar and the like
            raise RTrainConfigError(str(e)) from None
        updates = {k: absolute(getattr(cfg, k)) for k in LOCAL_PATH_KEYS}
        return cfg.model_copy(update=updates)

    @staticmethod
    def config_from_dict(data: Mapping[str, Any]) -> Any:
        from training.config import Config

        return Config.model_validate(dict(data))

    # --- planning and data -------------------------------------------------------------------

    def plan(self, cfg: Any) -> dict[str, Any]:
        """Mesh plans and the memory-fit check; raises ``training.mesh.PlanError`` with the numbers."""
        from training import api

        return dict(api.plan(cfg))

    def prepare_dataset(self, source: str | None, output: str, seq_len: int, max_bytes: int | None,
                        progress: Callable[[str], None] | None = None, refresh: bool = False) -> dict[str, Any]:
        """Prepare (idempotently) the byte-level dataset; imports numpy/array_record, so call it in execute().

        ``refresh``: a source whose content changed replaces the prepared dataset (continual training);
        otherwise a different dataset at ``output`` is refused.
        """
        from training import data

        src = None if source in (None, "", "stdlib") else (source if source.startswith("gs://") else absolute(source))
        manifest = data.prepare(src, output, seq_len, max_bytes=max_bytes, progress=progress, overwrite=refresh)
        return {
            "dataset": output,
            "fingerprint": manifest["fingerprint"],
            "train_records": manifest["splits"]["train"]["records"],
            "validation_records": manifest["splits"]["validation"]["records"],
            "seq_len": manifest["seq_len"],
        }

    # --- the job -------------------------------------------------------------------------------

    def backend(self, name: str, gke: Mapping[str, Any] | None = None) -> LocalSliceBackend | GKEBackend:
        if name == "local":
            return LocalSliceBackend(self.log)
        if name == "gke":
            return GKEBackend(gke or {}, self.log)
        raise RTrainConfigError(f"backend: 'local' or 'gke', not {name!r}")

    def status(self, run_uri: str) -> dict[str, Any] | None:
        from training import api

        return api.status(run_uri)

    def events(self, run_uri: str, types: tuple[str, ...] | None = None, after: str | None = None) -> list[dict[str, Any]]:
        from training.events import EventLog
        from training.storage import open_store

        return EventLog(open_store(run_uri)).read(types=types, after_key=after)

    def newest_event_key(self, run_uri: str) -> str | None:
        from training.storage import open_store

        keys = [k for k in open_store(run_uri).list("events/") if k.endswith(".json")]
        return max(keys) if keys else None

    def run_exists(self, run_uri: str) -> bool:
        from training.storage import open_store

        return bool(open_store(run_uri).exists("config.json"))

    def committed_steps(self, run_uri: str) -> list[int]:
        from training import api

        return list(api.committed_steps(run_uri))

    def ledger(self, run_uri: str) -> Any:
        from training.ledger import Ledger
        from training.storage import open_store

        return Ledger(open_store(run_uri))

    # A DAG run's own marks in the run root: what its first launch did, so that a retry
    # or a cleared task does not redo it (roll back again, refuse its own run as "existing").
    def dag_run_mark(self, run_uri: str, dag_run_id: str) -> dict[str, Any] | None:
        from training.storage import NotFound, open_store

        try:
            return dict(json.loads(open_store(run_uri).get(f"airflow/{safe_key(dag_run_id)}.json")))
        except NotFound:
            return None

    def set_dag_run_mark(self, run_uri: str, dag_run_id: str, **info: Any) -> None:
        from training.storage import AlreadyExists, open_store

        data = json.dumps({"dag_run_id": dag_run_id, "time": time.time(), **info}, sort_keys=True).encode()
        try:
            open_store(run_uri).create(f"airflow/{safe_key(dag_run_id)}.json", data)
        except AlreadyExists:
            pass

    # --- the checkpoint lifecycle ------------------------------------------------------------------

    def validate_pending(self, run_uri: str) -> list[dict[str, Any]]:
        from training import api

        return list(api.validate_pending(run_uri))

    def rollback(self, run_uri: str, to: int | None = None, reason: str = "") -> dict[str, Any]:
        from training import api

        return dict(api.rollback(run_uri, to=to, reason=reason or "rollback from Airflow"))

    def promote(self, run_uri: str, step: int | None = None) -> dict[str, Any]:
        from training import api

        return dict(api.promote(run_uri, step))

    def prune(self, run_uri: str, dry_run: bool = False) -> dict[str, Any]:
        from training import api

        return dict(api.prune(run_uri, dry_run=dry_run))

    def report(self, run_uri: str) -> dict[str, Any]:
        from training import api

        return dict(api.report(run_uri))

    @staticmethod
    def format_report(report: Mapping[str, Any]) -> str:
        from training.lifecycle import format_report

        return str(format_report(dict(report)))
