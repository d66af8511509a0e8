"""Operators, sensor, hook, callbacks and the plugin: each refuses bad inputs, with a reason that names them."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk import DAG
from airflow.sdk.exceptions import AirflowFailException
from rtrain_airflow.callbacks import RTrainAlertNotifier, alert_callbacks
from rtrain_airflow.hooks.training import RTrainHook, absolute
from rtrain_airflow.operators.training import (
    RTrainBranchValidationOperator,
    RTrainPlanTopologyOperator,
    RTrainPrepareDatasetOperator,
    RTrainReleaseCapacityOperator,
    RTrainResolveRunConfigOperator,
    RTrainRollbackAndResumeOperator,
    RTrainStartTrainingJobOperator,
)
from rtrain_airflow.sensors.training import RTrainTrainingJobSensor

from training.backends import BackendError, GKEBackend

REPO = Path(__file__).resolve().parents[2]


def spec_for(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    hook = RTrainHook()
    cfg = hook.build_config({"run_name": "op", "root": str(tmp_path / "runs"), **overrides})
    return {
        "config": cfg.model_dump(mode="json"),
        "run_uri": cfg.run_uri,
        "run_name": cfg.run_name,
        "backend": cfg.placement.backend,
        "dataset": {"source": "stdlib", "max_bytes": None},
        "gke": {},
    }


@pytest.fixture
def dag() -> Any:
    with DAG("t", schedule=None) as d:
        yield d


# --- construction refuses what it can see ------------------------------------------------------


def test_operators_need_a_spec(dag: Any) -> None:
    with pytest.raises(ValueError, match="give spec"):
        RTrainPlanTopologyOperator(task_id="p")


@pytest.mark.parametrize("spec", [["not", "a", "mapping"], {"config": {}}, {"run_uri": "x", "backend": "local"}])
def test_operators_refuse_a_spec_that_is_not_one(dag: Any, spec: Any) -> None:
    with pytest.raises(AirflowFailException, match="spec"):
        RTrainStartTrainingJobOperator(task_id="l", spec=spec)


def test_templated_and_xcom_specs_are_accepted_when_parsed_and_checked_at_run_time(dag: Any, tmp_path: Path) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    templated = RTrainPlanTopologyOperator(task_id="a", spec="{{ ti.xcom_pull('resolve_config') }}")
    resolve = RTrainResolveRunConfigOperator(task_id="resolve_config")
    from_xcom = RTrainPlanTopologyOperator(task_id="b", spec=resolve.output)
    assert templated.spec.startswith("{{") and from_xcom.spec == resolve.output  # unknown until the run
    # A plain value is checked at once, when the DAG is parsed ...
    with pytest.raises(AirflowFailException, match="spec lacks run_uri, backend"):
        RTrainPlanTopologyOperator(task_id="c", spec={"config": {}})
    assert RTrainPlanTopologyOperator(task_id="d", spec=spec_for(tmp_path)).spec["backend"] == "local"
    # ... a deferred one once resolved, in execute().
    templated.spec = "what the template rendered to"
    with pytest.raises(AirflowFailException, match="spec must be the mapping resolve_config returns, got str"):
        templated.resolved_spec({})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"poll_interval": 0}, "poll_interval"),
        ({"start_timeout_s": -1}, "start_timeout_s"),
        ({"handle": {"backend": "local"}}, "handle"),
        ({"handle": "not a handle"}, "handle"),
    ],
)
def test_sensor_refuses_bad_inputs(dag: Any, tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    args = {"spec": spec_for(tmp_path), "handle": {"backend": "local", "run_uri": "/x"}, **kwargs}
    with pytest.raises(Exception, match=match):
        RTrainTrainingJobSensor(task_id="w", **args)


def test_sensor_links_to_the_runs_status(dag: Any, tmp_path: Path) -> None:
    from rtrain_airflow.sensors.training import RTrainRunStatusLink

    spec = spec_for(tmp_path)
    sensor = RTrainTrainingJobSensor(task_id="w", spec=spec, handle={"backend": "local", "run_uri": spec["run_uri"]})
    link = RTrainRunStatusLink().get_link(sensor, ti_key=None)
    from urllib.parse import quote

    assert link == f"/rtrain/runs/op/view?root={quote(str(tmp_path / 'runs'))}"
    sensor.spec = "{{ not rendered }}"
    assert RTrainRunStatusLink().get_link(sensor, ti_key=None) == ""


def test_a_stopped_job_skips_the_watch_instead_of_failing_it(dag: Any, tmp_path: Path) -> None:
    """A person's stop (``stopped``) is no failure: the sensor's task is skipped, whether it polls or deferred."""
    from airflow.sdk.exceptions import AirflowException, AirflowSkipException

    from training.events import write_status
    from training.storage import open_store

    spec = spec_for(tmp_path)
    write_status(open_store(spec["run_uri"]), state="stopped", reason="stopped with rtrain stop", job="j1", step=7)
    handle = {"backend": "local", "run_uri": spec["run_uri"], "job": "j1", "launched_at": time.time()}
    sensor = RTrainTrainingJobSensor(task_id="w", spec=spec, handle=handle, deferrable=False)
    with pytest.raises(AirflowSkipException, match="was stopped: stopped with rtrain stop"):
        sensor.poke({})
    event = {"status": "stopped", "state": "stopped", "run_uri": spec["run_uri"], "message": "stopped in the view"}
    with pytest.raises(AirflowSkipException, match="was stopped: stopped in the view"):
        sensor.execute_complete({}, event)
    with pytest.raises(AirflowException, match="is gone"):
        sensor.execute_complete({}, {**event, "status": "failed"})


def test_branch_and_rollback_refuse_bad_inputs(dag: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="two different task ids"):
        RTrainBranchValidationOperator(task_id="b", validation={}, promote_task_id="x", rollback_task_id="x")
    with pytest.raises(ValueError, match="poll_interval"):
        RTrainRollbackAndResumeOperator(task_id="r", spec=spec_for(tmp_path), poll_interval=0)
    branch = RTrainBranchValidationOperator(
        task_id="b2", validation={"verdict": "maybe"}, promote_task_id="p", rollback_task_id="r"
    )
    with pytest.raises(AirflowFailException, match="validated/rejected"):
        branch.choose_branch({})
    branch.validation = {"verdict": "rejected", "step": 30, "reason": "loss"}
    assert branch.choose_branch({}) == "r"
    branch.validation = {"verdict": "validated", "step": 30}
    assert branch.choose_branch({}) == "p"


# --- running the light operators for real -----------------------------------------------------------


def test_resolve_refuses_bad_conf_with_the_reason(dag: Any, tmp_path: Path) -> None:
    op = RTrainResolveRunConfigOperator(task_id="resolve_config")
    base: dict[str, Any] = {
        "run_name": "r",
        "storage_root": str(tmp_path),
        "preset": "tiny",
        "steps": None,
        "chaos": [],
        "overrides": {},
    }
    cases: list[tuple[dict[str, Any], str]] = [
        ({"min_workers": 3, "max_workers": 2}, "min_workers (3) > max_workers (2)"),
        ({"overrides": {"learning_rat": 0.1}}, "learning_rat: unknown key"),
        ({"overrides": {"steps": 3}}, "steps are params of their own"),
        ({"chaos": ["preempt:worker=1"]}, "missing step"),
        ({"backend": "gke", "gke": {"location": "us-east5"}}, "gke.cluster_name"),
        ({"run_name": "../x"}, "run_name"),
        ({"priority": "top"}, "unknown priority 'top'"),
        ({"backend": "gke", "priority": "high", "gke": GKE}, "needs gke.kueue_queue"),
    ]
    for params, reason in cases:
        with pytest.raises(AirflowFailException, match="invalid conf") as e:
            op.execute({"params": {**base, **params}})
        assert reason in str(e.value), (params, str(e.value))


V5E_SPOT = {
    "location": "us-east5",
    "cluster_name": "c",
    "machine_type": "ct5lp-hightpu-4t",  # 4 chips a host
    "tpu_topology": "4x4",  # 4 hosts a slice
    "image": "img:1",
    "node_pools": ["p0", "p1"],
    "spot": True,
}


def test_resolve_fits_a_gke_run_to_its_tpu_and_spot_grace_and_refuses_before_any_pool(dag: Any) -> None:
    """Chips per host and hosts per slice come from the TPU type; the notice's commit from the pods' Spot grace;
    what the JobSet's render would refuse fails the task here, with the key, before any node pool is made."""
    op = RTrainResolveRunConfigOperator(task_id="resolve_config")
    base: dict[str, Any] = {"run_name": "r", "storage_root": "gs://b/runs", "preset": "tiny", "steps": None}
    base |= {"chaos": [], "min_workers": 4, "max_workers": 8, "backend": "gke", "overrides": {"global_batch": 32}}
    cfg = RTrainHook().config_from_dict(op.execute({"params": {**base, "gke": V5E_SPOT}})["config"])
    assert (cfg.placement.devices_per_worker, cfg.placement.hosts_per_slice, cfg.checkpoint.preemption_grace_s) == (
        4,
        4,
        10,
    )
    longer = {**V5E_SPOT, "spot_shutdown_grace_s": 120}  # GKE 1.35.0-gke.1171000+: 105 s for the pods
    assert (
        op.execute({"params": {**base, "gke": longer}})["config"]["checkpoint"]["preemption_grace_s"] == 25
    )  # the preset's fits
    cases: list[tuple[dict[str, Any], str]] = [
        ({"overrides": {"global_batch": 32, "preemption_grace_s": 20}}, "preemption_grace_s: 20s"),
        ({"overrides": {"global_batch": 32, "devices_per_worker": 2}}, "devices_per_worker: ct5lp-hightpu-4t has 4"),
        ({"gke": {**V5E_SPOT, "node_pools": ["p0"]}}, "gke.node_pools: 1 pool(s) for up to 2 slices"),
        ({"gke": {**V5E_SPOT, "spot_shutdown_grace_s": 60}}, "spot_shutdown_grace_s: GKE accepts 30 or 120"),
        ({"gke": {**V5E_SPOT, "image": "bad image"}}, "image:"),
        ({"gke": {**V5E_SPOT, "kueue_queue": "Team Q"}}, "kueue_queue:"),
        ({"overrides": {"global_batch": 24}}, "min_workers/max_workers: the mesh or global_batch=24"),
    ]
    for params, reason in cases:
        with pytest.raises(AirflowFailException, match="invalid conf") as e:
            op.execute({"params": {"gke": V5E_SPOT, **base, **params}})
        assert reason in str(e.value), (params, str(e.value))


