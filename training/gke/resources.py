"""A TPU host's CPU and memory, what GKE leaves a pod of it, and the agent pod's requests and limits (pure).

The agent's pod is the only workload of its TPU VM, so it asks for what the node can give it: the
VM's vCPUs and memory less GKE's reservations for the node's system (kubelet, container runtime,
eviction threshold) and room for the system DaemonSets.  Requests equal limits, so the pod is in
the Guaranteed QoS class: under node pressure the kubelet evicts BestEffort and Burstable pods
first (kubernetes.io/docs/concepts/scheduling-eviction/node-pressure-eviction), and a Guaranteed pod
is the last candidate.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from training.gke.names import TPU_RESOURCE, GKEConfigError, K8sObject


@dataclass(frozen=True)
class HostSize:
    """One TPU VM's vCPUs and memory (GiB), as Cloud TPU's docs list its machine type."""

    vcpus: int
    memory_gib: int


# Cloud TPU's VM tables (cloud.google.com/tpu/docs/v4, v5e "VM types", v5p, v6e): each TPU machine type's host.
HOST_SIZES: dict[str, HostSize] = {
    "ct4p-hightpu-4t": HostSize(240, 407),
    "ct5lp-hightpu-1t": HostSize(24, 48),
    "ct5lp-hightpu-4t": HostSize(112, 192),
    "ct5lp-hightpu-8t": HostSize(224, 384),
    "ct5p-hightpu-4t": HostSize(208, 448),
    "ct6e-standard-1t": HostSize(44, 176),
    "ct6e-standard-4t": HostSize(180, 720),
    "ct6e-standard-8t": HostSize(180, 1440),
}

# GKE's reservations on a Standard node (cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes,
# "Memory and CPU reservations"): per band of the machine's memory (GiB) and cores, the share kept for the
# node's system; and the kubelet's hard eviction threshold, 100 MiB of memory.
MEMORY_BANDS = ((4, 0.25), (8, 0.20), (16, 0.10), (128, 0.06), (math.inf, 0.02))
CPU_BANDS = ((1, 0.06), (2, 0.01), (4, 0.005), (math.inf, 0.0025))
EVICTION_MIB = 100
# Room left for the node's system DaemonSets (logging, kube-proxy, the metadata server, the TPU device plugin, ...):
# not a figure GKE publishes for TPU nodes; a margin, so the pod always fits next to them.
SYSTEM_PODS_MILLICPU = 2000
SYSTEM_PODS_MIB = 4096
# The GCS FUSE sidecar's own CPU and memory when the pod mounts the dataset's bucket (GKE's sidecar annotations,
# cloud.google.com/kubernetes-engine/docs/how-to/cloud-storage-fuse-csi-driver-sidecar): set as request = limit, so
# the pod stays Guaranteed, and taken from the agent's share.
FUSE_MILLICPU = 1000
FUSE_MIB = 2048
FUSE_RESOURCE_ANNOTATIONS = ("cpu", "memory")


def _banded(total: float, bands: tuple[tuple[float, float], ...]) -> float:
    """The reservation of ``total`` under per-band shares (each band up to its bound)."""
    kept, low = 0.0, 0.0
    for bound, share in bands:
        if total <= low:
            break
        kept += (min(total, bound) - low) * share
        low = bound
    return kept


def allocatable(machine_type: str) -> tuple[int, int]:
    """(millicores, MiB) a node of ``machine_type`` offers its pods: its size less GKE's reservations."""
    size = host_size(machine_type)
    cpu = size.vcpus * 1000 - math.ceil(_banded(size.vcpus, CPU_BANDS) * 1000)
    memory = size.memory_gib * 1024 - math.ceil(_banded(size.memory_gib, MEMORY_BANDS) * 1024) - EVICTION_MIB
    return cpu, memory


def host_size(machine_type: str) -> HostSize:
    try:
        return HOST_SIZES[machine_type]
    except KeyError:
        raise GKEConfigError(f"machine_type: no host size known for {machine_type!r}") from None


def agent_share(machine_type: str, gcs_fuse: bool) -> tuple[int, int]:
    """(millicores, MiB) the agent's container asks for by default: the node's allocatable less the system pods
    (and the FUSE sidecar's share), CPU in whole tenths of a core, memory in whole GiB."""
    cpu, memory = allocatable(machine_type)
    cpu -= SYSTEM_PODS_MILLICPU + (FUSE_MILLICPU if gcs_fuse else 0)
    memory -= SYSTEM_PODS_MIB + (FUSE_MIB if gcs_fuse else 0)
    return cpu // 100 * 100, memory // 1024 * 1024


