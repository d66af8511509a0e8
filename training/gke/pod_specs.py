"""The pods of a rendered JobSet as Kubernetes makes them, pure: each pod from its Job's template, JobSet's
admission under exclusive placement, the environment the webhooks and the kubelet give a container, the
podFailurePolicy's action on a pod's end, and a pod's API object (what :mod:`training.gke.pod_emulator` runs).
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.gke.names import (
    COMPLETION_INDEX_ANNOTATION,
    EXCLUSIVE_TOPOLOGY_ANNOTATION,
    JOB_INDEX_LABEL,
    JOBSET_NAME_LABEL,
    K8sObject,
)

REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"


class PodEmulatorError(RuntimeError):
    """The emulator cannot run pods on this machine (no ``unshare``, no namespaces) or was given a bad JobSet."""


@dataclass
class Pod:
    """One pod of the emulated JobSet: its object, and the process its container is."""

    name: str
    slice: int
    index: int
    obj: K8sObject
    created: float = field(default_factory=time.time)
    ip: str = ""
    node: str = ""
    proc: subprocess.Popen[bytes] | None = None
    exit_code: int | None = None
    ended: float | None = None  # when its container ended
    disruption: str = ""  # why the node ended the pod (a DisruptionTarget: its shutdown), if it did
    deleting_since: float | None = None  # deleted through the API (a deletionTimestamp), or its node shut down
    kill_at: float | None = None
    log: Path | None = None
    removed: bool = False  # gone from the API (deleted once terminal, or garbage-collected)

    @property
    def phase(self) -> str:
        if self.exit_code is not None:  # deleted or not, by its container's exit (the kubelet's rule since 1.27)
            return "Succeeded" if self.exit_code == 0 else "Failed"
        return "Running" if self.proc is not None else "Pending"

    @property
    def api_deleted(self) -> bool:
        """Deleted through the API (a deletionTimestamp); a node's shutdown ends a pod without one."""
        return self.deleting_since is not None and not self.disruption


@dataclass
class Node:
    """A TPU VM of a node pool: a Spot reclaim shuts it down (and deletes it, if its instance is gone)."""

    name: str
    pool: str
    slice: int  # the number of its pool (slice j starts on pool j)
    index: int
    ready: bool = True
    delete_at: float | None = None  # when GKE deletes it (after a reclaim)
    deleted_at: float | None = None


def pod_ip(n: int, net: int = 1) -> str:
    """The ``n``-th address of 127.<net>.0.0/16 (all loopback on Linux): pods on 127.1, nodes on 127.2."""
    if not 0 <= n < 250 * 256:
        raise PodEmulatorError(f"no address left for pod {n}")
    return f"127.{net}.{n // 250}.{n % 250 + 2}"


def expand_pod(jobset: Mapping[str, Any], slice_: int, index: int, suffix: str) -> K8sObject:
    """The pod the JobSet (its Job ``slice_``) and the Job controller (index ``index``) make of the template.

    The JobSet's exclusive-topology annotation reaches the pod as JobSet v0.12.0 puts it there
    (``pkg/controllers/jobset_controller.go``: ``labelAndAnnotateObject``), with the JobSet's name.
    """
    name = jobset["metadata"]["name"]
    (rjob,) = jobset["spec"]["replicatedJobs"]
    job_spec = rjob["template"]["spec"]
    if job_spec.get("completionMode") != "Indexed":
        raise PodEmulatorError("only Indexed Jobs are emulated")
    tmpl = job_spec["template"]
    subdomain = jobset["spec"]["network"].get("subdomain") or name
    index_meta = {
        JOBSET_NAME_LABEL: name,
        REPLICATED_JOB_LABEL: rjob["name"],
        JOB_INDEX_LABEL: str(slice_),
        COMPLETION_INDEX_ANNOTATION: str(index),
    }
    exclusive = (jobset["metadata"].get("annotations") or {}).get(EXCLUSIVE_TOPOLOGY_ANNOTATION)
    hostname = f"{name}-{rjob['name']}-{slice_}-{index}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{hostname}-{suffix}",
            "namespace": jobset["metadata"]["namespace"],
            "labels": {**tmpl["metadata"].get("labels", {}), **index_meta},
            "annotations": {
                **tmpl["metadata"].get("annotations", {}),
                **index_meta,
                **({EXCLUSIVE_TOPOLOGY_ANNOTATION: exclusive} if exclusive else {}),
            },
        },
        "spec": {**tmpl["spec"], "hostname": hostname, "subdomain": subdomain},
    }