def test_resolve_returns_the_spec_with_absolute_paths(dag: Any) -> None:
    op = RTrainResolveRunConfigOperator(task_id="resolve_config")
    spec = op.execute(
        {
            "params": {
                "run_name": "r",
                "storage_root": "var/runs",
                "preset": "small",
                "steps": None,
                "max_workers": 2,
                "chaos": [],
                "overrides": {"learning_rate": 0.001},
            }
        }
    )
    cfg = RTrainHook().config_from_dict(spec["config"])
    assert (
        cfg.optimizer.steps == 150 and cfg.elastic.max_workers == 2 and cfg.optimizer.learning_rate == 0.001
    )  # null = the preset's
    assert spec["run_uri"] == str(REPO / "var" / "runs" / "r") and cfg.data.dataset.startswith(str(REPO))
    assert absolute("gs://b/p") == "gs://b/p"


def test_plan_refuses_a_model_that_does_not_fit(dag: Any, tmp_path: Path) -> None:
    spec = spec_for(
        tmp_path, preset="llama3-70b", min_workers=1, max_workers=2, devices_per_worker=2, device_memory_gib=2
    )
    with pytest.raises(AirflowFailException, match="plan refused"):
        RTrainPlanTopologyOperator(task_id="p", spec=spec).execute({})
    report = RTrainPlanTopologyOperator(task_id="p2", spec=spec_for(tmp_path)).execute({})
    assert report


