"""The Google Cloud production path: JobSets on the cluster, the GKE backend, the Airflow connection's credentials.

GKE cannot be reached from here, so:

* the engine's ``ClusterManagerClient`` talks gRPC to an in-process ClusterManager service on
  127.0.0.1 (``tests/cluster_manager.py``; the node pool requests themselves are checked in
  ``tests/training/test_backends_gke*.py``);
* the engine's JobSets go through the real kubernetes client to a small fake Kubernetes API server
  on 127.0.0.1;
* the Airflow hook hands the engine the credentials of a real Airflow connection.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import kubernetes_validate
import pytest
import yaml
from cluster_manager import FakeClusterManager, PoolStatus
from google.api_core.exceptions import FailedPrecondition
from google.auth.credentials import AnonymousCredentials
from google.cloud import container_v1
from kubernetes import client as k8s_client
from rtrain_airflow.hooks.gke_tpu import ProviderCluster

from training.api import load_config
from training.backends import BackendError, GKEBackend, GKESpec, JobSpec
from training.backends.gke_cluster import CloudCluster
from training.backends.gke_jobsets import KubeJobSets
from training.backends.gke_pools import Backoff, TPUNodePoolError
from training.gke import GKEConfigError, GKELaunch, TPUSlice, render

REPO = Path(__file__).resolve().parents[2]
PROJECT = "rtrain-prod"
LOCATION = "us-east5"
CLUSTER = "train"
CONN_ID = "rtrain_test_gcp"
CLUSTER_PATH = f"projects/{PROJECT}/locations/{LOCATION}/clusters/{CLUSTER}"


@pytest.fixture(autouse=True)
def gcp_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Google connection as Airflow reads it from the environment (anonymous: nothing is called)."""
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{CONN_ID.upper()}",
        json.dumps({"conn_type": "google_cloud_platform", "extra": {"project": PROJECT, "is_anonymous": True}}),
    )


class FakeKubernetes:
    """Services, JobSets and Nodes of one cluster, served over HTTP as the Kubernetes API does."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, namespace, name)
        self.nodes: list[dict[str, Any]] = []
        self.pods: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.collected: set[str] = set()  # pods listed but gone (pod GC) by the time they are deleted
        self.deleted_jobs: list[tuple[str, str | None]] = []  # (child Job, propagation policy)
        self.unavailable = 0  # the next requests answered 503, as an API server restarting does (-1: all of them)

    def handle(self, method: str, url: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        path, query = urlparse(url).path, parse_qs(urlparse(url).query)
        self.requests.append((method, path))
        if self.unavailable:
            self.unavailable -= 1 if self.unavailable > 0 else 0
            return 503, status(503, "ServiceUnavailable", "the server is currently unable to handle the request")
        if path == "/api/v1/nodes" and method == "GET":
            selector = [kv.split("=", 1) for kv in query.get("labelSelector", [""])[0].split(",") if kv]
            items = [n for n in self.nodes if all(selects(n["metadata"].get("labels", {}), *kv) for kv in selector)]
            return 200, {"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": items}
        one = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", path)
        if one and method == "DELETE":
            with self.lock:
                found = [p for p in self.pods if p["metadata"]["name"] == one.group(2)]
                self.pods = [p for p in self.pods if p not in found]
            if not found or one.group(2) in self.collected:
                return 404, status(404, "NotFound", f'pods "{one.group(2)}" not found')
            return 200, found[0]
        job = re.fullmatch(r"/apis/batch/v1/namespaces/([^/]+)/jobs/([^/]+)", path)
        if job and method == "DELETE":
            # DeleteOptions' policy: in the body, or the query string (the Python client sends it there)
            policy = (body or {}).get("propagationPolicy") or query.get("propagationPolicy", [None])[0]
            self.deleted_jobs.append((job.group(2), policy))
            return 200, status(200, "", f'jobs "{job.group(2)}" deleted')
        pods = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", path)
        if pods and method == "GET":
            wanted = dict(kv.split("=", 1) for kv in query.get("labelSelector", [""])[0].split(",") if kv)
            items = [
                p
                for p in self.pods
                if p["metadata"].get("namespace") == pods.group(1)
                and all(p["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
            ]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/services(?:/([^/]+))?", path) or re.fullmatch(
            r"/apis/jobset\.x-k8s\.io/v1alpha2/namespaces/([^/]+)/jobsets(?:/([^/]+))?", path
        )
        if not m:
            return 404, status(404, "NotFound", path)
        kind = "Service" if "/services" in path else "JobSet"
        ns, name = m.group(1), m.group(2)
        with self.lock:
            if method == "POST" and name is None:
                assert body is not None and body["kind"] == kind
                key = (kind, ns, body["metadata"]["name"])
                if key in self.objects:
                    return 409, status(409, "AlreadyExists", f'{kind.lower()}s "{key[2]}" already exists')
                obj = copy.deepcopy(body)
                obj["metadata"].update(namespace=ns, uid=f"uid-{len(self.objects)}")
                self.objects[key] = obj
                return 201, obj
            key = (kind, ns, name or "")
            if key not in self.objects:
                return 404, status(404, "NotFound", f'{kind.lower()}s "{name}" not found')
            if method == "GET":
                return 200, self.objects[key]
            if method == "DELETE":
                self.objects[key]["deleteOptions"] = body
                return 200, self.objects.pop(key)
        return 405, status(405, "MethodNotAllowed", method)


def selects(labels: dict[str, str], key: str, value: str | None = None) -> bool:
    """One term of a label selector: ``key=value``, or ``key`` (the label exists)."""
    return key in labels if value is None else labels.get(key) == value


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "reason": reason,
        "message": message,
        "code": code,
    }


@pytest.fixture
def k8s() -> Iterator[tuple[FakeKubernetes, str]]:
    api = FakeKubernetes()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            code, payload = api.handle(self.command, self.path, json.loads(raw) if raw else None)
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _serve

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def jobset_hook(url: str) -> KubeJobSets:
    """The engine's JobSets over the real kubernetes client, pointed at the fake API server."""
    conf = k8s_client.Configuration()
    conf.host = url
    return KubeJobSets(k8s_client.ApiClient(conf))


def tpu_node(name: str, pool: str, ready: bool = True, topology: str = "4x4") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "cloud.google.com/gke-nodepool": pool,
                "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                "cloud.google.com/gke-tpu-topology": topology,
            },
        },
        "spec": {},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


CONFIG = {
    "preset": "tiny",
    "backend": "gke",
    "root": "gs://rtrain-prod/runs",
    "run_name": "llama-8b",
    "devices_per_worker": 4,
    "min_workers": 4,
    "max_workers": 16,
    "global_batch": 64,
}


@pytest.fixture(scope="module")
def gs_config(gcs_emulator: str) -> dict[str, Any]:
    """CONFIG with a gs:// run root and a prepared gs:// dataset in the emulator (a launch checks both)."""
    import uuid

    from training import data

    prefix = f"gs://rtrain-test/gke-{uuid.uuid4().hex[:8]}"
    data.prepare(None, f"{prefix}/data", 64, max_bytes=60_000)
    return {**CONFIG, "root": f"{prefix}/runs", "dataset": f"{prefix}/data"}


def start(url: str, config: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """Start a job of the run on the fake cluster, as the GKE backend's launch does."""
    shape = {"machine_type": "ct6e-standard-4t", "tpu_topology": "4x4", **overrides}
    tpu = TPUSlice(shape["machine_type"], shape["tpu_topology"])
    cfg = load_config(overrides={**(config or CONFIG), "hosts_per_slice": tpu.hosts})
    launch = GKELaunch(image="us-docker.pkg.dev/p/rtrain/train:1", namespace="training")
    return dict(jobset_hook(url).start_job(cfg, tpu, launch))


@pytest.mark.gcs
def test_start_takes_the_run_writes_its_config_and_creates_a_jobset_of_agents(
    k8s: tuple[FakeKubernetes, str], gs_config: dict[str, Any]
) -> None:
    from training import api as engine

    api, url = k8s
    cfg = dict(gs_config, run_name="start-1")
    result = start(url, cfg)
    # Every slice max_workers allows is asked for (missing nodes leave pods Pending; the job is elastic).
    assert result["num_slices"] == 4 and result["backend"] == "gke" and result["state"] == "running"
    run_uri = f"{gs_config['root']}/start-1"
    assert result["run_uri"] == run_uri
    jobset = api.objects[("JobSet", "training", result["jobset"])]
    assert jobset["spec"]["replicatedJobs"][0]["replicas"] == 4
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 0}
    (container,) = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["rtrain", "agent", run_uri]
    assert {"name": "RTRAIN_JOB", "value": result["job"]} in container["env"]
    service = api.objects[("Service", "training", result["jobset"])]
    # The Service belongs to the JobSet: deleting the JobSet (anyone's delete) takes it along.
    assert service["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "name": result["jobset"],
            "uid": jobset["metadata"]["uid"],
            "blockOwnerDeletion": True,
        }
    ]
    kubernetes_validate.validate(
        {k: v for k, v in service.items() if k != "deleteOptions"}, kubernetes_validate.latest_version(), strict=True
    )
    # The run is the job's: its config (hosts_per_slice from the TPU shape), a pending status, the lock handed over.
    written = engine.load_run_config(run_uri)
    assert (written.placement.hosts_per_slice, written.placement.backend) == (4, "gke")
    assert engine.status(run_uri)["job"] == result["job"]
    assert engine.job_state(result)["state"] == "pending"