def admit(pod: Pod, pods: list[Pod], nodes: Mapping[str, Node]) -> str:
    """JobSet's pod webhooks on a create: "" when admitted (a follower then selects its leader's pool), else why not.

    JobSet v0.12.0, ``pkg/webhooks/pod_webhook.go``: under exclusive placement a leader (completion index
    0) is admitted as it is; a follower only when the pods named like its slice's leader, less those with a
    deletion timestamp, are exactly one, and that one is scheduled.  Failed pods count.
    """
    annotations = pod.obj["metadata"]["annotations"]
    topology = annotations.get(EXCLUSIVE_TOPOLOGY_ANNOTATION)
    if not topology or annotations[COMPLETION_INDEX_ANNOTATION] == "0":
        return ""
    prefix = pod.name.rsplit("-", 2)[0] + "-0-"  # <jobset>-slice-<j>-0-: placement.GenPodName, less the suffix
    leaders = [p for p in pods if p.name.startswith(prefix) and not p.removed and not p.api_deleted]
    if len(leaders) != 1:
        return f"expected 1 leader pod ({prefix[:-1]}), but got {len(leaders)}. this is an expected, transient error"
    if not leaders[0].node:
        return "leader pod not yet scheduled, not creating follower pod. this is an expected, transient error"
    pod.obj["spec"]["nodeSelector"] = {**pod.obj["spec"].get("nodeSelector", {}), topology: nodes[leaders[0].node].pool}
    return ""


def expand_pods(jobset: Mapping[str, Any]) -> list[K8sObject]:
    """Every pod of a JobSet, as the controllers first make them (slice-major)."""
    (rjob,) = jobset["spec"]["replicatedJobs"]
    hosts = rjob["template"]["spec"]["completions"]
    return [expand_pod(jobset, j, i, "abcde") for j in range(rjob["replicas"]) for i in range(hosts)]


def container_env(pod: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, str]:
    """The container's ``env`` as the kubelet resolves it: values and downward-API field refs."""
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        if path in ("status.podIP", "status.hostIP"):
            env[item["name"]] = str(pod["status"][path.split(".")[1]])
            continue
        if path in ("metadata.name", "metadata.namespace", "spec.nodeName"):
            section, key = path.split(".")
            env[item["name"]] = str(pod[section][key])
            continue
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if not m or m.group(2) not in pod["metadata"].get(m.group(1), {}):
            raise PodEmulatorError(f"{pod['metadata']['name']}: fieldPath {path} has no value on the pod")
        env[item["name"]] = str(pod["metadata"][m.group(1)][m.group(2)])
    return env


def webhook_env(jobset: Mapping[str, Any], slice_: int, index: int) -> dict[str, str]:
    """What GKE's TPU webhook injects into a JobSet pod that asks for TPU chips, as GKE's docs describe it.

    ``TPU_WORKER_ID`` and ``TPU_WORKER_HOSTNAMES`` on multi-host slices, ``MEGASCALE_*`` when the JobSet
    has more than one slice.  The shape's own values (``TPU_TOPOLOGY``, ...) never change between rounds
    and are left out.  Taken from the documentation, not from a cluster.
    """
    name = jobset["metadata"]["name"]
    (rjob,) = jobset["spec"]["replicatedJobs"]
    subdomain = jobset["spec"]["network"].get("subdomain") or name
    hosts = int(rjob["template"]["spec"]["completions"])
    env: dict[str, str] = {}
    if hosts > 1:
        env["TPU_WORKER_ID"] = str(index)
        env["TPU_WORKER_HOSTNAMES"] = ",".join(f"{name}-{rjob['name']}-{slice_}-{i}.{subdomain}" for i in range(hosts))
    if int(rjob["replicas"]) > 1:
        env["MEGASCALE_COORDINATOR_ADDRESS"] = f"{name}-{rjob['name']}-0-0.{subdomain}"
        env["MEGASCALE_NUM_SLICES"] = str(rjob["replicas"])
        env["MEGASCALE_SLICE_ID"] = str(slice_)
    return env


