"""What the cluster says of a job: its JobSet's state, why its pods wait, and its capacity from the nodes.

Pure except :class:`GKECapacity`, which reads nodes through a callable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from training.gke.names import (
    ACCELERATOR_LABEL,
    COMPLETION_INDEX_ANNOTATION,
    JOB_INDEX_LABEL,
    NODEPOOL_LABEL,
    TOPOLOGY_LABEL,
    UNUSABLE_TAINTS,
)
from training.gke.tpu import TPUSlice


def jobset_state(obj: Mapping[str, Any] | None) -> str:
    """``missing``, ``running``, ``suspended``, ``completed`` or ``failed`` from a JobSet object."""
    if not obj:
        return "missing"
    status = obj.get("status") or {}
    terminal = (status.get("terminalState") or "").lower()
    if terminal in ("completed", "failed"):
        return terminal
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    if conditions.get("Failed") == "True":
        return "failed"
    if conditions.get("Completed") == "True":
        return "completed"
    if conditions.get("Suspended") == "True" or (obj.get("spec") or {}).get("suspend"):
        return "suspended"
    return "running"


def suspended_since(obj: Mapping[str, Any] | None) -> float | None:
    """When a suspended JobSet last became suspended (its ``Suspended`` condition), else when it was made; None
    when it is not suspended or says neither."""
    if jobset_state(obj) != "suspended" or obj is None:
        return None
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Suspended" and c.get("status") == "True" and c.get("lastTransitionTime"):
            return _rfc3339(str(c["lastTransitionTime"]))
    made = (obj.get("metadata") or {}).get("creationTimestamp")
    return _rfc3339(str(made)) if made else None


def _rfc3339(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# Why a pod does not run yet, in words a person acts on (keyed by the reason Kubernetes gives).
POD_WAITING_HINTS = {
    "Unschedulable": "no node can take it: the TPU node pools are still being created, were preempted, or are too few",
    "ImagePullBackOff": "the nodes cannot pull the image: check gke.image, and the node pool's scopes and service "
    "account (Artifact Registry reader, docs/gke.md section 2)",
    "ErrImagePull": "the nodes cannot pull the image: check gke.image, and the node pool's scopes and service "
    "account (Artifact Registry reader, docs/gke.md section 2)",
    "InvalidImageName": "gke.image is not a valid image reference",
    "CreateContainerConfigError": "the pod's configuration is refused (a missing Secret, ConfigMap or service account)",
    "CrashLoopBackOff": "the agent keeps exiting at start: see the pod's log",
    "Failed": "the agent exited with an error (the pod is replaced while its index has retries): see the pod's log",
    "OOMKilled": "the agent ran out of the pod's memory (the local tier's emptyDir counts against it)",
    "Evicted": "the node evicted the pod (memory or disk pressure)",
}


@dataclass(frozen=True)
class PodWaiting:
    """A pod of a job's JobSet that is not running, and why (Kubernetes' reason and message)."""

    pod: str
    reason: str
    message: str


def pods_waiting(pods: list[Mapping[str, Any]]) -> list[PodWaiting]:
    """The pods (API objects as JSON) that wait: not scheduled, or a container that cannot start."""
    out = []
    replaced = {_pod_index(p) for p in pods if (p.get("status") or {}).get("phase") != "Failed"} - {None}
    for pod in pods:
        meta = pod.get("metadata") or {}
        name = str(meta.get("name", "?"))
        status = pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue  # on its way out (a lost slice, the JobSet's end)
        if status.get("phase") == "Failed":
            if _pod_index(pod) not in replaced:  # a failed pod stays after its index's next pod started
                out.append(PodWaiting(name, *_failure(status)))
            continue
        if status.get("phase") not in ("Pending", "Running"):
            continue
        waiting = _waiting_container(status)
        if waiting is not None:
            out.append(PodWaiting(name, *waiting))
            continue
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                out.append(PodWaiting(name, str(cond.get("reason") or "Unschedulable"), str(cond.get("message") or "")))
    return out


def _pod_index(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """The (slice, host) a JobSet pod stands for: its replacements have the same."""
    meta = pod.get("metadata") or {}
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    host = notes.get(COMPLETION_INDEX_ANNOTATION, labels.get(COMPLETION_INDEX_ANNOTATION))
    slice_ = labels.get(JOB_INDEX_LABEL)
    return None if host is None or slice_ is None else (str(slice_), str(host))


def _failure(status: Mapping[str, Any]) -> tuple[str, str]:
    """A failed pod's reason: the pod's own (Evicted), else its container's end (OOMKilled, an exit code)."""
    if status.get("reason") in POD_WAITING_HINTS:
        return str(status["reason"]), str(status.get("message") or "")
    for cs in status.get("containerStatuses") or []:
        ended = (cs.get("state") or {}).get("terminated") or {}
        if ended.get("exitCode"):
            reason = "OOMKilled" if ended.get("reason") == "OOMKilled" else "Failed"
            return reason, f"exit code {ended['exitCode']}" + (f": {ended['message']}" if ended.get("message") else "")
    return "Failed", str(status.get("message") or "")


