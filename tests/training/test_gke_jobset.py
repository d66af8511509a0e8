"""The GKE backend: TPU shapes, the JobSet and Service of a job, and capacity from nodes.

The manifests are checked against the Kubernetes schemas (kubernetes_validate,
strict: unknown fields are errors): the Service, the Job and pod templates as
core objects, and the JobSet against the real JobSet CRD of the release the docs
install (vendored in tests/training/data: its OpenAPI schema, strict, and its
CEL rules), with its webhook's name rules; the pods the JobSet and Job
controllers would make are built and validated.
Then each pod's environment is resolved as the kubelet would (downward API)
and its real entrypoint runs under /bin/sh to show the host agent each pod
starts: its host id, and the addresses its worker serves and binds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes.client import (
    V1Node,
    V1NodeCondition,
    V1NodeSpec,
    V1NodeStatus,
    V1ObjectMeta,
    V1Taint,
)

from training.config import load_config
from training.gke.cluster_state import GKECapacity, complete_slices, jobset_state
from training.gke.launch import (
    GKELaunch,
    GKESettings,
    check_spot_grace,
    settings_preemption_grace_s,
    spot_pod_grace_s,
    spot_shutdown_grace_s,
)
from training.gke.manifests import render, workload_priority_classes
from training.gke.names import (
    COMPLETION_INDEX_ANNOTATION,
    DEFAULT_COORDINATOR_PORT,
    EXCLUSIVE_TOPOLOGY_ANNOTATION,
    GRACE_MARGIN_S,
    JOB_INDEX_LABEL,
    JOBSET_API_VERSION,
    JOBSET_NAME_LABEL,
    JOBSET_PLURAL,
    KUEUE_PRIORITY_LABEL,
    KUEUE_QUEUE_LABEL,
    LIBTPU_PORTS,
    LOCAL_TIER_PATH,
    MAX_JOBSET_NAME,
    SPOT_POD_GRACE_S,
    GKEConfigError,
    jobset_name,
)
from training.gke.pod_specs import container_env, expand_pods
from training.gke.tpu import TPUSlice, feasible_slices, slice_bounds
from training.gke.worker_env import is_round_env, round_env, worker_base_env

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = kubernetes_validate.latest_version()
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# The JobSet CRD of the release the docs install (jobset.x-k8s.io v1alpha2), vendored unmodified.
JOBSET_CRD = Path(__file__).parent / "data" / "jobset.x-k8s.io_jobsets-v0.12.0.yaml"
# Kueue's WorkloadPriorityClass CRD (v1beta1 and v1beta2 served, v1beta2 stored), vendored unmodified.
KUEUE_WPC_CRD = Path(__file__).parent / "data" / "kueue.x-k8s.io_workloadpriorityclasses-v0.19.2.yaml"


def gke_config(**overrides: Any) -> Any:
    base = {
        "backend": "gke",
        "root": "gs://rtrain-prod/runs",
        "run_name": "Llama3_8B.v2",
        "devices_per_worker": 4,
        "min_workers": 4,
        "max_workers": 16,
        "global_batch": 192,  # splits over 2, 4, 6, 8, 12 and 16 workers of 4 devices
        "hosts_per_slice": 4,  # ct6e-standard-4t 4x4
    }
    return load_config(preset="tiny", overrides={**base, **overrides})


LAUNCH = GKELaunch(image="us-docker.pkg.dev/proj/rtrain/train:1.0", namespace="training")


# --- TPU shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine_type", "topology", "chips", "hosts", "accelerator"),
    [
        ("ct6e-standard-4t", "4x4", 16, 4, "tpu-v6e-slice"),
        ("ct6e-standard-4t", "2x4", 8, 2, "tpu-v6e-slice"),
        ("ct6e-standard-4t", "2x2", 4, 1, "tpu-v6e-slice"),
        ("ct6e-standard-8t", "2x4", 8, 1, "tpu-v6e-slice"),
        ("ct6e-standard-1t", "1x1", 1, 1, "tpu-v6e-slice"),
        ("ct5p-hightpu-4t", "2x2x2", 8, 2, "tpu-v5p-slice"),
        ("ct5p-hightpu-4t", "4x4x4", 64, 16, "tpu-v5p-slice"),
        ("ct5lp-hightpu-4t", "4x8", 32, 8, "tpu-v5-lite-podslice"),
        ("ct4p-hightpu-4t", "2x2x1", 4, 1, "tpu-v4-podslice"),
        ("ct4p-hightpu-4t", "2x2x4", 16, 4, "tpu-v4-podslice"),
    ],
)
def test_tpu_slice_knows_its_chips_hosts_and_node_label(
    machine_type: str, topology: str, chips: int, hosts: int, accelerator: str
) -> None:
    tpu = TPUSlice(machine_type, topology)
    assert (tpu.chips, tpu.hosts, tpu.accelerator) == (chips, hosts, accelerator)
    assert tpu.chips_per_host * tpu.hosts == tpu.chips
    assert tpu.multi_host == (hosts > 1)


@pytest.mark.parametrize(
    ("machine_type", "topology", "key"),
    [
        ("ct9z-huge-4t", "2x2", "machine_type"),
        ("ct6e-standard-4t", "2x2x2", "tpu_topology"),  # v6e is a 2D torus
        ("ct5p-hightpu-4t", "4x4", "tpu_topology"),  # v5p is 3D
        ("ct6e-standard-4t", "3x3", "tpu_topology"),  # not offered
        ("ct6e-standard-8t", "4x4", "tpu_topology"),  # 8t is single-host 2x4 only
        ("ct5p-hightpu-4t", "1x1x2", "tpu_topology"),  # 2 chips: not a whole host
        ("ct5p-hightpu-4t", "2x0x2", "tpu_topology"),
        # v4 / v5p: below a 4x4x4 cube one of 2x2x1, 2x2x2, 2x2x4, 2x4x4; from a cube up, multiples of 4.
        ("ct5p-hightpu-4t", "2x2x3", "tpu_topology"),  # whole hosts (3), but no such slice
        ("ct5p-hightpu-4t", "2x4x8", "tpu_topology"),
        ("ct4p-hightpu-4t", "4x4x6", "tpu_topology"),
        ("ct4p-hightpu-4t", "1x4x4", "tpu_topology"),
    ],
)
def test_tpu_slice_refuses_shapes_gke_does_not_offer(machine_type: str, topology: str, key: str) -> None:
    with pytest.raises(GKEConfigError, match=f"^{key}:"):
        TPUSlice(machine_type, topology)


@pytest.mark.parametrize(
    "topology", ["2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "16x16x24"]
)
@pytest.mark.parametrize("machine_type", ["ct5p-hightpu-4t", "ct4p-hightpu-4t"])
def test_3d_slices_are_the_sub_cube_shapes_or_whole_cubes(machine_type: str, topology: str) -> None:
    assert TPUSlice(machine_type, topology).hosts * 4 == TPUSlice(machine_type, topology).chips


# --- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize("run_name", ["Llama3_8B.v2", "a_b", "a.b", "7b-run", "x" * 63, "demo"])
@pytest.mark.parametrize("job", ["j20261129-101500-abc123", "j1"])
def test_jobset_name_is_a_short_dns_label(run_name: str, job: str) -> None:
    name = jobset_name(run_name, job)
    assert DNS_1035.match(name), name
    assert len(name) <= MAX_JOBSET_NAME


def test_jobset_names_differ_by_run_and_job() -> None:
    names = {jobset_name(r, j) for r in ("a_b", "a.b", "A_B", "x" * 63, "x" * 62 + "y") for j in ("j1", "j2")}
    assert len(names) == 10


# --- how many slices -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine_type", "topology", "min_w", "max_w", "bounds"),
    [
        ("ct6e-standard-4t", "4x4", 4, 16, (1, 4)),
        ("ct6e-standard-4t", "4x4", 5, 16, (2, 4)),  # 5 hosts need 2 slices of 4
        ("ct6e-standard-4t", "4x4", 4, 11, (1, 2)),  # 11 hosts hold 2 slices of 4
        ("ct5p-hightpu-4t", "2x2x2", 2, 6, (1, 3)),
        ("ct6e-standard-4t", "2x2", 1, 8, (1, 1)),  # single-host slices cannot form a multislice
    ],
)
def test_slice_bounds_keep_hosts_within_min_max_workers(
    machine_type: str, topology: str, min_w: int, max_w: int, bounds: tuple[int, int]
) -> None:
    tpu = TPUSlice(machine_type, topology)
    cfg = gke_config(min_workers=min_w, max_workers=max_w, devices_per_worker=tpu.chips_per_host, hosts_per_slice=1)
    assert slice_bounds(cfg.elastic, tpu) == bounds
    k_min, k_max = bounds
    assert min_w <= k_min * tpu.hosts and k_max * tpu.hosts <= max_w


def test_slice_bounds_refuse_a_range_no_whole_slice_fits() -> None:
    cfg = gke_config(min_workers=5, max_workers=7, hosts_per_slice=1)
    with pytest.raises(GKEConfigError, match="min_workers/max_workers"):
        slice_bounds(cfg.elastic, TPUSlice("ct6e-standard-4t", "4x4"))


def test_feasible_slices_are_only_slice_counts_the_batch_splits_over() -> None:
    cfg = gke_config(global_batch=32)  # 32 sequences over 4-device hosts: 4 or 8 hosts, not 12 or 16
    tpu = TPUSlice("ct6e-standard-4t", "4x4")
    assert feasible_slices(cfg, tpu) == [1, 2]
    with pytest.raises(GKEConfigError, match="^min_workers/max_workers: the mesh or global_batch=20"):
        render(gke_config(global_batch=20), tpu, LAUNCH, "j1")


# --- config checks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"root": "var/runs"}, "root"),
        ({"backend": "local"}, "backend"),
        ({"devices_per_worker": 8}, "devices_per_worker"),
        ({"hosts_per_slice": 2}, "hosts_per_slice"),
        ({"min_workers": 1, "max_workers": 3, "hosts_per_slice": 1}, "hosts_per_slice"),
    ],
)
def test_render_refuses_a_config_that_cannot_run_on_the_slice(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(GKEConfigError, match=f"^{key}:"):
        render(gke_config(**overrides), TPUSlice("ct6e-standard-4t", "4x4"), LAUNCH, "j1")


@pytest.mark.parametrize("k", [0, 5])
def test_render_refuses_slices_outside_min_max(k: int) -> None:
    with pytest.raises(GKEConfigError, match="^num_slices:"):
        render(gke_config(), TPUSlice("ct6e-standard-4t", "4x4"), LAUNCH, "j1", k)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"image": ""}, "image"),
        ({"namespace": "Training"}, "namespace"),
        ({"coordinator_port": 8471}, "coordinator_port"),
        ({"coordinator_port": 8460}, "coordinator_port"),  # its watches would take 8474 and 8475 (libtpu's)
        ({"coordinator_port": 8416}, "coordinator_port"),  # its peer watch would take 8430, its host watch 8431
        ({"coordinator_port": 8066}, "coordinator_port"),  # its peer watch would take 8080 (megascale)
        ({"coordinator_port": 65535}, "coordinator_port"),  # no port left for the watches
        ({"coordinator_port": 65521}, "coordinator_port"),  # no port left for the host watch
        ({"megascale_port": 70000}, "megascale_port"),
        ({"env": {"RTRAIN_PROCESS_ID": "3"}}, "env"),
        ({"node_pools": ("Pool_1",)}, "node_pools"),
        ({"kueue_queue": "Team Queue"}, "kueue_queue"),
        ({"kueue_queue": "team", "priority": "top"}, "priority"),
        ({"priority": "high"}, "priority"),  # a priority class means nothing without Kueue
    ],
)
def test_launch_options_are_checked(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(GKEConfigError, match=f"^{key}:"):
        GKELaunch(**{"image": "img:1", **kwargs})


# --- the manifests -----------------------------------------------------------------------------


def run_entrypoint(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """Run the container's real command with ``env``, ``echo`` in place of the program; return the agent's argv.

    A slice's leader pod (host index 0) also starts its slice's repairs, and only it: checked here.
    """
    assert container["command"][:2] == ["/bin/sh", "-c"]
    assert container["args"][:2] == ["rtrain", "agent"]
    out = subprocess.run(
        [*container["command"], "echo", *container["args"]],
        env={**env, "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout
    lines = out.splitlines()
    (agent,) = [line for line in lines if line.startswith("rtrain agent ")]
    others = [line for line in lines if line != agent]
    assert others == (["repair-slices"] if env["RTRAIN_HOST_INDEX"] == "0" else []), (env["RTRAIN_HOST_INDEX"], out)
    return agent.split()


def agent_args(argv: list[str]) -> dict[str, str]:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("cmd", nargs=3)  # rtrain agent RUN_URI
    for flag in ("--job", "--host", "--coordinator-host", "--coordinator-port", "--bind-host"):
        p.add_argument(flag, required=True)
    return {k: v for k, v in vars(p.parse_args(argv)).items() if k != "cmd"} | {"run": argv[2]}


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused (as ``kubectl apply --validate=strict``), where it does not keep them."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


@functools.cache
def crd_schema(path: Path, api_version: str) -> dict[str, Any]:
    """The strict OpenAPI schema a CRD serves ``api_version`` (group/version) with; the version must be served."""
    crd = yaml.safe_load(path.read_text())
    group, version_name = api_version.split("/")
    assert crd["spec"]["group"] == group
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == version_name and v["served"]]
    return dict(_strict(version["schema"]["openAPIV3Schema"]))


def jobset_schema() -> dict[str, Any]:
    crd = yaml.safe_load(JOBSET_CRD.read_text())
    assert crd["spec"]["names"]["plural"] == JOBSET_PLURAL
    return crd_schema(JOBSET_CRD, JOBSET_API_VERSION)


def validate_crd_object(path: Path, obj: dict[str, Any]) -> None:
    """An object against the served version of a vendored CRD (strict: unknown fields refused)."""
    jsonschema.validate(obj, crd_schema(path, obj["apiVersion"]))


def cel_rules(schema: dict[str, Any], obj: Any, path: str = "$") -> Iterator[tuple[str, str, str, Any]]:
    """The CEL rules (``x-kubernetes-validations``) that apply to ``obj``: (path, rule, message, value).

    Transition rules (those that read ``oldSelf``) only apply to an update and are left out.
    """
    for v in schema.get("x-kubernetes-validations") or []:
        if "oldSelf" not in v["rule"]:
            yield path, v["rule"], v.get("message", ""), obj
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj:
                yield from cel_rules(sub, obj[key], f"{path}.{key}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in obj.items():
                yield from cel_rules(extra, value, f"{path}.{key}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for n, value in enumerate(obj):
            yield from cel_rules(schema["items"], value, f"{path}[{n}]")


def validate_jobset(jobset: dict[str, Any]) -> None:
    """A JobSet against the real CRD: its OpenAPI schema (strict) and its CEL rules; raises on the first error."""
    import celpy

    schema = jobset_schema()
    jsonschema.validate(jobset, schema)
    env = celpy.Environment()
    for path, rule, message, value in cel_rules(schema, jobset):
        ok = env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(value)})
        if not ok:
            raise jsonschema.ValidationError(f"{path}: {message or rule}")


def check_jobset_structure(jobset: dict[str, Any]) -> None:
    """The JobSet against its CRD, and the rules of its validating webhook (names that fit DNS labels)."""
    validate_jobset(jobset)
    name = jobset["metadata"]["name"]
    assert DNS_1035.match(name)
    spec = jobset["spec"]
    names = [r["name"] for r in spec["replicatedJobs"]]
    assert set(spec["successPolicy"].get("targetReplicatedJobs", [])) <= set(names)
    assert DNS_1035.match(spec["network"]["subdomain"]) and len(spec["network"]["subdomain"]) <= 63
    for rjob in spec["replicatedJobs"]:
        longest_job = f"{name}-{rjob['name']}-{rjob['replicas'] - 1}"
        assert DNS_1035.match(longest_job) and len(longest_job) <= 63
        longest_pod = f"{longest_job}-{rjob['template']['spec']['completions'] - 1}-abcde"
        assert DNS_1035.match(longest_pod) and len(longest_pod) <= 63, longest_pod


def validate_core(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


CASES = [
    # machine type, topology, min, max, k
    ("ct6e-standard-4t", "4x4", 4, 16, 1),
    ("ct6e-standard-4t", "4x4", 4, 16, 4),
    ("ct5p-hightpu-4t", "2x2x2", 2, 6, 3),
    ("ct6e-standard-4t", "2x2", 1, 1, 1),
]


@dataclass(frozen=True)
class Rendered:
    """One of ``CASES`` rendered: its slice, its config and the manifests of ``k`` slices."""

    tpu: TPUSlice
    cfg: Any
    m: Any
    k: int


@pytest.fixture(params=CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}..{c[3]}-k{c[4]}")
def rendered(request: pytest.FixtureRequest) -> Rendered:
    machine_type, topology, min_w, max_w, k = request.param
    tpu = TPUSlice(machine_type, topology)
    cfg = gke_config(
        min_workers=min_w, max_workers=max_w, devices_per_worker=tpu.chips_per_host, hosts_per_slice=tpu.hosts
    )
    return Rendered(tpu, cfg, render(cfg, tpu, LAUNCH, "j20261129-101500-abc123", k), k)


def test_service_and_jobset_validate_against_kubernetes_schemas(rendered: Rendered) -> None:
    tpu, m, k = rendered.tpu, rendered.m, rendered.k

    validate_core(m.service)
    assert m.service["spec"]["clusterIP"] == "None"
    assert m.service["spec"]["publishNotReadyAddresses"] is True
    assert m.service["metadata"]["name"] == m.jobset["spec"]["network"]["subdomain"] == m.name
    assert m.service["spec"]["selector"] == {JOBSET_NAME_LABEL: m.name}

    check_jobset_structure(m.jobset)
    rjob = m.jobset["spec"]["replicatedJobs"][0]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{m.name}-slice-0", **rjob["template"]["metadata"]},
        "spec": rjob["template"]["spec"],
    }
    validate_core(job)
    validate_core(
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": rjob["template"]["spec"]["template"],
        }
    )
    pods = expand_pods(m.jobset)
    assert len(pods) == k * tpu.hosts
    for pod in pods:
        validate_core(pod)


def test_a_broken_manifest_fails_the_schema_check() -> None:
    """The validation above can fail: a typo in a pod field is caught."""
    m = render(gke_config(), TPUSlice("ct6e-standard-4t", "4x4"), LAUNCH, "j1")
    tmpl = m.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    tmpl["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tmpl})


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda js: js["spec"].update(successPolicyy={"operator": "All"}), "successPolicyy"),
        (lambda js: js["spec"]["successPolicy"].update(operator="Some"), "Some"),
        (lambda js: js["spec"]["replicatedJobs"][0].update(replicas="2"), "'2'"),
        (lambda js: js["spec"]["network"].update(enableDNSHostnames="yes"), "yes"),
        (
            lambda js: js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"].update(
                restartPolicyy="Never"
            ),
            "restartPolicyy",
        ),
        (
            lambda js: (
                js["spec"].update(startupPolicy={"startupPolicyOrder": "InOrder"})
                or js["spec"]["replicatedJobs"][0].update(dependsOn=[{"name": "other", "status": "Ready"}])
            ),
            "mutually exclusive",
        ),
    ],
)
def test_the_jobset_crd_refuses_a_broken_jobset(change: Any, error: str) -> None:
    """The CRD check can fail: an unknown field, a bad enum or type, and a CEL rule broken."""
    m = render(gke_config(), TPUSlice("ct6e-standard-4t", "4x4"), LAUNCH, "j1")
    validate_jobset(m.jobset)
    change(m.jobset)
    with pytest.raises(jsonschema.ValidationError, match=re.escape(error)):
        validate_jobset(m.jobset)


def test_a_lost_host_is_recreated_while_the_jobset_itself_never_restarts() -> None:
    tpu = TPUSlice("ct6e-standard-4t", "4x4")
    m = render(gke_config(), tpu, LAUNCH, "j1")
    spec = m.jobset["spec"]
    # The job as a whole is never restarted by the JobSet (Airflow's retry is that second level) ...
    assert spec["failurePolicy"] == {"maxRestarts": 0}
    assert spec["successPolicy"] == {"operator": "Any", "targetReplicatedJobs": ["slice"]}
    # ... and it asks for every slice max_workers allows: 16 hosts of 4-host slices.
    assert spec["replicatedJobs"][0]["replicas"] == 4 and m.num_slices == 4
    job = spec["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (4, 4, "Indexed")
    # A failed pod is recreated for its index (its agent rejoins); a preemption does not count;
    # an agent that says the job failed for good fails the Job at once.
    assert job["backoffLimitPerIndex"] >= 1 and "backoffLimit" not in job
    # A replacement only once its predecessor has failed (the one value podFailurePolicy allows).
    assert job["podReplacementPolicy"] == "Failed"
    rules = job["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1]["action"] == "FailJob"
    assert rules[1]["onExitCodes"] == {"containerName": "agent", "operator": "In", "values": [3, 5, 7]}
    from training.elastic.codes import AgentExit

    assert {int(AgentExit.FAILED), int(AgentExit.SUPERSEDED), int(AgentExit.STOPPED)} == set(
        rules[1]["onExitCodes"]["values"]
    )
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["google.com/tpu"] == "4"
    assert container["resources"]["requests"] == container["resources"]["limits"]  # Guaranteed QoS
    assert m.jobset["metadata"]["annotations"][EXCLUSIVE_TOPOLOGY_ANNOTATION] == "cloud.google.com/gke-nodepool"


def test_a_single_host_slice_is_not_bound_to_a_node_pool_of_its_own() -> None:
    tpu = TPUSlice("ct6e-standard-4t", "2x2")
    m = render(gke_config(min_workers=1, max_workers=1, hosts_per_slice=1), tpu, LAUNCH, "j1")
    assert EXCLUSIVE_TOPOLOGY_ANNOTATION not in m.jobset["metadata"]["annotations"]


def test_every_pod_runs_one_host_agent_with_its_identity_and_addresses(rendered: Rendered) -> None:
    tpu, cfg, m, k = rendered.tpu, rendered.cfg, rendered.m, rendered.k
    seen: dict[str, dict[str, Any]] = {}
    for n, pod in enumerate(expand_pods(m.jobset)):
        pod["status"] = {"podIP": f"10.8.0.{n + 2}"}
        (container,) = pod["spec"]["containers"]
        env = container_env(pod, container)
        env["HOSTNAME"] = pod["spec"]["hostname"]  # the kubelet sets it to the pod's hostname
        args = agent_args(run_entrypoint(container, env))
        assert args["host"] not in seen, f"host id {args['host']} twice"
        seen[args["host"]] = pod
        assert args["run"] == "gs://rtrain-prod/runs/Llama3_8B.v2" == cfg.run_uri
        assert args["job"] == "j20261129-101500-abc123"
        # The host id names its slice and its place in it: what the agents' membership counts in.
        j = pod["metadata"]["labels"][JOB_INDEX_LABEL]
        i = pod["metadata"]["annotations"][COMPLETION_INDEX_ANNOTATION]
        assert args["host"] == f"s{j}-h{i}"
        # Peers reach its worker (as rank 0) at hostname.subdomain, on a port the pod declares; it binds the pod IP.
        assert args["coordinator_host"] == f"{pod['spec']['hostname']}.{pod['spec']['subdomain']}"
        assert pod["spec"]["subdomain"] == m.service["metadata"]["name"]
        assert int(args["coordinator_port"]) in {p["containerPort"] for p in container["ports"]}
        # Rank 0's peer watch and its agent's host watch listener (the leader's connection to it) listen on the
        # ports the agent derives from the coordinator's, declared in the pod.
        from training.elastic.host.hostwatch import host_watch_port
        from training.elastic.peerwatch import peer_watch_port

        assert peer_watch_port(int(args["coordinator_port"])) in {p["containerPort"] for p in container["ports"]}
        assert host_watch_port(int(args["coordinator_port"])) in {p["containerPort"] for p in container["ports"]}
        assert args["bind_host"] == pod["status"]["podIP"]
        assert not any(key.startswith("MEGASCALE_") and key != "MEGASCALE_PORT" for key in env)
    assert len(seen) == k * tpu.hosts


def test_launch_options_reach_the_pods() -> None:
    launch = GKELaunch(
        image="img:1",
        namespace="ml",
        service_account="trainer",
        node_pools=("tpu-a", "tpu-b"),
        spot=True,
        host_network=True,
        identity="node",
        cpu="8",
        memory="64Gi",
        env={"XLA_FLAGS": "--xla_dump_to=/tmp"},
        labels={"team": "lm"},
    )
    m = render(gke_config(preemption_grace_s=10), TPUSlice("ct6e-standard-4t", "4x4"), launch, "j1")
    pod = m.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": pod})
    spec = pod["spec"]
    assert spec["serviceAccountName"] == "trainer"
    assert spec["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0] == {
        "key": "cloud.google.com/gke-nodepool",
        "operator": "In",
        "values": ["tpu-a", "tpu-b"],
    }
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    c = spec["containers"][0]
    assert c["resources"]["requests"]["memory"] == "64Gi"
    assert {"name": "XLA_FLAGS", "value": "--xla_dump_to=/tmp"} in c["env"]
    assert pod["metadata"]["labels"]["team"] == "lm"
    assert m.jobset["metadata"]["namespace"] == m.service["metadata"]["namespace"] == "ml"


def test_on_the_host_network_the_coordinator_name_is_the_pods_not_the_nodes() -> None:
    """hostNetwork makes $HOSTNAME the node's name; the agent's DNS name must still be the pod's, under the Service."""
    tpu = TPUSlice("ct6e-standard-4t", "4x4")
    launch = GKELaunch(image="img:1", host_network=True, identity="node")
    m = render(gke_config(), tpu, launch, "j1", 2)
    for n, pod in enumerate(expand_pods(m.jobset)):
        validate_core(pod)
        spec = pod["spec"]
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        pod["status"] = {"podIP": f"10.128.0.{n + 2}"}  # on the host network: the node's IP
        (container,) = spec["containers"]
        env = container_env(pod, container)
        env["HOSTNAME"] = f"gke-train-tpu-a-{n:04d}"  # what the kubelet gives a hostNetwork pod: the node's name
        args = agent_args(run_entrypoint(container, env))
        # The name the headless Service publishes for this pod (Indexed Job hostname . subdomain).
        assert args["coordinator_host"] == f"{spec['hostname']}.{spec['subdomain']}"
        assert env["HOSTNAME"] not in args["coordinator_host"]