@pytest.mark.gcs
def test_a_second_start_while_a_job_holds_the_run_is_refused_and_writes_nothing(
    k8s: tuple[FakeKubernetes, str], gs_config: dict[str, Any]
) -> None:
    from training import api as engine

    api, url = k8s
    cfg = dict(gs_config, run_name="start-2")
    first = start(url, cfg)
    run_uri = f"{gs_config['root']}/start-2"
    before = engine.load_run_config(run_uri).optimizer.learning_rate
    with pytest.raises(Exception, match="refused: run .* is locked by") as e:
        start(url, {**cfg, "learning_rate": 0.5})
    assert first["job"] in str(e.value)
    assert engine.load_run_config(run_uri).optimizer.learning_rate == before  # the refused launch wrote nothing
    assert sum(1 for k in api.objects if k[0] == "JobSet") == 1


def test_start_refuses_a_config_that_cannot_run_on_gke_before_anything_is_made(
    k8s: tuple[FakeKubernetes, str],
) -> None:
    api, url = k8s
    with pytest.raises(GKEConfigError, match="^root:"):
        start(url, {**CONFIG, "root": "var/runs"})
    with pytest.raises(GKEConfigError, match="^devices_per_worker:"):
        start(url, machine_type="ct6e-standard-8t", tpu_topology="2x4")
    assert api.objects == {} and api.requests == []


def test_jobset_state_and_delete(k8s: tuple[FakeKubernetes, str]) -> None:
    api, url = k8s
    hook = jobset_hook(url)
    cfg = load_config(overrides={**CONFIG, "hosts_per_slice": 4})
    m = render(cfg, TPUSlice("ct6e-standard-4t", "4x4"), GKELaunch(image="img:1", namespace="training"), "j5")
    hook.create(m)
    assert hook.state(m.name, "training") == "running"
    api.objects[("JobSet", "training", m.name)]["status"] = {"terminalState": "Failed", "restarts": 0}
    assert hook.state(m.name, "training") == "failed"

    assert hook.delete(m.name, "training") is True
    assert not api.objects
    assert hook.state(m.name, "training") == "missing"
    assert hook.delete(m.name, "training") is False


def pod(name: str, jobset: str, status: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "training", "labels": {"jobset.sigs.k8s.io/jobset-name": jobset}},
        "spec": {"containers": [{"name": "agent", "image": "img:1"}]},
        "status": status,
    }


UNSCHEDULABLE = {
    "phase": "Pending",
    "conditions": [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient google.com/tpu. preemption: 0/3 nodes are available",
        }
    ],
}
IMAGE_PULL = {
    "phase": "Pending",
    "conditions": [{"type": "PodScheduled", "status": "True"}],
    "containerStatuses": [
        {
            "name": "agent",
            "ready": False,
            "restartCount": 0,
            "image": "img:1",
            "imageID": "",
            "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "img:1"'}},
        }
    ],
}
RUNNING = {
    "phase": "Running",
    "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
    "containerStatuses": [
        {
            "name": "agent",
            "ready": True,
            "restartCount": 0,
            "image": "img:1",
            "imageID": "x",
            "state": {"running": {"startedAt": "2026-12-01T10:00:00Z"}},
        }
    ],
}