def _waiting_container(status: Mapping[str, Any]) -> tuple[str, str] | None:
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in POD_WAITING_HINTS:
            return str(waiting["reason"]), str(waiting.get("message") or "")
    return None


def describe_waiting(waiting: list[PodWaiting]) -> str:
    """One line for the sensor's log: each reason with its pods' count, message and what to check."""
    groups: dict[str, list[PodWaiting]] = {}
    for w in waiting:
        groups.setdefault(w.reason, []).append(w)
    parts = []
    for reason, ws in groups.items():
        pods = f"{len(ws)} pod{'s' if len(ws) > 1 else ''}"
        hint = POD_WAITING_HINTS.get(reason, "")
        message = ws[0].message.strip().splitlines()[0][:200] if ws[0].message.strip() else ""
        parts.append(f"{pods} {reason}" + (f" ({message})" if message else "") + (f": {hint}" if hint else ""))
    return "; ".join(parts)


# --- capacity --------------------------------------------------------------------------


def node_label_selector(tpu: TPUSlice) -> str:
    return f"{ACCELERATOR_LABEL}={tpu.accelerator},{TOPOLOGY_LABEL}={tpu.topology}"


def node_is_usable(node: Any) -> bool:
    """Ready, schedulable, and not tainted as going away (a kubernetes.client.V1Node)."""
    spec = node.spec
    if spec is not None and spec.unschedulable:
        return False
    if spec is not None and any(t.key in UNUSABLE_TAINTS for t in spec.taints or []):
        return False
    conditions = (node.status.conditions if node.status is not None else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def complete_slices(nodes: Iterable[Any], tpu: TPUSlice, node_pools: Collection[str] | None = None) -> int:
    """Slices of shape ``tpu`` all of whose hosts are usable.

    A multi-host TPU node pool is exactly one slice, so a pool counts once all
    its hosts are usable and not at all before; in a single-host pool every
    usable node is a slice of its own.
    """
    usable: Counter[str] = Counter()
    for node in nodes:
        labels = (node.metadata.labels if node.metadata is not None else None) or {}
        if labels.get(ACCELERATOR_LABEL) != tpu.accelerator or labels.get(TOPOLOGY_LABEL) != tpu.topology:
            continue
        pool = labels.get(NODEPOOL_LABEL)
        if pool is None or (node_pools is not None and pool not in node_pools):
            continue
        if node_is_usable(node):
            usable[pool] += 1
    return sum(count // tpu.hosts for count in usable.values())


class GKECapacity:
    """The CapacitySource of the GKE backend: hosts in complete, usable TPU slices.

    ``list_nodes(label_selector)`` returns kubernetes V1Node objects, e.g.
    ``lambda s: CoreV1Api().list_node(label_selector=s).items``
    (see :meth:`from_core_v1`).
    """

    def __init__(
        self,
        list_nodes: Callable[[str], Iterable[Any]],
        tpu: TPUSlice,
        node_pools: Collection[str] | None = None,
    ) -> None:
        self.list_nodes = list_nodes
        self.tpu = tpu
        self.node_pools = frozenset(node_pools) if node_pools is not None else None

    @classmethod
    def from_core_v1(cls, core_v1: Any, tpu: TPUSlice, node_pools: Collection[str] | None = None) -> GKECapacity:
        return cls(lambda selector: core_v1.list_node(label_selector=selector).items, tpu, node_pools)

    def slices(self) -> int:
        return complete_slices(self.list_nodes(node_label_selector(self.tpu)), self.tpu, self.node_pools)

    def available(self) -> int:
        return self.slices() * self.tpu.hosts

    def set(self, workers: int, reason: str = "") -> None:
        raise NotImplementedError(
            "GKE capacity is the TPU hosts the node pools have; change it by resizing or deleting node pools "
            "(training.backends.gke_pools.NodePools.resize), not through the capacity source"
        )
