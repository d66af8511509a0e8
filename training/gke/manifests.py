"""The JobSet that runs one training job on TPU slices, and its headless Service, rendered as dicts (pure).

A job is one JobSet whose replicated job ``slice`` has one replica per TPU slice it may use
(``max_workers`` in whole slices): an Indexed Job with one pod per TPU host, each running one host
agent (``rtrain agent``).  A pod learns its slice and host index from the downward API; a short
``sh`` entrypoint makes them the agent's host id ``s<slice>-h<host>``, its coordinator host (the
pod's hostname under the headless Service; not ``$HOSTNAME``, the node's name on the host network)
and its bind address (the pod's IP).

A lost host does not end the job: the survivors go on, and the Job recreates the pod
(``backoffLimitPerIndex``; preemptions and evictions do not count), which waits Pending until its
node is back, then joins.  The JobSet never restarts (``maxRestarts: 0``): a job that fails has its
agents exit ``AgentExit.FAILED``, ``podFailurePolicy`` fails the Job at once, and the Airflow
sensor's retry takes over.  It succeeds when any slice's Job does.  No Airflow, no JAX.  The names and
numbers live in :mod:`training.gke.names`, the slice shapes in :mod:`training.gke.tpu`, the checks a
launch must pass in :mod:`training.gke.launch`, what the cluster says back in :mod:`training.gke.cluster_state`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from training.gke.launch import GKELaunch, check_slices, dataset_bucket
from training.gke.names import (
    ACCELERATOR_LABEL,
    AGENT_ARGS,
    COMPLETION_INDEX_ANNOTATION,
    CONTAINER_NAME,
    ENTRYPOINT_SCRIPT,
    EXCLUSIVE_TOPOLOGY_ANNOTATION,
    FINAL_EXIT_CODES,
    GCS_FUSE_ANNOTATION,
    GCS_FUSE_CACHE_ANNOTATION,
    GCS_FUSE_DRIVER,
    GCS_FUSE_ROOT,
    GCS_FUSE_VOLUME,
    JOB_INDEX_LABEL,
    JOB_LABEL,
    JOBSET_API_VERSION,
    JOBSET_NAME_LABEL,
    KUEUE_API_VERSION,
    KUEUE_PRIORITY_LABEL,
    KUEUE_QUEUE_LABEL,
    LOCAL_TIER_PATH,
    LOCAL_TIER_VOLUME,
    NODEPOOL_LABEL,
    REPLICATED_JOB,
    RUN_LABEL,
    RUN_URI_ANNOTATION,
    SPOT_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    TPU_RUNTIME_PORT,
    K8sObject,
    coordinator_address,
    jobset_name,
    label_value,
)
from training.gke.resources import fuse_sidecar_annotations
from training.gke.tpu import TPUSlice
from training.priorities import PRIORITIES, priority_value
from training.storage import GCS_MOUNTS_ENV

if TYPE_CHECKING:
    from training.config import Config
    from training.sections import ElasticSection


# --- manifests -------------------------------------------------------------------------


@dataclass(frozen=True)
class GKEManifests:
    """What one launch attempt creates: the headless Service first, then the JobSet."""

    name: str
    namespace: str
    service: K8sObject
    jobset: K8sObject
    num_slices: int
    num_processes: int
    coordinator: str


def _env(name: str, value: str | int) -> K8sObject:
    return {"name": name, "value": str(value)}


def _env_field(name: str, path: str) -> K8sObject:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def render_service(name: str, namespace: str, labels: Mapping[str, str]) -> K8sObject:
    """The headless Service that gives every pod of the JobSet a DNS name before it is ready.

    The JobSet controller uses an existing Service named like the subdomain
    instead of making its own; ours publishes not-ready addresses so that
    process 0's name resolves while the other processes are still starting.
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "clusterIP": "None",
            "selector": {JOBSET_NAME_LABEL: name},
            "publishNotReadyAddresses": True,
        },
    }