def test_launch_refuses_resume_none_on_an_existing_run(dag: Any, tmp_path: Path) -> None:
    spec = spec_for(tmp_path, resume_from="none")
    store_dir = Path(spec["run_uri"])
    store_dir.mkdir(parents=True)
    (store_dir / "config.json").write_text(json.dumps(spec["config"]))
    op = RTrainStartTrainingJobOperator(task_id="l", spec=spec)
    with pytest.raises(AirflowFailException, match="resume_from=none"):
        op.execute({"run_id": "manual__1", "ti": None})


def test_launch_fails_without_retry_on_what_the_jobsets_render_refuses(dag: Any, tmp_path: Path) -> None:
    """A GKEConfigError (no ValueError) fails the task at once; a cluster's own error stays retryable."""
    from training.gke import GKEConfigError

    class Cluster:  # the render's refusal and a transient error, as the GKE backend would raise them
        def __init__(self, error: Exception) -> None:
            self.error = error

        def launch(self, *args: Any, **kwargs: Any) -> Any:
            raise self.error

    class Launch(RTrainStartTrainingJobOperator):
        error: Exception

        def backend(self, spec: Any) -> Any:
            return Cluster(self.error)

    op = Launch(task_id="l", spec=spec_for(tmp_path))
    op.error = GKEConfigError("preemption_grace_s: 25s does not fit")
    with pytest.raises(AirflowFailException, match="^preemption_grace_s: 25s"):
        op.execute({"run_id": "manual__1", "ti": SimpleNamespace(try_number=1)})
    op.error = ConnectionError("the cluster did not answer")
    with pytest.raises(ConnectionError):
        op.execute({"run_id": "manual__2", "ti": SimpleNamespace(try_number=1)})


