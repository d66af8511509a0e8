"""The agent pod's CPU and memory: sized from the TPU machine type, requests equal to limits (Guaranteed QoS), and
checked against the Kubernetes schemas like the rest of the JobSet."""

from __future__ import annotations

from typing import Any

import pytest
from test_gke_jobset import gke_config, validate_core

from training.gke import GKEConfigError, GKELaunch, TPUSlice, render
from training.gke.resources import (
    FUSE_MIB,
    FUSE_MILLICPU,
    HOST_SIZES,
    agent_share,
    allocatable,
    mebibytes,
    millicpu,
    qos_class,
)
from training.gke.tpu import TPU_MACHINE_TYPES

SHAPES = {
    "ct4p-hightpu-4t": "2x2x2",
    "ct5lp-hightpu-1t": "1x1",
    "ct5lp-hightpu-4t": "2x4",
    "ct5lp-hightpu-8t": "2x4",
    "ct5p-hightpu-4t": "2x2x2",
    "ct6e-standard-1t": "1x1",
    "ct6e-standard-4t": "4x4",
    "ct6e-standard-8t": "2x4",
}


def _pod(tpu: TPUSlice, launch: GKELaunch, **overrides: Any) -> dict[str, Any]:
    cfg = gke_config(
        devices_per_worker=tpu.chips_per_host,
        hosts_per_slice=tpu.hosts,
        min_workers=tpu.hosts,
        max_workers=tpu.hosts,
        **overrides,
    )
    m = render(cfg, tpu, launch, "j1")
    template: dict[str, Any] = m.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})
    return template


def test_every_machine_type_has_a_host_size() -> None:
    assert set(HOST_SIZES) == set(TPU_MACHINE_TYPES) == set(SHAPES)


def test_allocatable_follows_gkes_reservations() -> None:
    # ct5lp-hightpu-4t: 112 vCPUs, 192 GiB.  CPU kept: 6% of 1 core + 1% of 1 + 0.5% of 2 + 0.25% of 108 = 0.35
    # cores.  Memory kept: 25% of 4 + 20% of 4 + 10% of 8 + 6% of 112 + 2% of 64 = 10.6 GiB, and 100 MiB eviction.
    assert allocatable("ct5lp-hightpu-4t") == (112_000 - 350, 192 * 1024 - 10855 - 100)
    cpu, mib = agent_share("ct5lp-hightpu-4t", gcs_fuse=False)
    assert (cpu, mib) == (109_600, 177 * 1024)  # less 2 cores and 4 GiB for the system pods, rounded down
    assert agent_share("ct5lp-hightpu-4t", gcs_fuse=True) == (cpu - FUSE_MILLICPU, mib - 2 * 1024)
    assert FUSE_MIB == 2 * 1024


@pytest.mark.parametrize("machine_type", sorted(SHAPES))
def test_the_agent_pod_is_guaranteed_and_fits_its_node(machine_type: str) -> None:
    tpu = TPUSlice(machine_type, SHAPES[machine_type])
    spec = _pod(tpu, GKELaunch(image="img:1"))["spec"]
    (container,) = spec["containers"]
    res = container["resources"]
    assert res["requests"] == res["limits"]
    assert res["requests"]["google.com/tpu"] == str(tpu.chips_per_host)
    assert qos_class(spec) == "Guaranteed"
    cpu, mib = allocatable(machine_type)
    assert 0 < millicpu(res["limits"]["cpu"]) <= cpu and 0 < mebibytes(res["limits"]["memory"]) <= mib


def test_the_fuse_sidecar_keeps_the_pod_guaranteed() -> None:
    """GKE injects the GCS FUSE sidecar with the resources its annotations give: both equal, the pod stays Guaranteed."""
    tpu = TPUSlice("ct5lp-hightpu-4t", "2x4")
    launch = GKELaunch(image="img:1", gcs_fuse=True)
    template = _pod(tpu, launch, dataset="gs://data-bucket/tiny")
    notes = template["metadata"]["annotations"]
    sidecar = {
        "name": "gke-gcsfuse-sidecar",
        "restartPolicy": "Always",
        "resources": {
            kind: {r: notes[f"gke-gcsfuse/{r}-{kind[:-1]}"] for r in ("cpu", "memory")}
            for kind in ("requests", "limits")
        },
    }
    assert qos_class({**template["spec"], "initContainers": [sidecar]}) == "Guaranteed"
    without = {**sidecar, "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}}}  # GKE's default sidecar
    assert qos_class({**template["spec"], "initContainers": [without]}) == "Burstable"
    agent = template["spec"]["containers"][0]["resources"]["limits"]
    assert millicpu(agent["cpu"]) + FUSE_MILLICPU <= allocatable("ct5lp-hightpu-4t")[0]


def test_qos_follows_kubernetes_rules() -> None:
    both = {"cpu": "1", "memory": "1Gi"}
    assert qos_class({"containers": [{"resources": {}}]}) == "BestEffort"
    assert qos_class({"containers": [{"resources": {"limits": both}}]}) == "Guaranteed"  # requests default to limits
    assert qos_class({"containers": [{"resources": {"requests": both}}]}) == "Burstable"
    assert qos_class({"containers": [{"resources": {"requests": both, "limits": {**both, "cpu": "2"}}}]}) == "Burstable"


@pytest.mark.parametrize(
    ("launch", "overrides", "key"),
    [
        ({"cpu": "500"}, {}, "cpu/memory: a ct5lp-hightpu-4t node leaves a pod 109600m CPU"),
        ({"memory": "200Gi"}, {}, "cpu/memory: a ct5lp-hightpu-4t node leaves a pod"),
        ({"memory": "16Gi"}, {"local_checkpoint_every": 10}, "local_tier_size: 16Gi of the pod's 16384Mi memory"),
        ({"cpu": "lots"}, {}, "cpu: a CPU quantity"),
    ],
)
def test_a_pod_the_node_cannot_hold_is_refused_naming_the_key(
    launch: dict[str, Any], overrides: dict[str, Any], key: str
) -> None:
    cfg = gke_config(devices_per_worker=4, hosts_per_slice=2, min_workers=2, max_workers=2, **overrides)
    with pytest.raises(GKEConfigError, match="^" + key.replace("(", r"\(")):
        render(cfg, TPUSlice("ct5lp-hightpu-4t", "2x4"), GKELaunch(image="img:1", **launch), "j1")