def test_host_network_without_a_node_identity_is_refused() -> None:
    """hostNetwork pods do not get Workload Identity (gs:// answers 403): the launch must say how they authenticate."""
    with pytest.raises(GKEConfigError, match="^identity:.*host network"):
        GKELaunch(image="img:1", host_network=True)
    with pytest.raises(GKEConfigError, match="^identity:"):
        GKELaunch(image="img:1", identity="key-file")
    assert GKELaunch(image="img:1", host_network=True, identity="node").identity == "node"


# --- the preemption grace ------------------------------------------------------------------------


def pod_grace(m: Any) -> int:
    return int(
        m.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    )


def test_spot_pods_get_the_15s_a_spot_preemption_gives_and_the_job_must_commit_within_it() -> None:
    tpu = TPUSlice("ct6e-standard-4t", "4x4")
    on_demand = render(gke_config(), tpu, GKELaunch(image="img:1"), "j1")
    assert pod_grace(on_demand) == 30 >= gke_config().preemption_grace_s + GRACE_MARGIN_S
    # Spot: 15 s by default, so the default preemption_grace_s (25 s) cannot be honoured: refused, naming both.
    spot = GKELaunch(image="img:1", spot=True)
    assert spot.pod_grace_s == spot.preemption_window_s == SPOT_POD_GRACE_S == 15
    with pytest.raises(GKEConfigError, match=r"^preemption_grace_s: 25s .*gke.spot_shutdown_grace_s: 120.*at most 10s"):
        render(gke_config(), tpu, spot, "j1")
    m = render(gke_config(preemption_grace_s=10), tpu, spot, "j1")
    assert pod_grace(m) == 15
    # A pod grace longer than the node gives does not help on Spot: the window is what the node gives.
    longer = GKELaunch(image="img:1", spot=True, termination_grace_period_s=60)
    with pytest.raises(GKEConfigError, match="^preemption_grace_s:"):
        render(gke_config(preemption_grace_s=20), tpu, longer, "j1")
    # Pools made with spot_shutdown_grace_s=120 give the pods 105 s (120 less the system pods' 15 s).
    extended = GKELaunch(image="img:1", spot=True, spot_grace_s=105)
    assert pod_grace(render(gke_config(), tpu, extended, "j1")) == 105
    with pytest.raises(GKEConfigError, match="^spot_grace_s:"):
        GKELaunch(image="img:1", spot=True, spot_grace_s=300)