def test_launch_refuses_a_step_that_is_not_committed(dag: Any, tmp_path: Path) -> None:
    spec = spec_for(tmp_path, resume_from="30")
    with pytest.raises(AirflowFailException, match="does not exist yet"):
        RTrainStartTrainingJobOperator(task_id="l", spec=spec).execute({"run_id": "manual__1", "ti": None})


def test_prepare_refuses_a_bad_source(dag: Any, tmp_path: Path) -> None:
    spec = spec_for(tmp_path, dataset=str(tmp_path / "data"))
    spec["dataset"] = {"source": str(tmp_path / "nothing-here-*.py"), "max_bytes": None}
    with pytest.raises(AirflowFailException):
        RTrainPrepareDatasetOperator(task_id="d", spec=spec).execute({})


def test_release_without_a_spec_releases_nothing(dag: Any) -> None:
    class TI:
        def xcom_pull(self, task_ids: str) -> None:
            return None

    op = RTrainReleaseCapacityOperator(task_id="release", spec_from="resolve_config")
    assert op.execute({"ti": TI()}) == {"released": False}


def test_release_stops_the_jobs_this_dag_run_launched(tmp_path: Path) -> None:
    """A stand-in agent with a worker child (real processes): the teardown kills both, gives the hosts back."""
    import socket
    import subprocess
    import sys

    from training.api import events
    from training.backends import JobSpec
    from training.backends.local import LocalSliceBackend, pid_alive

    spec = spec_for(tmp_path)
    cfg = RTrainHook().config_from_dict(spec["config"])
    backend = LocalSliceBackend()
    backend.provision(JobSpec.local(cfg))
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)",
        ]
    )
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # not ours: left alone
    try:
        import psutil

        deadline = time.monotonic() + 20
        while not psutil.Process(agent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        [worker] = psutil.Process(agent.pid).children()
        handle = {
            "backend": "local",
            "run_uri": cfg.run_uri,
            "job": "j1",
            "controller_pid": agent.pid,
            "host": socket.gethostname(),
        }
        result = backend.release(JobSpec.local(cfg), [handle])
        assert set(result["stopped_pids"]) == {agent.pid, worker.pid}
        assert not pid_alive(agent.pid)
        assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE
        assert pid_alive(other.pid)
        assert not Path(cfg.run_uri, "capacity.json").exists()
        assert [e["available"] for e in events(cfg.run_uri, ("capacity",))] == [cfg.elastic.max_workers, 0]
    finally:
        for p in (agent, other):
            p.kill()
            p.wait()


GKE = {
    "location": "us-east5",
    "cluster_name": "c",
    "machine_type": "ct6e-standard-4t",
    "tpu_topology": "2x2",  # one host per slice
    "image": "img",
    "node_pools": ["p0"],
}


def test_a_priority_on_gke_is_the_jobsets_kueue_priority() -> None:
    launch = RTrainHook().backend_for({"backend": "gke", "gke": {**GKE, "kueue_queue": "tpu"}, "priority": "high"})
    assert isinstance(launch, GKEBackend)
    assert (launch.placement().kueue_queue, launch.placement().priority) == ("tpu", "high")
    plain = RTrainHook().backend_for({"backend": "gke", "gke": {**GKE, "kueue_queue": "tpu"}})
    assert isinstance(plain, GKEBackend) and plain.placement().priority is None


def test_gke_backend_names_what_is_missing() -> None:
    with pytest.raises(BackendError, match="gke.image, gke.node_pools"):
        GKEBackend({"location": "l", "cluster_name": "c", "machine_type": "ct5p-hightpu-4t", "tpu_topology": "2x2x2"})
    with pytest.raises(BackendError, match="backend: one of local, gke, not 'slurm'"):
        RTrainHook().backend("slurm")


# --- alerts ------------------------------------------------------------------------------------------


def test_alerts_log_write_and_forward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="kind"):
        RTrainAlertNotifier("panic")
    sink = tmp_path / "alerts.jsonl"
    monkeypatch.setenv("RTRAIN_ALERTS_FILE", str(sink))
    got: list[Any] = []

    class TI:
        dag_id, task_id, run_id, try_number = "d", "training.watch_job", "manual__1", 2

    callbacks = alert_callbacks(forward=[got.append])
    context = {"ti": TI(), "params": {"run_name": "demo"}, "exception": RuntimeError("agent pid 7 is gone")}
    callbacks["on_retry_callback"][0].notify(context)
    callbacks["on_failure_callback"][0].notify(context)
    alerts = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [a["kind"] for a in alerts] == ["retry", "failure"]
    assert alerts[0]["reason"] == "RuntimeError: agent pid 7 is gone" and alerts[0]["run_name"] == "demo"
    assert alerts[0]["task_id"] == "training.watch_job" and alerts[0]["try_number"] == 2
    assert got == [context, context]