def render(cfg: Config, tpu: TPUSlice, launch: GKELaunch, job: str, num_slices: int | None = None) -> GKEManifests:
    """The Service and JobSet of one job: one host agent per pod, on up to ``num_slices`` slices of shape ``tpu``.

    ``num_slices`` defaults to the most the job may use (``max_workers`` in whole
    slices); the slices whose nodes are missing stay Pending and join when they come.
    """
    num_slices = check_slices(cfg, tpu, launch, num_slices)
    name = jobset_name(cfg.run_name, job)
    labels = {
        "app.kubernetes.io/name": "rtrain",
        "app.kubernetes.io/component": "agent",
        RUN_LABEL: label_value(cfg.run_name),
        JOB_LABEL: label_value(job),
        **launch.labels,
    }
    annotations = {RUN_URI_ANNOTATION: cfg.run_uri}
    container = _container(cfg, tpu, launch, job, name)
    volumes, pod_annotations = _volumes(cfg, launch, container)
    pod_spec = _pod_spec(tpu, launch, container, volumes)
    job_template = _job_template(
        cfg.elastic, tpu.hosts, labels, annotations, {**annotations, **pod_annotations}, pod_spec
    )
    return GKEManifests(
        name=name,
        namespace=launch.namespace,
        service=render_service(name, launch.namespace, labels),
        jobset=_jobset(name, tpu, launch, labels, annotations, job_template, num_slices),
        num_slices=num_slices,
        num_processes=num_slices * tpu.hosts,
        coordinator=coordinator_address(name, launch.coordinator_port),
    )


def _container(cfg: Config, tpu: TPUSlice, launch: GKELaunch, job: str, name: str) -> K8sObject:
    """The agent's container: the entrypoint, its environment, its ports and the host's TPU chips."""
    env = [
        _env("RTRAIN_JOB", job),
        _env("RTRAIN_SUBDOMAIN", name),
        _env("RTRAIN_COORDINATOR_PORT", launch.coordinator_port),
        _env("RTRAIN_HOSTS_PER_SLICE", tpu.hosts),
        _env("MEGASCALE_PORT", launch.megascale_port),
        _env_field("RTRAIN_SLICE_INDEX", f"metadata.labels['{JOB_INDEX_LABEL}']"),
        _env_field("RTRAIN_HOST_INDEX", f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"),
        _env_field("RTRAIN_POD_IP", "status.podIP"),
        _env_field("RTRAIN_NAMESPACE", "metadata.namespace"),
    ]
    env += [_env(k, v) for k, v in sorted(launch.env.items())]
    resources = launch.container_resources(cfg, tpu)
    return {
        "name": CONTAINER_NAME,
        "image": launch.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["/bin/sh", "-c", ENTRYPOINT_SCRIPT, "rtrain-entrypoint"],
        "args": [*AGENT_ARGS, cfg.run_uri],
        "env": env,
        "ports": [
            {"name": "coordinator", "containerPort": launch.coordinator_port, "protocol": "TCP"},
            {"name": "peer-watch", "containerPort": launch.watch_ports[0], "protocol": "TCP"},
            {"name": "host-watch", "containerPort": launch.watch_ports[1], "protocol": "TCP"},
            {"name": "tpu-runtime", "containerPort": TPU_RUNTIME_PORT, "protocol": "TCP"},
            {"name": "megascale", "containerPort": launch.megascale_port, "protocol": "TCP"},
        ],
        "resources": resources,
    }


def _volumes(cfg: Config, launch: GKELaunch, container: K8sObject) -> tuple[list[K8sObject], dict[str, str]]:
    """(the pod's volumes, the pod annotations they need); mounts them in ``container`` and adds their env."""
    volumes: list[K8sObject] = []
    mounts: list[K8sObject] = []
    pod_annotations: dict[str, str] = {}
    env = container["env"]
    if cfg.checkpoint.local_checkpoint_every:
        # The local checkpoint tier: host memory that survives the worker (not the pod), as Orbax's
        # multi-tier checkpointing uses on GKE.
        volumes.append(
            {"name": LOCAL_TIER_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": launch.local_tier_size}}
        )
        mounts.append({"name": LOCAL_TIER_VOLUME, "mountPath": LOCAL_TIER_PATH})
        env.append(_env("RTRAIN_LOCAL_CHECKPOINT_DIR", LOCAL_TIER_PATH))
    if launch.gcs_fuse:
        bucket = dataset_bucket(cfg.data)
        volumes.append(
            {
                "name": GCS_FUSE_VOLUME,
                "csi": {
                    "driver": GCS_FUSE_DRIVER,
                    "readOnly": True,
                    # Records are read at random offsets: each shard is cached whole on its first read.
                    "volumeAttributes": {
                        "bucketName": bucket,
                        "mountOptions": "implicit-dirs",
                        "fileCacheCapacity": "-1",  # the whole cache volume (gke-gcsfuse/ephemeral-storage-limit)
                        "fileCacheForRangeRead": "true",
                    },
                },
            }
        )
        mounts.append({"name": GCS_FUSE_VOLUME, "mountPath": f"{GCS_FUSE_ROOT}/{bucket}", "readOnly": True})
        env.append(_env(GCS_MOUNTS_ENV, f"{bucket}={GCS_FUSE_ROOT}/{bucket}"))
        pod_annotations[GCS_FUSE_ANNOTATION] = "true"
        pod_annotations[GCS_FUSE_CACHE_ANNOTATION] = launch.gcs_fuse_cache
        pod_annotations.update(fuse_sidecar_annotations())  # request = limit: the pod stays Guaranteed
    if mounts:
        container["volumeMounts"] = mounts
    return volumes, pod_annotations


def _pod_spec(tpu: TPUSlice, launch: GKELaunch, container: K8sObject, volumes: list[K8sObject]) -> K8sObject:
    """One host's pod: on a node of the slice's shape (and pools), never restarted in place."""
    node_selector = {ACCELERATOR_LABEL: tpu.accelerator, TOPOLOGY_LABEL: tpu.topology}
    if launch.spot:
        node_selector[SPOT_LABEL] = "true"
    pod_spec: K8sObject = {
        "restartPolicy": "Never",  # the Job recreates a failed pod (podFailurePolicy needs Never)
        "terminationGracePeriodSeconds": launch.pod_grace_s,
        "nodeSelector": node_selector,
        "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
    }
    if volumes:
        pod_spec["volumes"] = volumes
    if launch.service_account:
        pod_spec["serviceAccountName"] = launch.service_account
    if launch.node_pools:
        pools = {"key": NODEPOOL_LABEL, "operator": "In", "values": list(launch.node_pools)}
        pod_spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [pools]}]}
            }
        }
    if launch.spot:
        pod_spec["tolerations"].append(
            {"key": SPOT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
        )
    if launch.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    return pod_spec


def _job_template(
    elastic: ElasticSection,
    hosts: int,
    labels: dict[str, str],
    annotations: dict[str, str],
    pod_annotations: dict[str, str],
    pod_spec: K8sObject,
) -> K8sObject:
    """The Job of one slice: an indexed pod per host, recreated when it fails."""
    return {
        "metadata": {"labels": dict(labels), "annotations": dict(annotations)},
        "spec": {
            "parallelism": hosts,
            "completions": hosts,
            "completionMode": "Indexed",
            # A host's pod is recreated when it fails (its agent rejoins); preemptions and evictions
            # do not count, and a job that has failed for good fails the Job at once.
            "backoffLimitPerIndex": max(elastic.max_failures, 1),
            # A replacement only once the old pod has failed (the only value podFailurePolicy allows): a
            # terminating leader and its successor never exist together; the failed one is removed by
            # training.gke.reaper before JobSet's webhook counts it (docs/gke.md, "Failed pods").
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {
                "rules": [
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": CONTAINER_NAME,
                            "operator": "In",
                            "values": list(FINAL_EXIT_CODES),
                        },
                    },
                ]
            },
            "template": {
                "metadata": {"labels": dict(labels), "annotations": pod_annotations},
                "spec": pod_spec,
            },
        },
    }