# --- a round's worker environment -----------------------------------------------------------------

# What GKE's TPU webhook puts into a pod of a 2-replica JobSet (the pod s1-h3 of slices of 4 hosts).
WEBHOOK_ENV = {
    "PATH": "/usr/bin:/bin",
    "MEGASCALE_NUM_SLICES": "2",
    "MEGASCALE_SLICE_ID": "1",
    "MEGASCALE_COORDINATOR_ADDRESS": "r-abc-slice-0-0.r-abc",
    "MEGASCALE_PORT": "8080",
    "TPU_WORKER_ID": "3",
    "TPU_WORKER_HOSTNAMES": "a,b,c,d",
    "RTRAIN_JOB": "j1",
}
TWO_SLICES = ["s0-h0", "s0-h1", "s0-h2", "s0-h3", "s1-h0", "s1-h1", "s1-h2", "s1-h3"]


def worker_env(members: list[str], rank: int, coordinator: str) -> dict[str, str]:
    """The environment a worker of this round runs with: the agent's child env, then the round's (worker/main.py)."""
    env = worker_base_env(WEBHOOK_ENV)
    env.update(round_env(members, rank, 4, coordinator, WEBHOOK_ENV["MEGASCALE_PORT"]))
    return env


def test_a_two_slice_round_sets_its_own_tpu_and_multislice_values() -> None:
    env = worker_env(TWO_SLICES, 6, "r-abc-slice-0-0.r-abc:8476")
    assert env["MEGASCALE_NUM_SLICES"] == "2" and env["MEGASCALE_SLICE_ID"] == "1"
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "r-abc-slice-0-0.r-abc" and env["MEGASCALE_PORT"] == "8080"
    assert env["TPU_WORKER_ID"] == "2"
    assert env["TPU_WORKER_HOSTNAMES"] == ",".join(f"r-abc-slice-1-{i}.r-abc" for i in range(4))
    assert env["RTRAIN_JOB"] == "j1" and env["PATH"] == "/usr/bin:/bin"  # the rest of the pod's env stays