# --- the plugin -----------------------------------------------------------------------------------------


def test_plugin_registers_its_parts_and_serves_run_status() -> None:
    import rtrain_plugin
    from fastapi.testclient import TestClient

    from training.events import write_status
    from training.storage import open_store

    plugin = rtrain_plugin.RTrainPlugin
    assert plugin.name == "rtrain_plugin"
    assert rtrain_plugin.run_uri in plugin.macros
    assert type(plugin.operator_extra_links[0]).__name__ == "RTrainRunStatusLink"
    assert RTrainTrainingJobSensor in type(plugin.operator_extra_links[0]).operators
    assert rtrain_plugin.run_uri({"run_name": "x", "storage_root": "var/runs"}) == str(REPO / "var/runs/x")

    import airflow_test_env
    from airflow.api_fastapi.app import create_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    airflow_test_env.migrate()
    manager = create_auth_manager()
    manager.init()
    (mounted,) = plugin.fastapi_apps
    assert mounted["url_prefix"] == "/rtrain"
    client = TestClient(mounted["app"])  # built on its first request
    assert client.get("/runs/x/status").status_code == 401  # Airflow's login in front of the plugin's API
    token = manager.generate_jwt(SimpleAuthManagerUser(username="t", role="viewer"))
    client.headers["Authorization"] = "Bearer " + token
    assert client.get("/runs/..%2Fetc/status").status_code in (400, 403, 404)
    assert client.get("/runs/nope-" + uuid.uuid4().hex[:6] + "/status").status_code == 404
    assert client.get("/runs/x/status", params={"root": "/etc"}).status_code == 403
    name = "plugin-test-" + uuid.uuid4().hex[:8]
    uri = str(REPO / "var" / "runs" / name)
    try:
        write_status(open_store(uri), state="running", step=3, agent_pid=os.getpid(), host="h")
        body = client.get(f"/runs/{name}/status").json()
        assert body["state"] == "running" and body["step"] == 3
    finally:
        shutil.rmtree(uri, ignore_errors=True)


def test_the_cluster_policy_reads_any_dags_conf_without_failing() -> None:
    """The policy runs for every task of every DAG: a conf it does not understand leaves the weight alone."""
    from types import SimpleNamespace

    from rtrain_airflow.policy import prioritize, run_priority

    for conf in ({"priority": ["x"]}, {"priority": {"a": 1}}, {"priority": "top"}, {}, None, "text"):
        assert run_priority(SimpleNamespace(conf=conf)) is None
    ti = SimpleNamespace(operator="RTrainTrainingJobSensor", priority_weight=7)
    prioritize(ti, SimpleNamespace(conf={"priority": ["x"]}))
    assert ti.priority_weight == 7
    prioritize(ti, SimpleNamespace(conf={"priority": "high"}))
    prioritize(ti, SimpleNamespace(conf={"priority": "high"}))  # applied again: the same weight
    assert ti.priority_weight == 3007
    other = SimpleNamespace(operator="BashOperator", priority_weight=7)
    prioritize(other, SimpleNamespace(conf={"priority": "urgent"}))
    assert other.priority_weight == 7