def _jobset(
    name: str,
    tpu: TPUSlice,
    launch: GKELaunch,
    labels: dict[str, str],
    annotations: dict[str, str],
    job_template: K8sObject,
    num_slices: int,
) -> K8sObject:
    """The JobSet: ``num_slices`` copies of the slice's Job, one slice per node pool, admitted whole by Kueue."""
    jobset_annotations = dict(annotations)
    jobset_labels = dict(labels)
    if launch.kueue_queue is not None:
        # Kueue admits (or preempts) the whole JobSet; moving hosts inside the job stays the scheduler's notice.
        jobset_labels[KUEUE_QUEUE_LABEL] = launch.kueue_queue
        if launch.priority is not None:
            jobset_labels[KUEUE_PRIORITY_LABEL] = priority_class_name(launch.priority)
    if tpu.multi_host:
        # One slice per node pool: a multi-host pool is exactly one ICI-connected slice.
        jobset_annotations[EXCLUSIVE_TOPOLOGY_ANNOTATION] = NODEPOOL_LABEL
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": launch.namespace,
            "labels": jobset_labels,
            "annotations": jobset_annotations,
        },
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "Any", "targetReplicatedJobs": [REPLICATED_JOB]},
            "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": num_slices, "template": job_template}],
        },
    }


def priority_class_name(priority: str) -> str:
    """The Kueue WorkloadPriorityClass of a priority level."""
    priority_value(priority)
    return f"rtrain-{priority}"


def workload_priority_classes() -> list[K8sObject]:
    """Kueue's WorkloadPriorityClass for each priority level (applied once per cluster)."""
    return [
        {
            "apiVersion": KUEUE_API_VERSION,
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": priority_class_name(name), "labels": {"app.kubernetes.io/name": "rtrain"}},
            "value": value,
            "description": f"resilient-training runs of priority {name}",
        }
        for name, value in PRIORITIES.items()
    ]