def rule_action(rules: list[Mapping[str, Any]], exit_code: int, disrupted: bool, container: str) -> str:
    """The action of the Job's ``podFailurePolicy`` for a failed pod: its first matching rule's, else Count."""
    for rule in rules:
        conds = rule.get("onPodConditions") or []
        if disrupted and any(c.get("type") == "DisruptionTarget" and c.get("status", "True") == "True" for c in conds):
            return str(rule["action"])
        codes = rule.get("onExitCodes")
        if codes and codes.get("containerName", container) == container and exit_code != 0:
            if (exit_code in codes["values"]) == (codes["operator"] == "In"):
                return str(rule["action"])
    return "Count"


def kubelet_env(pod: Pod, container: Mapping[str, Any], volumes: Mapping[str, Path]) -> dict[str, str]:
    """What the kubelet sets: the container's ``env``, ``HOSTNAME`` and the cluster's API address.

    A value under a volume's mount path names the volume's directory here; on the host network
    ``HOSTNAME`` is the node's.
    """
    env = container_env({**pod.obj, "status": {"podIP": pod.ip, "hostIP": pod.ip}}, container)
    for key, value in env.items():
        for path, local in volumes.items():
            if value == path or value.startswith(path + "/"):
                env[key] = str(local) + value[len(path) :]
    hostname = pod.node if pod.obj["spec"].get("hostNetwork") else pod.obj["spec"]["hostname"]
    return {**env, "HOSTNAME": hostname, "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def pod_object(pod: Pod, container: str, pending: str) -> K8sObject:
    """The pod as an API object with its status (``pending``: why a pod not yet placed waits)."""
    obj = {**pod.obj, "metadata": dict(pod.obj["metadata"])}
    if pod.deleting_since is not None and pod.exit_code is None and not pod.disruption:
        # Deleted through the API; a node's shutdown (a Spot reclaim) ends the pod without one.
        obj["metadata"]["deletionTimestamp"] = rfc3339(pod.deleting_since)
    status: K8sObject = {"phase": pod.phase}
    conditions = []
    if pod.disruption:
        disrupted = {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}
        conditions.append({**disrupted, "message": pod.disruption})
    if pod.proc is None and pod.exit_code is None:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": pending})
    else:
        status["podIP"] = pod.ip
        state: K8sObject = {"running": {}}
        if pod.exit_code is not None:
            reason = "Completed" if not pod.exit_code else "Error"
            state = {"terminated": {"exitCode": pod.exit_code, "reason": reason}}
            if pod.ended is not None:
                state["terminated"]["finishedAt"] = rfc3339(pod.ended)
        status["containerStatuses"] = [{"name": container, "state": state}]
    status["conditions"] = conditions
    obj["status"] = status
    return obj


def hosts_text(jobset: Mapping[str, Any], pods: list[Pod]) -> bytes:
    """An /etc/hosts with localhost and each pod's DNS names on the JobSet's headless Service."""
    subdomain = jobset["spec"]["network"].get("subdomain") or jobset["metadata"]["name"]
    ns = jobset["metadata"]["namespace"]
    lines = ["127.0.0.1\tlocalhost"]
    for pod in pods:
        host = pod.obj["spec"]["hostname"]
        lines.append(f"{pod.ip}\t{host}.{subdomain}.{ns}.svc.cluster.local {host}.{subdomain} {host}")
        if pod.obj["spec"].get("hostNetwork"):
            lines.append(f"{pod.ip}\t{pod.node}")
    return ("\n".join(lines) + "\n").encode()


def job_container(job_spec: Mapping[str, Any]) -> K8sObject:
    (container,) = job_spec["template"]["spec"]["containers"]
    return dict(container)


def rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