def test_why_the_jobset_s_pods_wait_is_read_from_the_cluster_and_told_in_one_line(
    k8s: tuple[FakeKubernetes, str],
) -> None:
    api, url = k8s
    hook = jobset_hook(url)
    api.pods = [
        pod("js-slice-0-0", "js", RUNNING),
        pod("js-slice-1-0", "js", UNSCHEDULABLE),
        pod("js-slice-1-1", "js", UNSCHEDULABLE),
        pod("js-slice-2-0", "js", IMAGE_PULL),
        pod("other-0", "other", UNSCHEDULABLE),  # another JobSet's
    ]
    line = hook.waiting("js", "training")
    assert line.startswith("2 pods Unschedulable (0/3 nodes are available: 3 Insufficient google.com/tpu.")
    assert "no node can take it: the TPU node pools are still being created" in line
    assert '1 pod ImagePullBackOff (Back-off pulling image "img:1"): the nodes cannot pull the image' in line
    api.pods = [pod("js-slice-0-0", "js", RUNNING)]
    assert hook.waiting("js", "training") == ""

    # An agent that exits at start leaves a Failed pod (restartPolicy Never); one on its way out is not told.
    def ended(code: int, reason: str, message: str = "") -> dict[str, Any]:
        state = {"terminated": {"exitCode": code, "reason": reason, **({"message": message} if message else {})}}
        return {"name": "agent", "ready": False, "restartCount": 0, "image": "img:1", "imageID": "x", "state": state}

    failed = {"phase": "Failed", "containerStatuses": [ended(3, "Error", "config refused")]}
    oom = {"phase": "Failed", "containerStatuses": [ended(137, "OOMKilled")]}
    evicted = {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."}
    leaving = pod("js-slice-3-0", "js", UNSCHEDULABLE)
    leaving["metadata"]["deletionTimestamp"] = "2026-12-01T10:00:00Z"
    api.pods = [pod("a", "js", failed), pod("b", "js", oom), pod("c", "js", evicted), leaving]
    line = hook.waiting("js", "training")
    assert "1 pod Failed (exit code 3: config refused): the agent exited with an error" in line
    assert "1 pod OOMKilled (exit code 137): the agent ran out of the pod's memory" in line
    assert "1 pod Evicted (The node was low on resource: memory.)" in line and "Unschedulable" not in line
    # A failed pod stays after its index's next pod started: that one is told, not the old one.
    index = {"jobset.sigs.k8s.io/job-index": "0", "batch.kubernetes.io/job-completion-index": "1"}
    old, new = pod("js-slice-0-1-a", "js", failed), pod("js-slice-0-1-b", "js", RUNNING)
    for p in (old, new):
        p["metadata"]["labels"].update(index)
    api.pods = [old, new]
    assert hook.waiting("js", "training") == ""


def test_the_gke_backend_s_poll_says_why_pods_wait_or_that_kueue_holds_the_jobset(
    k8s: tuple[FakeKubernetes, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    api, url = k8s
    hook = jobset_hook(url)
    cfg = load_config(overrides={**CONFIG, "hosts_per_slice": 4})
    m = render(cfg, TPUSlice("ct6e-standard-4t", "4x4"), GKELaunch(image="img:1", namespace="training"), "j7")
    hook.create(m)
    api.pods = [pod(f"{m.name}-slice-0-0", m.name, UNSCHEDULABLE)]
    gke = {
        "location": LOCATION,
        "cluster_name": CLUSTER,
        "machine_type": "ct6e-standard-4t",
        "tpu_topology": "4x4",
        "image": "img:1",
        "node_pools": ["slice-0"],
        "kueue_queue": "tpu-v6e",
    }
    backend = GKEBackend(gke, CloudCluster(gke, AnonymousCredentials(), api_client=hook.api_client))
    run = tmp_path / "run"
    handle: dict[str, Any] = {"backend": "gke", "run_uri": str(run), "job": "j7", "jobset": m.name}
    handle |= {"namespace": "training", "launched_at": time.time()}
    look = backend.poll(handle, {"start_timeout_s": 900})
    assert look["state"] not in ("finished", "failed")
    assert look["waiting"].startswith("1 pod Unschedulable (0/3 nodes are available")
    # Pods waiting for nodes the cluster is still to make (flex-start, a stockout): past the start timeout,
    # the job waits up to the provisioning timeout, then fails saying why.
    later = handle["launched_at"] + 1000
    assert backend.poll(handle, {"start_timeout_s": 900}, now=later)["state"] == "pending"
    failed = backend.poll(handle, {"start_timeout_s": 900}, now=handle["launched_at"] + 3700)
    assert (
        failed["state"] == "failed"
        and "did not start within 3600s; pods waiting: 1 pod Unschedulable" in failed["reason"]
    )
    # Kueue holds the JobSet: no start timeout, but the admission deadline (its pools bill meanwhile).
    api.objects[("JobSet", "training", m.name)]["spec"]["suspend"] = True
    look = backend.poll(handle, {"start_timeout_s": 900}, now=handle["launched_at"] + 1700)
    assert look["state"] == "pending"
    assert look["waiting"] == "the JobSet is suspended: waiting for Kueue to admit it (queue tpu-v6e)"
    assert backend.poll(handle, {"start_timeout_s": 900}, now=handle["launched_at"] + 1900)["state"] == "failed"
    # Pods that run but whose agents never write the job's status: the start timeout.
    api.objects[("JobSet", "training", m.name)]["spec"]["suspend"] = False
    api.pods = [pod(f"{m.name}-slice-0-0", m.name, RUNNING)]
    assert backend.poll(handle, {"start_timeout_s": 900}, now=later)["state"] == "failed"


def test_capacity_and_ready_nodes_through_the_kubernetes_client(k8s: tuple[FakeKubernetes, str]) -> None:
    api, url = k8s
    api.nodes = [tpu_node(f"a-{i}", "slice-a") for i in range(4)] + [tpu_node("b-0", "slice-b", ready=False)]
    hook = jobset_hook(url)
    assert hook.capacity(TPUSlice("ct6e-standard-4t", "4x4")).available() == 4
    assert [n.metadata.name for n in hook.list_ready_nodes("slice-a")] == ["a-0", "a-1", "a-2", "a-3"]
    assert hook.list_ready_nodes("slice-b") == []
    assert len(hook.list_nodes("slice-b")) == 1


def _shipped_dag_params() -> dict[str, Any]:
    """The trigger form (Params) of the shipped DAG ``resilient_training``, from dags/resilient_training.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rtrain_shipped_dags", REPO / "dags" / "resilient_training.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.training_params(continual=False))


def test_the_gke_conf_in_docs_gke_md_triggers_the_shipped_dag() -> None:
    """The conf of §7.1 passes the DAG's params, resolves, and fits the TPU shape it names."""
    from airflow.sdk.definitions.param import ParamsDict
    from rtrain_airflow.operators.training import RTrainResolveRunConfigOperator

    from training.api import check_fit, config_from_dict
    from training.gke import TPUSlice, check_config
    from training.gke.tpu import feasible_slices, slice_bounds

    text = (REPO / "docs" / "gke.md").read_text()
    (raw,) = [b for b in re.findall(r"```json\n(.*?)```", text, re.S) if '"backend": "gke"' in b]
    conf = json.loads(raw)
    params = ParamsDict(_shipped_dag_params())
    params.update(conf)
    values = params.validate()  # what the REST API and the CLI check before they create the DAG run
    spec = RTrainResolveRunConfigOperator(task_id="resolve_config").execute({"params": values})
    assert (
        spec["backend"] == "gke"
        and spec["run_uri"].startswith("gs://")
        and spec["config"]["data"]["dataset"].startswith("gs://")
    )
    gke = spec["gke"]
    cfg, tpu = config_from_dict(spec["config"]), TPUSlice(gke["machine_type"], gke["tpu_topology"])
    check_config(cfg, tpu)
    assert feasible_slices(cfg, tpu) == [1, 2, 4]
    assert len(gke["node_pools"]) == slice_bounds(cfg.elastic, tpu)[1]  # one pool per slice the job may use
    check_fit(cfg)
    # The REST call and the CLI both send this file.
    assert "/api/v2/dags/resilient_training/dagRuns" in text and '"conf\\": $(cat conf.json)' in text
    assert 'airflow dags trigger resilient_training --conf "$(cat conf.json)"' in text


def test_docs_gke_md_uses_one_zone_and_cites_only_the_repository() -> None:
    text = (REPO / "docs" / "gke.md").read_text()
    zones = set(re.findall(r"\bus-[a-z]+\d-[a-z]\b", text))
    assert zones == {"us-central1-a"}, zones  # it offers v5e (the test run) and v5p (the DAG's run)
    assert "ZONE=us-central1-a" in text
    assert not re.search(r"\.\./|DESIGN\.md|shared/", text)
    for path in set(re.findall(r"`((?:docker|docs|dags|plugins|training|tests)/[\w./-]+\.\w+)", text)):
        assert (REPO / path).exists(), path


def test_the_test_run_of_docs_gke_md_passes_every_check_before_billing(tmp_path: Path) -> None:
    """The gke.yml and the ``rtrain train --gke`` line of §7.2 resolve, fit the shape, and name the right pools."""
    import shlex

    from training.backends.gke_run import GKERun, hosts_per_slice, load_settings
    from training.cli import build_parser
    from training.gke import check_config
    from training.gke.tpu import feasible_slices

    text = (REPO / "docs" / "gke.md").read_text()
    (settings,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "machine_type: ct5lp" in b]
    (gke_yml := tmp_path / "gke.yml").write_text(settings)
    (line,) = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "rtrain train --preset tiny --gke" in b]
    train = next(c for c in line.replace("\\\n", " ").splitlines() if c.startswith("rtrain train"))
    argv = shlex.split(train.replace("$BUCKET", "rtrain-prod-runs").replace("gke.yml", str(gke_yml)))[1:]
    args = build_parser().parse_args(argv)
    gke = load_settings(args.gke)
    cfg = load_config(
        args.preset, args.config, [*args.overrides, "backend=gke", f"hosts_per_slice={hosts_per_slice(gke)}"]
    )
    tpu = TPUSlice(gke["machine_type"], gke["tpu_topology"])
    check_config(cfg, tpu)
    assert (tpu.hosts, feasible_slices(cfg, tpu)) == (2, [1, 2])
    assert len(gke["node_pools"]) == cfg.elastic.max_workers // tpu.hosts == 2
    run = GKERun(cfg, gke, CloudCluster(gke, AnonymousCredentials()))
    assert [p.node_count for p in run.cluster.pool_specs()] == [2, 2] and all(p.spot for p in run.cluster.pool_specs())


# --- module hygiene ------------------------------------------------------------------------------------


def test_plugins_import_no_ml_framework() -> None:
    code = (
        "import sys; sys.path.insert(0, 'plugins')\n"
        "import rtrain_airflow.hooks.gke_tpu, rtrain_airflow.hooks.training, training.backends.gke_cluster\n"
        "heavy = ('jax', 'flax', 'optax', 'orbax', 'grain', 'tensorstore')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


# --- the production-like Airflow: docker/ ------------------------------------------------------------------

COMPOSE = REPO / "docker" / "compose.yaml"
COMPOSE_ENV = {
    "POSTGRES_PASSWORD": "pw",
    "AIRFLOW_JWT_SECRET": "jwt",
    "AIRFLOW_FERNET_KEY": "fernet",
    "GCP_PROJECT": PROJECT,
}


def test_compose_file_runs_airflow_3_components_on_postgres_with_local_executor() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())  # PyYAML resolves the << merge keys as compose does
    services = spec["services"]
    commands = {name: s.get("command") for name, s in services.items()}
    for component in ("api-server", "scheduler", "dag-processor", "triggerer"):
        assert component in commands.values(), f"no {component} service"
    assert "webserver" not in commands.values()  # the Airflow 2 name
    assert services["postgres"]["image"].startswith("postgres:")
    assert "healthcheck" in services["postgres"]
    airflow = {n: s for n, s in services.items() if n.startswith("airflow-")}
    for name, s in airflow.items():
        env = s["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor", name
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://airflow:"), name
        assert "@postgres:5432/airflow" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"], name
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"
        assert s["depends_on"]["postgres"]["condition"] == "service_healthy", name
        assert s["build"]["dockerfile"] == "docker/Dockerfile.airflow"
        assert (
            json.loads(re.sub(r"\$\{[^}]*\}", "", env["AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT"]))["conn_type"]
            == "google_cloud_platform"
        )
        if name != "airflow-init":
            assert s["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully", name
            assert "healthcheck" in s, name
    assert airflow["airflow-init"]["environment"]["_AIRFLOW_DB_MIGRATE"] == "true"
    assert (REPO / services["airflow-scheduler"]["build"]["dockerfile"]).exists()


def test_airflow_image_is_the_official_one_with_our_code() -> None:
    text = (REPO / "docker" / "Dockerfile.airflow").read_text()
    version = re.search(r"^ARG AIRFLOW_VERSION=(\S+)$", text, re.M)
    assert version and "FROM apache/airflow:${AIRFLOW_VERSION}-python3.12" in text
    pinned = re.search(r"^apache-airflow==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert pinned and version.group(1) == pinned.group(1) == "3.3.2"
    assert "--constraint constraints.txt" in text
    for path in ("dags /opt/airflow/dags", "plugins /opt/airflow/plugins"):
        assert path in text


# The Airflow containers that read or write run roots and prepared data: the scheduler (its LocalExecutor task
# processes launch the local slice and its agents, prepare data, validate), the triggerer (the deferrable watch
# reads the run root), the api-server (the plugin's /rtrain API) and the dag-processor (callbacks of tasks that
# died outside a task process run there).
RUN_ROOT_READERS = ("airflow-scheduler", "airflow-triggerer", "airflow-apiserver", "airflow-dag-processor")


def test_compose_shares_the_project_var_volume_and_names_the_training_image_once() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    mounts = {}
    for name in RUN_ROOT_READERS:
        s = services[name]
        root = s["environment"]["RTRAIN_PROJECT_ROOT"]
        assert root.startswith("/"), name
        targets = {v.split(":")[1]: v.split(":")[0] for v in s["volumes"]}
        assert f"{root}/var" in targets, f"{name}: nothing mounted at {root}/var"
        mounts[name] = (root, targets[f"{root}/var"])
    ((root, volume),) = set(mounts.values())  # one volume, at one path, in all of them
    assert volume in spec["volumes"], "the shared var/ must be a named volume of the file"
    # The image seeds the new volume writable for the airflow user (uid 50000, the compose file's user).
    dockerfile = (REPO / "docker" / "Dockerfile.airflow").read_text()
    assert f"mkdir -p {root}/var" in dockerfile and f"chown -R airflow:root {root}" in dockerfile
    assert all(s.get("user", "").startswith("50000:") for n, s in services.items() if n.startswith("airflow-"))

    # The training image: one variable, defined once (in the common environment), seen by every Airflow
    # container, and no image reference for the pods anywhere else in the file.
    text = COMPOSE.read_text()
    assert len(re.findall(r"^\s+RTRAIN_TRAIN_IMAGE:", text, re.M)) == 1
    assert all(
        s["environment"]["RTRAIN_TRAIN_IMAGE"] == "${RTRAIN_TRAIN_IMAGE:-}"
        for n, s in services.items()
        if n.startswith("airflow-")
    )

    def strings(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for k, v in node.items():
                yield str(k)
                yield from strings(v)
        elif isinstance(node, list):
            for v in node:
                yield from strings(v)
        elif isinstance(node, str):
            yield node

    assert not [s for s in strings(spec) if "/rtrain/train" in s or "Dockerfile.train" in s]


def test_resolve_takes_the_training_image_from_the_environment_unless_the_conf_names_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow.sdk.exceptions import AirflowFailException
    from rtrain_airflow.operators.training import RTrainResolveRunConfigOperator

    gke = {
        "project_id": PROJECT,
        "location": LOCATION,
        "cluster_name": CLUSTER,
        "machine_type": "ct5p-hightpu-4t",
        "tpu_topology": "2x2x4",
        "node_pools": ["p0", "p1"],
        "namespace": "training",
    }
    params = {
        "run_name": "img",
        "preset": "tiny",
        "storage_root": "gs://rtrain-prod-runs/runs",
        "dataset": "gs://rtrain-prod-runs/data/stdlib",
        "backend": "gke",
        "gke": gke,
        "min_workers": 4,
        "max_workers": 8,
        "devices_per_worker": 4,
        "chaos": [],
        "overrides": {},
    }
    op = RTrainResolveRunConfigOperator(task_id="resolve_config")
    monkeypatch.delenv("RTRAIN_TRAIN_IMAGE", raising=False)
    with pytest.raises(AirflowFailException, match="gke.image"):
        op.execute({"params": params})
    monkeypatch.setenv("RTRAIN_TRAIN_IMAGE", "")  # compose's default when the host leaves it unset
    with pytest.raises(AirflowFailException, match="gke.image"):
        op.execute({"params": params})
    monkeypatch.setenv("RTRAIN_TRAIN_IMAGE", "us-east5-docker.pkg.dev/rtrain-prod/rtrain/train:env")
    spec = op.execute({"params": params})
    assert spec["gke"] == {**gke, "image": "us-east5-docker.pkg.dev/rtrain-prod/rtrain/train:env"}
    assert spec["config"]["placement"]["hosts_per_slice"] == 4
    named = op.execute({"params": {**params, "gke": {**gke, "image": "conf/train:1"}}})
    assert named["gke"]["image"] == "conf/train:1"  # the conf wins
    local = op.execute(
        {
            "params": {
                **params,
                "backend": "local",
                "storage_root": "var/runs",
                "dataset": None,
                "devices_per_worker": None,
                "gke": {},
            }
        }
    )
    assert local["gke"] == {}  # only a gke run takes it


def _compose_cli() -> list[str] | None:
    """``docker compose`` (the v2 plugin), else ``docker-compose`` (v1, e.g. Debian's package); None: neither."""
    if shutil.which("docker") is not None:
        ok = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0
        if ok:
            return ["docker", "compose"]
    if shutil.which("docker-compose") is not None:
        ok = subprocess.run(["docker-compose", "version"], capture_output=True, timeout=60).returncode == 0
        if ok:
            return ["docker-compose"]
    return None


@pytest.mark.skipif(
    _compose_cli() is None, reason="neither `docker compose` (the v2 plugin) nor `docker-compose` (v1) is installed"
)
def test_docker_compose_validates_the_file_offline() -> None:
    cli = _compose_cli()
    assert cli is not None
    image = "us-east5-docker.pkg.dev/rtrain-prod/rtrain/train:abc1234"
    env = {**os.environ, **COMPOSE_ENV, "RTRAIN_TRAIN_IMAGE": image}
    subprocess.run([*cli, "-f", str(COMPOSE), "config", "--quiet"], env=env, check=True, timeout=60)
    # The resolved file: the image given once on the host reaches every Airflow container, with the project root.
    out = subprocess.run(
        [*cli, "-f", str(COMPOSE), "config"], env=env, check=True, capture_output=True, text=True, timeout=60
    )
    resolved = yaml.safe_load(out.stdout)["services"]
    for name in RUN_ROOT_READERS:
        assert resolved[name]["environment"]["RTRAIN_TRAIN_IMAGE"] == image, name
        assert resolved[name]["environment"]["RTRAIN_PROJECT_ROOT"] == "/opt/rtrain", name
    missing = {k: v for k, v in env.items() if k != "AIRFLOW_JWT_SECRET"}
    bad = subprocess.run(
        [*cli, "-f", str(COMPOSE), "config", "--quiet"], env=missing, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0 and "AIRFLOW_JWT_SECRET" in bad.stderr


def gke_conf(**keys: Any) -> dict[str, Any]:
    """The DAG conf's ``gke`` object for the fake cluster: a v6e 4x4 shape unless ``keys`` say otherwise."""
    base = {"project_id": PROJECT, "location": LOCATION, "cluster_name": CLUSTER}
    return {**base, "machine_type": "ct6e-standard-4t", "tpu_topology": "4x4", "image": "img", **keys}


def provisioned_config(root: str, dataset: str, min_workers: int, max_workers: int, hosts_per_slice: int) -> Any:
    """The tiny preset on GKE as provisioning checks it before any pool: its root and prepared data in the emulator,
    4 chips a host, and a global batch every size from min to max workers splits."""
    overrides = {"root": root, "backend": "gke", "devices_per_worker": 4, "global_batch": 192, "dataset": dataset}
    return load_config(
        "tiny",
        None,
        overrides | {"min_workers": min_workers, "max_workers": max_workers, "hosts_per_slice": hosts_per_slice},
    )


def cloud(gke: dict[str, Any], client: container_v1.ClusterManagerClient) -> CloudCluster:
    return CloudCluster(gke, AnonymousCredentials(), cluster_manager=client, poll_s=0.001, backoff=Backoff(0.01, 0.01))


def test_the_gke_backend_provisions_for_min_workers_and_reports_each_pool(
    gcs_root: str,
    gs_data: str,
    pools: tuple[FakeClusterManager, container_v1.ClusterManagerClient],
) -> None:
    fake, client = pools
    gke = gke_conf(node_pools=[f"slice-{i}" for i in range(4)])
    backend = GKEBackend(gke, cloud(gke, client))
    cfg = provisioned_config(gcs_root, gs_data, 8, 16, 4)
    fake.fail_pools["slice-1"] = "ZONE_RESOURCE_POOL_EXHAUSTED"
    fake.slow_pools["slice-3"] = 1000
    result = backend.provision(JobSpec(cfg, GKESpec(gke)))
    assert result["need"] == 2, "8 hosts of 4-host slices"
    assert sorted(result["node_pools_up"]) == ["slice-0", "slice-2"] and result["node_pools_creating"] == ["slice-3"]
    assert list(result["node_pools_failed"]) == ["slice-1"]
    fake.fail_pools["slice-1"] = "ZONE_RESOURCE_POOL_EXHAUSTED"
    cfg_all = provisioned_config(gcs_root, gs_data, 16, 16, 4)
    with pytest.raises(TPUNodePoolError, match="of the 4 node pools the job needs at least are up"):
        backend.gke["provision_timeout_s"] = 0.05
        backend.provision(JobSpec(cfg_all, GKESpec(gke)))


def test_queued_provisioning_needs_flex_start_and_a_kueue_queue() -> None:
    gke = {k: "x" for k in GKEBackend.REQUIRED} | {"node_pools": ["p"], "queued_provisioning": True}
    with pytest.raises(BackendError, match="needs gke.kueue_queue"):
        GKEBackend({**gke, "flex_start": True})
    with pytest.raises(BackendError, match="flex-start pools only"):
        GKEBackend({**gke, "kueue_queue": "q"})
    GKEBackend({**gke, "flex_start": True, "kueue_queue": "q"})


def test_the_gke_backend_makes_flex_start_pools_when_the_conf_asks(
    gcs_root: str,
    gs_data: str,
    pools: tuple[FakeClusterManager, container_v1.ClusterManagerClient],
) -> None:
    fake, client = pools
    gke = gke_conf(
        machine_type="ct5p-hightpu-4t",
        tpu_topology="2x2x2",
        node_pools=["slice-0", "slice-1"],
        flex_start=True,
        queued_provisioning=True,
        kueue_queue="tpu-v5p",
    )
    backend = GKEBackend(gke, cloud(gke, client))
    cfg = provisioned_config(gcs_root, gs_data, 2, 4, 2)
    assert sorted(backend.provision(JobSpec(cfg, GKESpec(gke)))["node_pools_up"]) == ["slice-0", "slice-1"]
    made = list(fake.pools.values())
    assert len(made) == 2 and all(p.config.flex_start and p.queued_provisioning.enabled for p in made)
    assert all(p.initial_node_count == 0 and p.autoscaling.total_max_node_count == 2 for p in made)


def test_the_sensor_s_log_says_why_pods_wait_once_per_change(
    k8s: tuple[FakeKubernetes, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import structlog
    from rtrain_airflow.hooks.training import RTrainHook
    from rtrain_airflow.triggers.training import RTrainTrainingJobTrigger

    from training.events import write_status
    from training.storage import open_store

    api, url = k8s
    hook = jobset_hook(url)
    cfg = load_config(overrides={**CONFIG, "hosts_per_slice": 4})
    m = render(cfg, TPUSlice("ct6e-standard-4t", "4x4"), GKELaunch(image="img:1", namespace="training"), "j8")
    hook.create(m)
    api.pods = [pod(f"{m.name}-slice-0-0", m.name, IMAGE_PULL)]
    gke: dict[str, Any] = {"location": LOCATION, "cluster_name": CLUSTER, "machine_type": "ct6e-standard-4t"}
    gke |= {"tpu_topology": "4x4", "image": "img:1", "node_pools": ["slice-0"]}
    backend = GKEBackend(gke, CloudCluster(gke, AnonymousCredentials(), api_client=hook.api_client))
    made: list[str] = []  # the backends (and so clusters and clients) the watch makes: one for all its looks
    closed: list[str] = []
    real_close = backend.close

    def make(self: Any, *a: Any, **k: Any) -> GKEBackend:
        made.append("gke")
        return backend

    def close() -> None:
        closed.append("gke")
        real_close()

    monkeypatch.setattr(RTrainHook, "backend", make)
    monkeypatch.setattr(backend, "close", close)
    run = str(tmp_path / "run")
    store = open_store(run)
    write_status(store, state="pending", job="j8")
    h: dict[str, Any] = {"backend": "gke", "run_uri": run, "job": "j8", "jobset": m.name, "namespace": "training"}
    h |= {"launched_at": time.time(), "events_after": None, "attached": False}

    def later() -> None:
        time.sleep(0.6)
        other_message = copy.deepcopy(IMAGE_PULL)
        other_message["containerStatuses"][0]["state"]["waiting"]["message"] = "ErrImagePull again"
        api.pods = [pod(f"{m.name}-slice-0-0", m.name, other_message)]  # the same reason: not told again
        time.sleep(0.6)
        api.pods = [pod(f"{m.name}-slice-0-0", m.name, RUNNING)]
        time.sleep(0.6)
        write_status(store, state="finished", job="j8", step=10)

    t = threading.Thread(target=later)
    t.start()
    trigger = RTrainTrainingJobTrigger(run, h, poll_interval=0.1, progress_every_s=0)
    with structlog.testing.capture_logs() as logs:
        event = asyncio.run(asyncio.wait_for(anext(aiter(trigger.run())), 30)).payload
    t.join()
    assert event["status"] == "success", event
    assert made == ["gke"] and closed == ["gke"]  # one cluster for the watch, its clients closed at its end
    lines = [str(r["event"]) for r in logs if str(r["event"]).startswith("[rtrain] ")]
    waits = [line for line in lines if "pod" in line]
    assert waits == [
        '[rtrain] pods waiting: 1 pod ImagePullBackOff (Back-off pulling image "img:1"): the nodes cannot pull the '
        "image: check gke.image, and the node pool's scopes and service account (Artifact Registry reader, "
        "docs/gke.md section 2)",
        "[rtrain] no pod waits any more",
    ], lines
    # The same, on the run's record: the Training view's timeline tells it.
    from rtrain_airflow.runview import chart_data

    from training.event_text import describe
    from training.events import EventLog

    told = [e for e in EventLog(store).read() if e["type"] == "pods_waiting"]
    assert [e["reason"].split(" (")[0] for e in told] == ["1 pod ImagePullBackOff", ""]
    assert describe(told[1]) == "no pod waits any more" and describe(told[0]).startswith("pods waiting: 1 pod")
    timeline = [
        row for row in chart_data(EventLog(store).read(), {}, None)["timeline"] if row["type"] == "pods_waiting"
    ]
    assert [row["text"] for row in timeline] == [describe(e) for e in told]


def test_the_airflow_hook_hands_the_engine_the_connection_s_credentials_and_project() -> None:
    gke = gke_conf(gcp_conn_id=CONN_ID, node_pools=["slice-0"])
    del gke["project_id"]
    cluster = ProviderCluster(gke)
    assert isinstance(cluster, CloudCluster)
    assert isinstance(cluster.credentials(), AnonymousCredentials)  # the connection is anonymous
    assert cluster.project == PROJECT  # the connection's project
    with pytest.raises(BackendError, match="^gke.gcp_conn_id: Airflow's connection 'no_such_conn' gave no"):
        ProviderCluster(gke_conf(gcp_conn_id="no_such_conn", node_pools=["p"])).credentials()


def test_the_gke_backend_is_made_with_the_airflow_connection_by_the_hook_and_with_adc_elsewhere() -> None:
    from rtrain_airflow.hooks.training import RTrainHook

    from training.backends import backend

    gke = gke_conf(gcp_conn_id=CONN_ID, node_pools=["slice-0"])
    made = RTrainHook().backend("gke", gke)
    assert isinstance(made, GKEBackend) and type(made.cluster) is ProviderCluster
    plain = backend("gke", gke=gke)  # rtrain train: Application Default Credentials
    assert isinstance(plain, GKEBackend) and type(plain.cluster) is CloudCluster


@pytest.mark.gcs
def test_rtrain_train_s_gke_run_checks_provisions_launches_follows_and_releases(
    k8s: tuple[FakeKubernetes, str],
    pools: tuple[FakeClusterManager, container_v1.ClusterManagerClient],
    gs_config: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What ``rtrain train --gke FILE`` does, against the gRPC ClusterManager and the Kubernetes API server here."""
    from training.backends.gke_run import GKERun
    from training.events import write_status
    from training.storage import open_store

    api, url = k8s
    fake, client = pools
    gke = gke_conf(node_pools=["slice-0", "slice-1", "slice-2", "slice-3"], namespace="training")
    cfg = load_config(overrides={**gs_config, "run_name": "cli-1", "hosts_per_slice": 4, "min_workers": 16})
    cluster = CloudCluster(
        gke,
        AnonymousCredentials(),
        cluster_manager=client,
        api_client=jobset_hook(url).api_client,
        poll_s=0.001,
        backoff=Backoff(0.01, 0.01),
    )
    run = GKERun(cfg, gke, cluster)
    run.check()
    fake.refuse_next["slice-2"] = [FailedPrecondition("Cluster is running incompatible operation operation-7")]
    said: list[str] = []
    handle = run.start(said.append)
    assert said[0] == "node pools up: slice-0, slice-1, slice-3, slice-2"  # slice-2 once its busy cluster was free
    assert ("JobSet", "training", handle["jobset"]) in api.objects
    api.pods = [pod(f"{handle['jobset']}-slice-0-0", handle["jobset"], UNSCHEDULABLE)]
    store = open_store(cfg.run_uri)

    def later() -> None:
        time.sleep(0.5)
        api.pods = []
        write_status(store, state="finished", job=handle["job"], step=10)

    threading.Thread(target=later).start()
    statuses: list[Any] = []
    look = run.follow(handle, said.append, statuses.append, poll_s=0.05)
    assert look["state"] == "finished" and statuses[-1]["step"] == 10
    assert said[2].startswith("pods waiting: 1 pod Unschedulable") and said[3] == "no pod waits any more"
    # rtrain status, events and stop work on the gke run from here: they read and write its gs:// run root.
    from training.cli import main

    capsys.readouterr()
    assert main(["status", cfg.run_uri]) == 0 and "finished" in capsys.readouterr().out
    assert main(["events", cfg.run_uri]) == 0 and "config written by rtrain (try 1)" in capsys.readouterr().out
    assert main(["stop", cfg.run_uri, "--reason", "done here"]) == 0
    assert run.release([handle]) == f"deleted JobSets {handle['jobset']}; node pools slice-0, slice-1, slice-2, slice-3"
    assert fake.pools == {} and not any(k[0] == "JobSet" for k in api.objects)


def test_rtrain_train_s_gke_run_fails_in_one_line_when_too_few_pools_come_up_and_gives_them_back(
    gcs_root: str, gs_data: str, pools: tuple[FakeClusterManager, container_v1.ClusterManagerClient], tmp_path: Path
) -> None:
    from training.api import LaunchError
    from training.backends.gke_run import GKERun

    fake, client = pools
    gke = gke_conf(node_pools=["slice-0", "slice-1"], node_locations=["us-central1-a"])
    cfg = provisioned_config(gcs_root, gs_data, 8, 8, 4)
    run = GKERun(cfg, gke, cloud(gke, client))
    fake.fail_pools["slice-1"] = "ZONE_RESOURCE_POOL_EXHAUSTED: no capacity"
    with pytest.raises(LaunchError) as e:
        run.start(lambda line: None)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("gke: 1 of the 2 node pools the job needs at least are up (slice-0)")
    assert "slice-1: no ct6e-standard-4t 4x4 capacity left in us-central1-a (a stockout)" in msg
    assert len(fake.pools) == 2  # one up, one left in ERROR: both billed or holding quota until deleted
    assert run.release([]) == "deleted JobSets none; node pools slice-0, slice-1"
    assert fake.pools == {}


def gke_run_here(
    k8s: tuple[FakeKubernetes, str],
    pools: tuple[FakeClusterManager, container_v1.ClusterManagerClient],
    gs_config: dict[str, Any],
    name: str,
) -> Any:
    """A ``rtrain train --gke`` run against the gRPC ClusterManager and the Kubernetes API server here."""
    from training.backends.gke_run import GKERun

    gke = gke_conf(node_pools=["slice-0"], namespace="training")
    cfg = load_config(overrides={**gs_config, "run_name": name, "hosts_per_slice": 4})
    cluster = CloudCluster(
        gke,
        AnonymousCredentials(),
        cluster_manager=pools[1],
        api_client=jobset_hook(k8s[1]).api_client,
        poll_s=0.001,
        backoff=Backoff(0.01, 0.01),
    )
    return GKERun(cfg, gke, cluster)


@pytest.mark.gcs
def test_a_followed_gke_job_outlives_failed_looks_and_is_given_back_only_at_its_end(
    k8s: tuple[FakeKubernetes, str],
    pools: tuple[FakeClusterManager, container_v1.ClusterManagerClient],
    gs_config: dict[str, Any],
) -> None:
    from training.events import write_status
    from training.storage import open_store

    api, _ = k8s
    run = gke_run_here(k8s, pools, gs_config, "follow-1")
    said: list[str] = []

    def on_status(st: Any) -> None:
        if st.get("state") != "running":
            return
        if "restarting" not in said:
            said.append("restarting")
            api.unavailable = 3  # the API server restarts: the next three looks fail
        else:  # a look succeeded again: the job ends
            write_status(open_store(run.cfg.run_uri), state="finished", job=st["job"], step=10)

    def start_training(line: str) -> None:
        said.append(line)
        if line.startswith("job "):
            write_status(open_store(run.cfg.run_uri), state="running", job=line.split()[1].rstrip(":"), step=3)

    look = run.drive(start_training, on_status, poll_s=0.01)
    assert look is not None and look["state"] == "finished", said
    failed = [line for line in said if line.startswith("looking at the job failed")]
    assert len(failed) == 3 and "503" in failed[0], said
    assert said[-1].startswith("deleted JobSets ") and pools[0].pools == {}


@pytest.mark.gcs
def test_a_gke_job_out_of_touch_for_long_is_left_up_saying_so_in_one_line(
    k8s: tuple[FakeKubernetes, str],
    pools: tuple[FakeClusterManager, container_v1.ClusterManagerClient],
    gs_config: dict[str, Any],
) -> None:
    api, _ = k8s
    run = gke_run_here(k8s, pools, gs_config, "follow-2")
    said: list[str] = []

    def start(line: str) -> None:
        said.append(line)
        if line.startswith("job "):
            api.unavailable = -1  # from now on no look succeeds

    assert run.drive(start, lambda st: None, poll_s=0.01, give_up_s=0.2) is None
    assert said[-1].startswith("no look at job ") and "left up" in said[-1]
    assert "gcloud container node-pools delete slice-0" in said[-1]
    assert len(pools[0].pools) == 1 and any(k[0] == "JobSet" for k in api.objects)  # nothing deleted


def test_a_stopped_gke_job_exits_7_and_a_failed_one_1() -> None:
    from training.cli import Exit, gke_exit

    assert gke_exit({"state": "stopped", "reason": "interrupted", "status": {}}, 10) == Exit.STOPPED
    assert gke_exit({"state": "cancelled", "reason": "", "status": {}}, 10) == Exit.STOPPED
    assert gke_exit({"state": "failed", "reason": "x", "status": {}}, 10) == Exit.FAILED
    assert gke_exit({"state": "finished", "reason": "", "status": {"step": 10}}, 10) == Exit.OK


def test_failed_leaders_a_newer_pod_replaces_are_deleted_each_even_when_one_is_gone_already(
    k8s: tuple[FakeKubernetes, str],
) -> None:
    from training.gke.names import COMPLETION_INDEX_ANNOTATION, EXCLUSIVE_TOPOLOGY_ANNOTATION, JOB_INDEX_LABEL

    api, url = k8s
    hook = jobset_hook(url)
    failed = {"phase": "Failed"}

    def leader(name: str, slice_index: int, st: dict[str, Any]) -> dict[str, Any]:
        p = pod(name, "js", st)
        p["metadata"]["labels"][JOB_INDEX_LABEL] = str(slice_index)
        p["metadata"]["annotations"] = {EXCLUSIVE_TOPOLOGY_ANNOTATION: "x", COMPLETION_INDEX_ANNOTATION: "0"}
        return p

    api.pods = [
        leader("js-slice-0-0-a", 0, failed),
        leader("js-slice-0-0-b", 0, RUNNING),
        leader("js-slice-1-0-a", 1, failed),
        leader("js-slice-1-0-b", 1, RUNNING),
    ]
    api.collected = {"js-slice-0-0-a"}  # pod GC took it between the list and the delete
    hook.waiting("js", "training")
    assert sorted(p["metadata"]["name"] for p in api.pods) == ["js-slice-0-0-b", "js-slice-1-0-b"]


def test_a_detached_gke_run_is_told_how_to_clean_up_and_who_repairs_its_slices() -> None:
    from training.backends.gke_run import detached_line

    line = detached_line("gs://b/runs/r", gke_conf(node_pools=["slice-0"]))
    assert "rtrain status gs://b/runs/r" in line and "gcloud container node-pools delete slice-0" in line
    assert "the slices' leader pods repair the JobSet" in line and "rtrain-repairs Role" in line and "\n" not in line


def test_pools_refused_for_now_when_enough_were_up_are_made_by_the_job_s_looks(
    gcs_root: str,
    gs_data: str,
    k8s: tuple[FakeKubernetes, str],
    pools: tuple[FakeClusterManager, container_v1.ClusterManagerClient],
    tmp_path: Path,
) -> None:
    api, url = k8s
    fake, client = pools
    busy = "Cluster is running incompatible operation operation-7. Please wait and try again."
    gke = gke_conf(node_pools=["slice-0", "slice-1", "slice-2"], namespace="training")
    cfg = provisioned_config(gcs_root, gs_data, 4, 12, 4)
    hook = jobset_hook(url)
    backend = GKEBackend(
        gke,
        CloudCluster(
            gke,
            AnonymousCredentials(),
            cluster_manager=client,
            api_client=hook.api_client,
            poll_s=0.001,
            backoff=Backoff(0.05, 0.05),
        ),
    )
    fake.refuse_next["slice-1"] = [FailedPrecondition(busy)] * 50  # busy until the first pool is up
    fake.refuse_next["slice-2"] = [FailedPrecondition(busy)] * 50
    up = backend.provision(JobSpec(cfg, GKESpec(gke)))
    assert up["node_pools_up"] == ["slice-0"] and up["node_pools_creating"] == []
    assert sorted(up["node_pools_retrying"]) == ["slice-1", "slice-2"]
    assert f"{CLUSTER_PATH}/nodePools/slice-1" not in fake.pools
    fake.refuse_next.clear()  # the cluster is free again
    m = render(
        load_config(overrides={**CONFIG, "hosts_per_slice": 4}),
        TPUSlice("ct6e-standard-4t", "4x4"),
        GKELaunch(image="img", namespace="training"),
        "j9",
    )
    hook.create(m)
    handle: dict[str, Any] = {"backend": "gke", "run_uri": str(tmp_path / "run"), "job": "j9", "jobset": m.name}
    handle |= {"namespace": "training", "launched_at": time.time()}
    deadline = time.monotonic() + 10
    while len(fake.pools) < 3 or any(p.status != PoolStatus.RUNNING for p in fake.pools.values()):
        assert time.monotonic() < deadline, fake.calls
        backend.poll(handle, {"start_timeout_s": 900})
        time.sleep(0.02)
    # Airflow's trigger looks from another process: its first look finds each pool and makes a missing one.
    fake.pools.pop(f"{CLUSTER_PATH}/nodePools/slice-2")
    other = GKEBackend(
        gke, CloudCluster(gke, AnonymousCredentials(), cluster_manager=client, api_client=hook.api_client, poll_s=0.001)
    )
    other.poll(handle, {"start_timeout_s": 900})
    assert f"{CLUSTER_PATH}/nodePools/slice-2" in fake.pools


def test_the_form_and_docs_gke_md_say_init_from_must_be_gs_on_gke() -> None:
    param = _shipped_dag_params()["init_from"]
    help_text = str(param.schema.get("description_md") or param.description)
    assert "On GKE it must be `gs://`" in help_text
    doc = (REPO / "docs" / "gke.md").read_text()
    assert "| `init_from` | a Hugging Face Llama checkpoint to start from: on GKE a `gs://` directory" in doc
    assert "How much state that commits is\nan estimate, not a measurement" in doc


def _slice_pod(slice_: int, index: int, status: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """A pod of JobSet ``js``'s slice Job ``slice_`` as the API lists it (exclusive placement on node pools)."""
    p = pod(f"js-slice-{slice_}-{index}-{len(status)}", "js", status)
    p["metadata"]["labels"]["jobset.sigs.k8s.io/job-index"] = str(slice_)
    p["metadata"]["annotations"] = {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool",
        "batch.kubernetes.io/job-completion-index": str(index),
        "batch.kubernetes.io/job-index-failure-count": "0",
        "batch.kubernetes.io/job-index-ignored-failure-count": "3",
    }
    p["spec"].update(spec)
    return p


def test_the_watch_makes_a_reclaimed_slices_job_again_when_its_backoff_holds_it_back(
    k8s: tuple[FakeKubernetes, str],
) -> None:
    """Slice 1's 4th reclaim, 2 s ago: its Job would wait 80 s before making its pods again; the watch deletes the
    child Job (in the background: its pods go with it) so that JobSet makes a fresh one at once."""
    api, url = k8s
    hook = jobset_hook(url)
    ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 2))
    reclaimed = {
        "phase": "Failed",
        "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}],
        "containerStatuses": [
            {
                "name": "agent",
                "ready": False,
                "restartCount": 0,
                "image": "img:1",
                "imageID": "x",
                "state": {"terminated": {"exitCode": 6, "reason": "Error", "finishedAt": ended}},
            }
        ],
    }
    api.pods = [_slice_pod(0, 0, RUNNING), _slice_pod(0, 1, RUNNING)]
    api.pods += [_slice_pod(1, i, reclaimed) for i in (0, 1)]
    hook.waiting("js", "training")
    assert api.deleted_jobs == [("js-slice-1", "Background")]
    api.pods[2:] = [_slice_pod(1, i, UNSCHEDULABLE) for i in (0, 1)]  # the fresh Job's pods wait for the nodes
    hook.waiting("js", "training")
    assert api.deleted_jobs == [("js-slice-1", "Background")]


def test_the_watch_makes_a_split_slices_job_again(k8s: tuple[FakeKubernetes, str]) -> None:
    """Slice 0's leader runs on pool b while its follower is pinned to pool a: the watch deletes slice 0's Job."""
    api, url = k8s
    hook = jobset_hook(url)
    api.nodes = [tpu_node("n-a1", "pool-a"), tpu_node("n-b0", "pool-b"), tpu_node("n-b1", "pool-b")]
    pinned = {"cloud.google.com/gke-nodepool": "pool-a"}
    api.pods = [
        _slice_pod(0, 0, RUNNING, nodeName="n-b0"),
        _slice_pod(0, 1, RUNNING, nodeName="n-a1", nodeSelector=pinned),
    ]
    api.pods += [_slice_pod(1, 1, RUNNING, nodeName="n-b1", nodeSelector={"cloud.google.com/gke-nodepool": "pool-b"})]
    hook.waiting("js", "training")
    assert api.deleted_jobs == [("js-slice-0", "Background")]


def _rules_bound_to(subject: str) -> list[dict[str, Any]]:
    """The rules docs/gke.md section 5 grants ``subject`` (a kind: ``User``, the launcher's account, or
    ``ServiceAccount``, the pods'): its Roles and ClusterRoles, bound to it."""
    doc = (REPO / "docs" / "gke.md").read_text()
    section = doc[doc.index("## 5. Namespace, worker identity, Airflow's RBAC") :]
    block = section[section.index("```yaml") + len("```yaml") : section.index("```", section.index("```yaml") + 7)]
    objs = [o for o in yaml.safe_load_all(block) if o]
    bound = {
        o["roleRef"]["name"]
        for o in objs
        if o["kind"] in ("RoleBinding", "ClusterRoleBinding") and any(s["kind"] == subject for s in o["subjects"])
    }
    return [
        r for o in objs if o["kind"] in ("Role", "ClusterRole") and o["metadata"]["name"] in bound for r in o["rules"]
    ]


def _refused(rules: list[dict[str, Any]], requests: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """The requests (method, path) that ``rules`` do not allow: each a 403 on GKE."""
    made = {_rbac_request(method, path) for method, path in requests}
    return [
        (group, resource, verb)
        for group, resource, verb in sorted(made)
        if not any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)
    ]


def _rbac_request(method: str, path: str) -> tuple[str, str, str]:
    """(API group, resource[/subresource], verb) of a Kubernetes API request, as RBAC authorizes it."""
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    verbs = {"POST": "create", "DELETE": "delete", "PATCH": "patch", "PUT": "update"}
    verb = verbs.get(method) or ("get" if len(rest) > 1 else "list")
    return group, resource, verb


def _needs_every_repair(api: FakeKubernetes, jobset: str) -> None:
    """Give the cluster two pools and a JobSet's pods that need a repair of each kind: a failed leader a newer pod
    replaces, and a slice split across the pools (its follower pinned to the other one)."""
    api.nodes = [tpu_node("n-a1", "pool-a"), tpu_node("n-b0", "pool-b")]
    failed_leader = _slice_pod(0, 0, {"phase": "Failed"})
    failed_leader["metadata"]["name"] = "js-slice-0-0-old"
    api.pods = [
        failed_leader,
        _slice_pod(0, 0, RUNNING, nodeName="n-b0"),
        _slice_pod(0, 1, RUNNING, nodeName="n-a1", nodeSelector={"cloud.google.com/gke-nodepool": "pool-a"}),
    ]
    for p in api.pods:
        p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] = jobset


def test_the_launchers_rbac_in_docs_gke_md_allows_every_call_the_watch_and_its_repairs_make(
    k8s: tuple[FakeKubernetes, str],
) -> None:
    """Create, look, repair (a replaced leader, a split slice, a held-back slice) and delete, each call checked
    against the Role and ClusterRole that section 5 tells a person to apply: a missing rule is a 403 on GKE."""
    api, url = k8s
    hook = jobset_hook(url)
    cfg = load_config(overrides={**CONFIG, "hosts_per_slice": 4})
    m = render(cfg, TPUSlice("ct6e-standard-4t", "4x4"), GKELaunch(image="img:1", namespace="training"), "j6")
    hook.create(m)
    hook.state(m.name, "training")
    _needs_every_repair(api, m.name)
    hook.waiting(m.name, "training")
    assert api.deleted_jobs and any(method == "DELETE" and "/pods/" in path for method, path in api.requests)
    hook.capacity(TPUSlice("ct6e-standard-4t", "4x4"))
    hook.delete(m.name, "training")

    made = {_rbac_request(method, path) for method, path in api.requests}
    assert {c[1] for c in made} >= {"jobsets", "services", "pods", "nodes", "jobs"}, made
    refused = _refused(_rules_bound_to("User"), api.requests)
    assert not refused, f"docs/gke.md section 5 does not allow: {refused}"


def test_the_pods_rbac_in_docs_gke_md_allows_every_call_their_own_repairs_make(
    k8s: tuple[FakeKubernetes, str],
) -> None:
    """``rtrain repair-slices``'s look and its three repairs, each call checked against what section 5 binds to the
    pods' service account; and that account may not do more than repair (no create, no JobSet)."""
    from training.backends.gke_selfrepair import OwnJobSet, repair_once

    api, url = k8s
    _needs_every_repair(api, "js")
    assert repair_once(jobset_hook(url), OwnJobSet("js", "training"), 1.0) == 1.0
    made = {_rbac_request(method, path) for method, path in api.requests}
    assert made == {("", "pods", "list"), ("", "nodes", "list"), ("", "pods", "delete"), ("batch", "jobs", "delete")}
    rules = _rules_bound_to("ServiceAccount")
    assert not _refused(rules, api.requests), (
        f"docs/gke.md section 5 does not allow the pods: {_refused(rules, api.requests)}"
    )
    assert not {g for r in rules for g in r["apiGroups"]} & {"jobset.x-k8s.io"}
    assert not {v for r in rules for v in r["verbs"]} & {"create", "update", "patch"}


def _suspended_since(obj: dict[str, Any], t: float) -> None:
    """The JobSet as Kueue leaves it: suspended, its Suspended condition set at ``t``."""
    obj["spec"]["suspend"] = True
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    obj["status"] = {"conditions": [{"type": "Suspended", "status": "True", "lastTransitionTime": when}]}


def test_a_jobset_kueue_holds_past_the_admission_deadline_fails_the_watch_once_naming_queue_and_quota(
    k8s: tuple[FakeKubernetes, str], tmp_path: Path
) -> None:
    """Pools made ahead bill while Kueue holds the JobSet: past gke.admission_timeout_s the look is failed, not to be
    retried, and the sensor fails for good; under queued_provisioning (no node until admission) it waits on."""
    from airflow.sdk.exceptions import AirflowFailException
    from rtrain_airflow.sensors.training import RTrainTrainingJobSensor
    from rtrain_airflow.triggers.training import Recoveries, final_event

    from training.backends.watch import JobWatch

    api, url = k8s
    hook = jobset_hook(url)
    cfg = load_config(overrides={**CONFIG, "hosts_per_slice": 4})
    m = render(cfg, TPUSlice("ct6e-standard-4t", "4x4"), GKELaunch(image="img:1", namespace="training"), "j9")
    hook.create(m)
    gke: Any = {
        "location": LOCATION,
        "cluster_name": CLUSTER,
        "machine_type": "ct6e-standard-4t",
        "tpu_topology": "4x4",
        "image": "img:1",
        "node_pools": ["slice-0"],
        "kueue_queue": "tpu-v6e",
        "admission_timeout_s": 600,
    }
    backend = GKEBackend(gke, CloudCluster(gke, AnonymousCredentials(), api_client=hook.api_client))
    handle: dict[str, Any] = {"backend": "gke", "run_uri": str(tmp_path / "run"), "job": "j9", "jobset": m.name}
    handle |= {"namespace": "training", "launched_at": time.time() - 5000}
    # Admitted once, then suspended again (Kueue preempted it) 500 s ago: the deadline counts from then.
    _suspended_since(api.objects[("JobSet", "training", m.name)], time.time() - 500)
    look = backend.poll(handle, {"start_timeout_s": 900})
    assert look["state"] == "pending" and "waiting for Kueue" in look["waiting"]
    _suspended_since(api.objects[("JobSet", "training", m.name)], time.time() - 700)
    failed = backend.poll(handle, {"start_timeout_s": 900})
    assert failed["state"] == "failed" and failed.get("retry") is False
    reason = failed["reason"]
    assert "gke.admission_timeout_s=600s (queue tpu-v6e)" in reason and "namespace training" in reason
    assert "short of 16 chips a slice" in reason and "\n" not in reason
    # Through the engine's watch and the trigger's event to the sensor: failed for good, not retried.
    found = JobWatch(backend, handle, {"start_timeout_s": 900}).look()
    assert not isinstance(found, Exception) and found.outcome == "failed" and found.retry is False
    event = final_event(found, handle["run_uri"], Recoveries())
    assert event is not None and event.payload["retry"] is False
    sensor = RTrainTrainingJobSensor(task_id="w", spec_from="s", handle=handle)
    with pytest.raises(AirflowFailException, match="Kueue did not admit JobSet"):
        sensor.execute_complete({}, event.payload)
    # Without the setting: 30 minutes by default; none under queued_provisioning, whose pools hold no node.
    plain = {k: v for k, v in gke.items() if k != "admission_timeout_s"}
    backend = GKEBackend(plain, CloudCluster(plain, AnonymousCredentials(), api_client=hook.api_client))
    assert backend.poll(handle, {"start_timeout_s": 900})["state"] == "pending"
    _suspended_since(api.objects[("JobSet", "training", m.name)], time.time() - 1900)
    assert backend.poll(handle, {"start_timeout_s": 900})["state"] == "failed"
    queued = {**plain, "flex_start": True, "queued_provisioning": True}
    backend = GKEBackend(queued, CloudCluster(queued, AnonymousCredentials(), api_client=hook.api_client))
    _suspended_since(api.objects[("JobSet", "training", m.name)], time.time() - 99_999)
    assert backend.poll(handle, {"start_timeout_s": 900})["state"] == "pending"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"admission_timeout_s": 0}, "gke.admission_timeout_s: seconds, more than 0"),
        ({"admission_timeout_s": "soon"}, "gke.admission_timeout_s: seconds, more than 0"),
        ({"admission_timeout_s": 60, "kueue_queue": None}, "only a JobSet Kueue admits"),
    ],
)
def test_a_bad_admission_deadline_is_refused_naming_the_key(extra: dict[str, Any], match: str) -> None:
    gke: Any = {
        "location": LOCATION,
        "cluster_name": CLUSTER,
        "machine_type": "ct6e-standard-4t",
        "tpu_topology": "4x4",
        "image": "img:1",
        "node_pools": ["slice-0"],
        "kueue_queue": "tpu-v6e",
    }
    with pytest.raises(BackendError, match=match):
        GKEBackend({k: v for k, v in {**gke, **extra}.items() if v is not None})