@pytest.mark.parametrize("survivor", [0, 1])
def test_a_round_that_shrank_to_one_slice_keeps_no_stale_multislice_value(survivor: int) -> None:
    """The webhook's MEGASCALE_NUM_SLICES=2 would make libtpu wait for a slice that is gone."""
    members = TWO_SLICES[4 * survivor : 4 * survivor + 4]
    coordinator = f"r-abc-slice-{survivor}-0.r-abc:8476"
    for rank in range(4):
        env = worker_env(members, rank, coordinator)
        assert not [k for k in env if k.startswith("MEGASCALE_")], env
        assert env["TPU_WORKER_ID"] == str(rank)
        assert env["TPU_WORKER_HOSTNAMES"] == ",".join(f"r-abc-slice-{survivor}-{i}.r-abc" for i in range(4))
        stale = {k: v for k, v in WEBHOOK_ENV.items() if is_round_env(k) and env.get(k) == v}
        assert stale in ({}, {"TPU_WORKER_ID": "3"}), stale  # only a value this round gives again


def test_a_single_host_slice_runs_without_tpu_worker_or_multislice_values() -> None:
    env = worker_base_env(WEBHOOK_ENV)
    env.update(round_env(["s0-h0"], 0, 1, "r-abc-slice-0-0.r-abc:8476"))
    assert not [k for k in env if is_round_env(k)], env