def test_a_polling_sensor_makes_one_backend_for_all_its_pokes(
    dag: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each backend made is a cluster's clients on GKE: a sensor that pokes keeps one, not one per poke."""
    from rtrain_airflow.hooks.training import RTrainHook

    from training.events import write_status
    from training.storage import open_store

    spec = spec_for(tmp_path)
    write_status(open_store(spec["run_uri"]), state="pending", job="j1")
    made: list[str] = []
    real = RTrainHook.backend_for

    def backend_for(self: Any, s: Any) -> Any:
        made.append(s["backend"])
        return real(self, s)

    monkeypatch.setattr(RTrainHook, "backend_for", backend_for)
    handle = {"backend": "local", "run_uri": spec["run_uri"], "job": "j1", "launched_at": time.time()}
    sensor = RTrainTrainingJobSensor(task_id="w", spec=spec, handle=handle, deferrable=False)
    for _ in range(3):
        assert not sensor.poke({}).is_done
    assert made == ["local"]


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"poll_interval": 0}, "poll_interval: must be > 0"),
        ({"start_timeout_s": 0}, "start_timeout_s: must be > 0"),
        ({"progress_every_s": -1}, "progress_every_s: must be >= 0"),
    ],
)
def test_both_tasks_that_watch_a_job_refuse_the_same_bad_watch_settings(
    tmp_path: Path, settings: dict[str, float], refusal: str
) -> None:
    """The sensor and the rollback task watch a job the same way: one check of their settings, one trigger."""
    spec = spec_for(tmp_path)
    with pytest.raises(ValueError, match=refusal):
        RTrainTrainingJobSensor(task_id="watch", spec=spec, handle={"job": "j1"}, **settings)
    with pytest.raises(ValueError, match=refusal):
        RTrainRollbackAndResumeOperator(task_id="rollback", spec=spec, **settings)


def test_the_sensor_and_the_rollback_task_defer_to_one_trigger_made_from_their_settings(tmp_path: Path) -> None:
    from rtrain_airflow.triggers.training import RTrainTrainingJobTrigger

    spec = spec_for(tmp_path)
    cfg = RTrainHook.config_from_dict(spec["config"])
    handle = {"job": "j1", "backend": "local", "run_uri": spec["run_uri"], "events_after": "e-1"}
    watch = dict(poll_interval=2.0, start_timeout_s=60.0, progress_every_s=0.0)
    sensor = RTrainTrainingJobSensor(task_id="watch", spec=spec, handle=handle, **watch)
    rollback = RTrainRollbackAndResumeOperator(task_id="rollback", spec=spec, **watch)
    made = [RTrainTrainingJobTrigger.for_task(t, cfg, handle).serialize() for t in (sensor, rollback)]
    assert made[0] == made[1] and made[0][1]["poll_interval"] == 2.0 and made[0][1]["events_after"] == "e-1"


def test_the_airflow_side_writes_its_relaunch_policy_once() -> None:
    """Every relaunch (a watch's retry, a rerun, the resume after a rollback) goes through RTrainHook.relaunch,
    which resumes from the newest committed checkpoint: no task spells it out itself."""
    plugins = Path(__file__).resolve().parents[2] / "plugins"
    spelled = [
        f"{p.relative_to(plugins)}:{n}"
        for p in plugins.rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if 'model_copy(update={"checkpoint.resume_from"' in line
    ]
    assert len(spelled) == 1 and spelled[0].startswith("rtrain_airflow/hooks/training.py:"), spelled
    relaunches = sorted(str(p.relative_to(plugins)) for p in plugins.rglob("*.py") if "hook.relaunch(" in p.read_text())
    assert relaunches == ["rtrain_airflow/operators/training.py", "rtrain_airflow/sensors/training.py"], relaunches