_CPU = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m?)$")
_MEMORY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_MEMORY_UNITS = {None: 1, "k": 1000, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
_MEMORY_UNITS["Ti"] = 2**40


def millicpu(quantity: str, key: str = "cpu") -> int:
    """A CPU quantity (``4``, ``2.5``, ``1500m``) in millicores; a malformed one is refused naming ``key``."""
    m = _CPU.match(quantity.strip())
    if not m:
        raise GKEConfigError(f"{key}: a CPU quantity such as 100, 2.5 or 1500m, got {quantity!r}")
    return int(float(m.group(1)) * (1 if m.group(2) else 1000))


def mebibytes(quantity: str, key: str = "memory") -> int:
    """A memory quantity (``64Gi``, ``512Mi``, ``10G``) in MiB (rounded down); a malformed one is refused naming ``key``."""
    m = _MEMORY.match(quantity.strip())
    if not m:
        raise GKEConfigError(f"{key}: a memory quantity such as 64Gi or 512Mi, got {quantity!r}")
    return int(m.group(1)) * _MEMORY_UNITS[m.group(2)] // 2**20


def pod_resources(
    machine_type: str, chips: int, *, cpu: str | None, memory: str | None, gcs_fuse: bool, local_tier: str | None
) -> dict[str, dict[str, str]]:
    """The agent container's requests and limits, equal (Guaranteed QoS): its TPU chips, and CPU and memory
    from ``cpu`` / ``memory`` or else :func:`agent_share`; more than the node can give, or a local tier (memory
    emptyDir, counted against the container's memory) that leaves the worker nothing, is refused."""
    share_cpu, share_mib = agent_share(machine_type, gcs_fuse)
    want_cpu = millicpu(cpu) if cpu else share_cpu
    want_mib = mebibytes(memory) if memory else share_mib
    if want_cpu > share_cpu or want_mib > share_mib:
        raise GKEConfigError(
            f"cpu/memory: a {machine_type} node leaves a pod {share_cpu}m CPU and {share_mib}Mi memory "
            f"(after GKE's reservations and the system pods), not {want_cpu}m and {want_mib}Mi"
        )
    if local_tier is not None and mebibytes(local_tier, "local_tier_size") >= want_mib:
        raise GKEConfigError(
            f"local_tier_size: {local_tier} of the pod's {want_mib}Mi memory: the in-memory local tier counts against "
            "it, so it must be less"
        )
    quantities = {TPU_RESOURCE: str(chips), "cpu": cpu or f"{want_cpu}m", "memory": memory or f"{want_mib}Mi"}
    return {"requests": dict(quantities), "limits": dict(quantities)}


def fuse_sidecar_annotations() -> dict[str, str]:
    """The GCS FUSE sidecar's CPU and memory, request = limit (GKE's ``gke-gcsfuse/<resource>-<request|limit>``)."""
    values = {"cpu": f"{FUSE_MILLICPU}m", "memory": f"{FUSE_MIB}Mi"}
    return {f"gke-gcsfuse/{r}-{kind}": values[r] for r in FUSE_RESOURCE_ANNOTATIONS for kind in ("request", "limit")}


def qos_class(pod_spec: Mapping[str, Any]) -> str:
    """A pod's QoS class, as Kubernetes computes it (pkg/apis/core/v1/helper/qos: GetPodQOS), over CPU and memory.

    ``Guaranteed``: every container (init containers too) has a CPU and a memory limit, and its requests equal
    them; ``BestEffort``: no container asks for either; else ``Burstable``.
    """
    containers: list[K8sObject] = [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]
    any_set, guaranteed = False, True
    for c in containers:
        res = c.get("resources") or {}
        requests = {k: v for k, v in (res.get("requests") or {}).items() if k in ("cpu", "memory")}
        limits = {k: v for k, v in (res.get("limits") or {}).items() if k in ("cpu", "memory")}
        any_set = any_set or bool(requests or limits)
        if set(limits) != {"cpu", "memory"} or any(requests.get(k, limits[k]) != limits[k] for k in limits):
            guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"