def test_round_env_names_the_pods_the_jobset_makes() -> None:
    """TPU_WORKER_HOSTNAMES are the DNS names the headless Service publishes for the round's slice."""
    tpu = TPUSlice("ct6e-standard-4t", "4x4")
    m = render(gke_config(), tpu, LAUNCH, "j1", 2)
    names = {}
    for n, pod in enumerate(expand_pods(m.jobset)):
        pod["status"] = {"podIP": f"10.8.0.{n + 2}"}
        (container,) = pod["spec"]["containers"]
        args = agent_args(run_entrypoint(container, container_env(pod, container)))
        names[args["host"]] = (args["coordinator_host"], f"{pod['spec']['hostname']}.{pod['spec']['subdomain']}")
    members = sorted(names, key=lambda h: (int(h[1 : h.index("-")]), int(h.rsplit("h", 1)[1])))
    coordinator = f"{names[members[0]][0]}:{DEFAULT_COORDINATOR_PORT}"  # rank 0's, as the leader writes it
    assert coordinator == m.coordinator
    for rank, host in enumerate(members):
        env = round_env(members, rank, tpu.hosts, coordinator)
        slice_members = members[rank - rank % 4 : rank - rank % 4 + 4]
        assert env["TPU_WORKER_HOSTNAMES"].split(",") == [names[h][1] for h in slice_members]
        assert env["TPU_WORKER_HOSTNAMES"].split(",")[int(env["TPU_WORKER_ID"])] == names[host][1]


@pytest.mark.usefixtures("not_a_subreaper_after")
def test_the_agent_gives_its_worker_only_this_rounds_tpu_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's worker supervisor: the child process starts without the webhook's values, and the round's env
    brings its own."""

    from training.elastic.host.supervisor import WorkerSupervisor
    from training.elastic.rendezvous import Round

    for k, v in WEBHOOK_ENV.items():
        monkeypatch.setenv(k, v)
    seen: dict[str, Any] = {}

    class FakePopen:  # the fork server's process, then (that server never answering) the worker's own
        def __init__(self, argv: list[str], env: dict[str, str], **kwargs: Any) -> None:
            assert not [k for k in env if is_round_env(k)], env
            seen["env"] = env

    monkeypatch.setattr("subprocess.Popen", FakePopen)
    cfg = gke_config()  # backend gke, 4 hosts a slice, 4 devices a host
    workers = WorkerSupervisor(
        cfg, "gs://b/runs/r", "s1-h3", "j1", tmp_path, coordinator_host="127.0.0.1", coordinator_port=0, bind_host=""
    )
    w = workers.spawn()
    os.close(w.fd)
    child = dict(seen["env"])
    assert not [k for k in child if is_round_env(k)], child
    assert child["RTRAIN_JOB"] == "j1" and child["RTRAIN_HOST"] == "s1-h3"
    rnd = Round(
        round=3, job="j1", gen=1, leader="s1-h0", members=TWO_SLICES[4:], coordinator="r-abc-slice-1-0.r-abc:8476"
    )
    child.update(workers.round_env(rnd, 3))  # what worker/main.py does
    assert not [k for k in child if k.startswith("MEGASCALE_")]
    assert child["TPU_WORKER_ID"] == "3"
    assert child["TPU_WORKER_HOSTNAMES"] == ",".join(f"r-abc-slice-1-{i}.r-abc" for i in range(4))


@pytest.mark.parametrize(
    ("obj", "state"),
    [
        (None, "missing"),
        ({"spec": {}, "status": {}}, "running"),
        ({"spec": {}}, "running"),
        ({"status": {"terminalState": "Completed"}}, "completed"),
        ({"status": {"terminalState": "Failed"}}, "failed"),
        ({"status": {"conditions": [{"type": "Failed", "status": "True"}]}}, "failed"),
        ({"status": {"conditions": [{"type": "Completed", "status": "True"}]}}, "completed"),
        ({"status": {"conditions": [{"type": "Completed", "status": "False"}]}}, "running"),
        ({"spec": {"suspend": True}, "status": {}}, "suspended"),
    ],
)
def test_jobset_state(obj: dict[str, Any] | None, state: str) -> None:
    assert jobset_state(obj) == state


# --- capacity from nodes -------------------------------------------------------------------------


def node(
    name: str,
    pool: str,
    ready: bool = True,
    topology: str = "4x4",
    accelerator: str = "tpu-v6e-slice",
    unschedulable: bool | None = None,
    taints: list[V1Taint] | None = None,
) -> V1Node:
    return V1Node(
        metadata=V1ObjectMeta(
            name=name,
            labels={
                "cloud.google.com/gke-nodepool": pool,
                "cloud.google.com/gke-tpu-accelerator": accelerator,
                "cloud.google.com/gke-tpu-topology": topology,
            },
        ),
        spec=V1NodeSpec(unschedulable=unschedulable, taints=taints),
        status=V1NodeStatus(
            conditions=[
                V1NodeCondition(type="MemoryPressure", status="False"),
                V1NodeCondition(type="Ready", status="True" if ready else "False"),
            ]
        ),
    )


def pool_nodes(pool: str, n: int = 4, **kwargs: Any) -> list[V1Node]:
    return [node(f"gke-{pool}-{i}", pool, **kwargs) for i in range(n)]


TPU_4X4 = TPUSlice("ct6e-standard-4t", "4x4")


def test_capacity_counts_hosts_of_complete_ready_slices() -> None:
    nodes = (
        pool_nodes("slice-a")  # complete
        + pool_nodes("slice-b")  # complete
        + pool_nodes("slice-c", n=3)  # incomplete: a host is missing
        + pool_nodes("slice-d")[:3]
        + [node("gke-slice-d-3", "slice-d", ready=False)]  # a host is not ready
        + pool_nodes("other", topology="2x4")  # another shape
        + pool_nodes("v5e", accelerator="tpu-v5-lite-podslice")  # another TPU
    )
    cap = GKECapacity(lambda selector: nodes, TPU_4X4)
    assert cap.slices() == 2
    assert cap.available() == 8


def test_capacity_only_counts_the_pools_it_is_given() -> None:
    nodes = pool_nodes("slice-a") + pool_nodes("slice-b") + pool_nodes("someone-elses")
    assert GKECapacity(lambda s: nodes, TPU_4X4, node_pools=["slice-a", "slice-b"]).available() == 8
    assert GKECapacity(lambda s: nodes, TPU_4X4).available() == 12


def test_capacity_leaves_out_cordoned_and_terminating_hosts() -> None:
    cordoned = pool_nodes("slice-a")
    cordoned[0].spec.unschedulable = True
    going = pool_nodes("slice-b")
    going[2].spec.taints = [V1Taint(key="cloud.google.com/impending-node-termination", effect="NoSchedule")]
    tpu_taint = pool_nodes("slice-c", taints=[V1Taint(key="google.com/tpu", value="present", effect="NoSchedule")])
    assert complete_slices(cordoned + going + tpu_taint, TPU_4X4) == 1


def test_capacity_of_single_host_slices_is_one_per_ready_node() -> None:
    tpu = TPUSlice("ct6e-standard-4t", "2x2")
    nodes = pool_nodes("single", n=5, topology="2x2") + [node("gke-single-x", "single", ready=False, topology="2x2")]
    assert GKECapacity(lambda s: nodes, tpu).available() == 5


def test_capacity_asks_for_the_tpu_shape_and_cannot_be_set() -> None:
    asked: list[str] = []

    def list_nodes(selector: str) -> list[Any]:
        asked.append(selector)
        return []

    cap = GKECapacity(list_nodes, TPU_4X4)
    assert cap.available() == 0
    assert asked == ["cloud.google.com/gke-tpu-accelerator=tpu-v6e-slice,cloud.google.com/gke-tpu-topology=4x4"]
    with pytest.raises(NotImplementedError):
        cap.set(4)


def test_the_backend_imports_neither_airflow_nor_jax() -> None:
    code = (
        "import sys, training.gke.manifests, training.gke.cluster_state, training.gke.worker_env\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('airflow', 'jax', 'flax', 'orbax'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# --- the training image ----------------------------------------------------------------------------


def test_training_image_installs_every_runtime_dependency() -> None:
    """Dockerfile.train installs the package without Airflow: it must list the rest of pyproject's deps."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    not_in_image = {n for n in names if n.startswith("apache-airflow") or n == "google-cloud-container"}
    text = (REPO / "docker" / "Dockerfile.train").read_text().lower().replace("_", "-")
    missing = sorted(
        n for n in names - not_in_image if not re.search(rf"(^|[\s\"']){re.escape(n)}([\[<>=\s\"']|$)", text, re.M)
    )
    assert not missing, f"docker/Dockerfile.train does not install {missing}"
    assert "jax[tpu]" in text and "--constraint constraints.txt" in text and "--no-deps" in text
    # The build imports what a pod runs: the agent, its worker, and the repairs a slice's leader starts beside it.
    check = next(line for line in text.splitlines() if "python -c" in line and "import training" in line)
    assert all(
        m in check
        for m in ("training.elastic.host.agent", "training.elastic.worker.main", "training.backends.gke-selfrepair")
    )
    # The maxtext extra, behind --build-arg MAXTEXT=1: every package of it.
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["maxtext"]
    block = text[text.index('if [ "$maxtext" = 1 ]') :].split("; fi", 1)[0]
    wanted = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in extra}
    assert wanted and not sorted(n for n in wanted if n not in block.split()), block


def test_the_local_tier_gets_a_memory_volume_and_the_pods_a_grace_period_the_notice_fits_in() -> None:
    tpu = TPUSlice("ct6e-standard-4t", "4x4")
    off = render(gke_config(), tpu, LAUNCH, "j1").jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert "volumes" not in off["spec"], "no local tier: no volume"
    m = render(gke_config(local_checkpoint_every=10), tpu, GKELaunch(image="img:1", local_tier_size="32Gi"), "j1")
    pod = m.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": pod})
    [volume] = pod["spec"]["volumes"]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    c = pod["spec"]["containers"][0]
    [mount] = c["volumeMounts"]
    assert mount == {"name": volume["name"], "mountPath": LOCAL_TIER_PATH}
    assert {"name": "RTRAIN_LOCAL_CHECKPOINT_DIR", "value": LOCAL_TIER_PATH} in c["env"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= gke_config().preemption_grace_s + GRACE_MARGIN_S
    # A grace period the job's stop-and-commit does not fit in is refused, naming both settings.
    with pytest.raises(GKEConfigError, match="preemption_grace_s"):
        render(gke_config(preemption_grace_s=40), tpu, GKELaunch(image="img:1", termination_grace_period_s=30), "j1")


def test_kueue_queues_the_whole_jobset_at_the_runs_priority_class() -> None:
    tpu = TPUSlice("ct6e-standard-4t", "4x4")
    cfg = gke_config(min_workers=4, max_workers=16, devices_per_worker=tpu.chips_per_host, hosts_per_slice=tpu.hosts)
    plain = render(cfg, tpu, LAUNCH, "j20261201-101500-abc123", 2)
    assert not [k for k in plain.jobset["metadata"]["labels"] if k.startswith("kueue.x-k8s.io/")]
    launch = GKELaunch(image=LAUNCH.image, namespace="training", kueue_queue="tpu-v6e", priority="high")
    m = render(cfg, tpu, launch, "j20261201-101500-abc123", 2)
    labels = m.jobset["metadata"]["labels"]
    assert labels[KUEUE_QUEUE_LABEL] == "tpu-v6e" and labels[KUEUE_PRIORITY_LABEL] == "rtrain-high"
    pod_labels = m.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["labels"]
    assert KUEUE_QUEUE_LABEL not in pod_labels, "Kueue reads the JobSet's labels, not the pods'"
    check_jobset_structure(m.jobset)
    validate_core({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "labels": labels}})
    classes = workload_priority_classes()
    assert [(c["metadata"]["name"], c["value"]) for c in classes] == [
        ("rtrain-low", 100),
        ("rtrain-normal", 200),
        ("rtrain-high", 300),
        ("rtrain-urgent", 400),
    ]
    for c in classes:
        assert c["apiVersion"] == "kueue.x-k8s.io/v1beta2" and c["kind"] == "WorkloadPriorityClass"
        validate_crd_object(KUEUE_WPC_CRD, c)
        assert set(c) == {"apiVersion", "kind", "metadata", "value", "description"}
        assert DNS_1035.match(c["metadata"]["name"])


def test_gcs_fuse_mounts_the_dataset_bucket_read_only_where_the_workers_read_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from training.storage import mounted_path

    cfg = gke_config(dataset="gs://rtrain-data/tokens/v3")
    m = render(cfg, TPUSlice("ct6e-standard-4t", "4x4"), GKELaunch(image="img:1", gcs_fuse=True), "j1")
    check_jobset_structure(m.jobset)
    (pod,) = expand_pods(m.jobset)[:1]
    validate_core(pod)
    assert pod["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"  # GKE injects the FUSE sidecar
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "dataset"]
    assert volume["csi"] == {
        "driver": "gcsfuse.csi.storage.gke.io",
        "readOnly": True,
        "volumeAttributes": {
            "bucketName": "rtrain-data",
            "mountOptions": "implicit-dirs",
            "fileCacheCapacity": "-1",
            "fileCacheForRangeRead": "true",
        },
    }
    assert pod["metadata"]["annotations"]["gke-gcsfuse/ephemeral-storage-limit"] == "20Gi"
    (container,) = pod["spec"]["containers"]
    assert {"name": "dataset", "mountPath": "/var/rtrain/gcs/rtrain-data", "readOnly": True} in container[
        "volumeMounts"
    ]
    env = container_env({**pod, "status": {"podIP": "10.0.0.2"}}, container)
    monkeypatch.setenv("RTRAIN_GCS_MOUNTS", env["RTRAIN_GCS_MOUNTS"])
    assert mounted_path(cfg.dataset) == "/var/rtrain/gcs/rtrain-data/tokens/v3"  # what the worker reads
    assert mounted_path("gs://another-bucket/x") is None
    plain = render(cfg, TPUSlice("ct6e-standard-4t", "4x4"), LAUNCH, "j1")
    assert "gke-gcsfuse/volumes" not in expand_pods(plain.jobset)[0]["metadata"]["annotations"]
    with pytest.raises(GKEConfigError, match="^gcs_fuse:.*not on gs://"):
        render(
            gke_config(dataset="/data/x"), TPUSlice("ct6e-standard-4t", "4x4"), GKELaunch(image="i", gcs_fuse=True), "j"
        )
    with pytest.raises(GKEConfigError, match="^gcs_fuse:"):
        GKELaunch(image="i", gcs_fuse=True, host_network=True, identity="node")
    with pytest.raises(GKEConfigError, match="^gcs_fuse_cache:"):
        GKELaunch(image="i", gcs_fuse=True, gcs_fuse_cache="lots")


def test_the_reaper_takes_the_failed_leaders_a_newer_pod_replaces_and_nothing_else() -> None:
    from training.gke.reaper import replaced_leaders

    m = render(gke_config(), TPUSlice("ct6e-standard-4t", "4x4"), LAUNCH, "j1", 2)

    def pod(slice_: int, index: int, suffix: str, phase: str, deleting: bool = False) -> dict[str, Any]:
        from training.gke.pod_specs import expand_pod

        obj = expand_pod(m.jobset, slice_, index, suffix)
        if deleting:
            obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        return {**obj, "status": {"phase": phase}}

    pods = [
        pod(0, 0, "aaaaa", "Failed"),  # replaced by bbbbb: deleted
        pod(0, 0, "bbbbb", "Pending"),
        pod(0, 1, "ccccc", "Failed"),  # a follower: the webhook does not count it
        pod(1, 0, "ddddd", "Failed"),  # nothing replaces it yet: kept, with its log
        pod(1, 0, "eeeee", "Failed", deleting=True),
    ]
    assert replaced_leaders(pods) == [f"{m.name}-slice-0-0-aaaaa"]
    single = render(
        gke_config(min_workers=1, max_workers=1, hosts_per_slice=1), TPUSlice("ct6e-standard-4t", "2x2"), LAUNCH, "j1"
    )
    m = single  # no exclusive placement: no webhook, nothing to delete
    assert replaced_leaders([pod(0, 0, "aaaaa", "Failed"), pod(0, 0, "bbbbb", "Running")]) == []


def test_the_spot_grace_reaches_the_pools_and_the_pods_and_a_cluster_too_old_for_it_is_refused() -> None:
    from training.backends.gke import GKEBackend
    from training.backends.gke_cluster import CloudCluster

    settings: GKESettings = {
        "location": "us-east5",
        "cluster_name": "c",
        "machine_type": "ct6e-standard-4t",
        "tpu_topology": "4x4",
        "image": "img:1",
        "node_pools": ["p0", "p1"],
        "spot": True,
    }
    tpu = TPUSlice("ct6e-standard-4t", "4x4")
    for asked, pods, commit in ((None, 15, 10.0), (120, 105, 100.0)):
        gke_settings: GKESettings = {**settings, "spot_shutdown_grace_s": asked} if asked else settings
        assert [s.spot_shutdown_grace_s for s in CloudCluster(gke_settings).pool_specs()] == [asked, asked]
        launch = GKEBackend(gke_settings).placement()
        assert launch.spot_grace_s == launch.pod_grace_s == pods
        assert settings_preemption_grace_s(gke_settings) == commit
        m = render(gke_config(preemption_grace_s=commit), tpu, launch, "j1", 2)
        assert pod_grace(m) == pods
    longer: GKESettings = {**settings, "spot_shutdown_grace_s": 120}
    check_spot_grace(longer, "1.35.0-gke.1171000")
    with pytest.raises(GKEConfigError, match=r"^gke.spot_shutdown_grace_s: 120s needs GKE 1.35.0-gke.1171000"):
        check_spot_grace(longer, "1.34.5-gke.1000")
    check_spot_grace(settings, "1.30.0-gke.1")  # the default grace: any version


def test_rtrain_plan_and_train_on_gke_refuse_what_the_render_would_before_any_pool(tmp_path: Path) -> None:
    settings = tmp_path / "gke.yaml"
    settings.write_text(
        yaml.safe_dump(
            {
                "location": "us-east5",
                "cluster_name": "c",
                "machine_type": "ct5lp-hightpu-4t",  # v5e: 4 chips a host, not the config's default 2
                "tpu_topology": "4x4",
                "image": "img:1",
                "node_pools": ["p0", "p1"],
                "spot": True,
            }
        )
    )
    keys = [
        "elastic.min_workers=4",
        "elastic.max_workers=8",
        "optimizer.global_batch=32",
        "root=gs://b/r",
        "run_name=p",
    ]

    def rtrain(verb: str, *argv: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(Path(sys.executable).parent / "rtrain"), verb, "--gke", str(settings), *argv, *keys]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)

    ok = rtrain("plan", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["min_plan"]["devices"] == 16  # 4 hosts of 4 chips
    for verb in ("plan", "train"):
        bad = rtrain(verb, "checkpoint.preemption_grace_s=20")
        assert bad.returncode != 0 and bad.stderr.strip().splitlines() == [bad.stderr.strip()]
        assert "gke: preemption_grace_s: 20s" in bad.stderr and "at most 10s" in bad.stderr, bad.stderr


def test_compiling_ahead_across_slice_counts_is_off_on_tpu_unless_asked() -> None:
    from training.elastic.worker import ahead

    assert gke_config().compile_ahead is None
    assert ahead.enabled(gke_config().placement, "cpu") and not ahead.enabled(gke_config().placement, "tpu")
    assert ahead.enabled(gke_config(compile_ahead=True).placement, "tpu")
    assert not ahead.enabled(gke_config(compile_ahead=False).placement, "cpu")


def test_gke_config_errors_are_no_value_errors_a_launch_would_retry() -> None:
    assert not issubclass(GKEConfigError, ValueError)


def test_the_pod_declares_the_watch_ports_the_agents_listen_on_outside_libtpus() -> None:
    from training.elastic.host.hostwatch import host_watch_port
    from training.elastic.peerwatch import peer_watch_port

    m = render(gke_config(), TPUSlice("ct6e-standard-4t", "4x4"), LAUNCH, "j1")
    (container,) = expand_pods(m.jobset)[0]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["peer-watch"] == peer_watch_port(ports["coordinator"]) == 8490
    assert ports["host-watch"] == host_watch_port(ports["coordinator"]) == 8491
    assert not {ports["peer-watch"], ports["host-watch"]} & LIBTPU_PORTS
    assert peer_watch_port(0) == host_watch_port(0) == 0  # no fixed coordinator port: any free port


@pytest.mark.parametrize(
    ("version", "grace", "pods"),
    [("1.35.0-gke.1171000", 120, 105), ("1.35.1-gke.1000", 120, 105), ("1.35.0-gke.1170999", 30, 15), (None, 30, 15)],
)
def test_the_longest_spot_grace_follows_the_clusters_version(version: str | None, grace: int, pods: int) -> None:
    assert spot_shutdown_grace_s(version) == grace and spot_pod_grace_s(grace) == pods
    with pytest.raises(GKEConfigError, match="^spot_shutdown_grace_s:"):
        spot_pod_grace_s(60)
    with pytest.raises(GKEConfigError, match="^cluster version:"):
        spot_shutdown_grace_s("latest")


def test_the_vendored_crds_are_the_files_their_readme_names() -> None:
    readme = (JOBSET_CRD.parent / "README.md").read_text()
    for crd in (JOBSET_CRD, KUEUE_WPC_CRD):
        section = readme.split(f"`{crd.name}`", 1)[1]
        (sha,) = re.findall(r"sha256: ([0-9a-f]{64})", section)[:1]
        assert hashlib.sha256(crd.read_bytes()).hexdigest() == sha, crd.name


def test_the_vendored_jobset_crd_is_the_release_the_docs_install() -> None:
    docs = (REPO / "docs" / "gke.md").read_text()
    (version,) = re.findall(r"export JOBSET_VERSION=(v[\d.]+)", docs)
    assert JOBSET_CRD.name == f"jobset.x-k8s.io_jobsets-{version}.yaml" and JOBSET_CRD.exists()
