"""The Kubernetes, JobSet, GKE and Kueue names and numbers a job relies on, and its objects' DNS-safe names.

Pure constants and string functions, no imports of the engine: every other module of :mod:`training.gke` (and the
agents, which set their watches' ports beside the TPU runtime's) reads them here.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

# A Kubernetes object, or a part of one (a pod spec, a container, a volume), as its API's JSON: free-form.
K8sObject = dict[str, Any]

# --- GKE / JobSet names we rely on -------------------------------------------
JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_PLURAL = "jobsets"
JOBSET_API_VERSION = f"{JOBSET_GROUP}/{JOBSET_VERSION}"

NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
SPOT_LABEL = "cloud.google.com/gke-spot"
TPU_RESOURCE = "google.com/tpu"

JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"  # the replica (slice) index, on the Job and its pods
EXCLUSIVE_TOPOLOGY_ANNOTATION = "alpha.jobset.sigs.k8s.io/exclusive-topology"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# The Job controller's per-index backoff (kubernetes pkg/controller/job): after the n-th failure of an index,
# counted or ignored by the podFailurePolicy alike (indexed_job_utils.go: getIndexAbsoluteFailureCount, from
# the two annotations below on the index's last failed pod, which count its failures before it), the next pod
# waits 10 s * 2^(n-1), at most 10 minutes, from that pod's end (backoff_utils.go: getRemainingTimePerIndex;
# job_controller.go: DefaultJobPodFailureBackOff, MaxJobPodFailureBackOff).
FAILURE_COUNT_ANNOTATION = "batch.kubernetes.io/job-index-failure-count"
IGNORED_COUNT_ANNOTATION = "batch.kubernetes.io/job-index-ignored-failure-count"
POD_FAILURE_BACKOFF_S = (10.0, 600.0)

REPLICATED_JOB = "slice"
CONTAINER_NAME = "agent"
LOCAL_TIER_VOLUME = "local-checkpoints"  # the emptyDir of the local checkpoint tier
LOCAL_TIER_PATH = "/var/rtrain/local"  # where it is mounted (RTRAIN_LOCAL_CHECKPOINT_DIR)
# GCS FUSE (the GKE add-on's CSI driver): the dataset's bucket, read-only, where the workers read it.
GCS_FUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
GCS_FUSE_ANNOTATION = "gke-gcsfuse/volumes"  # asks GKE to inject the FUSE sidecar into the pod
GCS_FUSE_CACHE_ANNOTATION = "gke-gcsfuse/ephemeral-storage-limit"  # the sidecar's disk: the file cache
GCS_FUSE_VOLUME = "dataset"
GCS_FUSE_ROOT = "/var/rtrain/gcs"  # the bucket at <root>/<bucket> (RTRAIN_GCS_MOUNTS)
# Kueue: the LocalQueue a JobSet is submitted to, and its WorkloadPriorityClass (one per priority level).
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
# v1beta2: the storage version since Kueue 0.16; Kueue 0.20 stops serving v1beta1.  Checked against the vendored
# CRD (tests/training/data/kueue.x-k8s.io_workloadpriorityclasses-v0.19.2.yaml).
KUEUE_API_VERSION = "kueue.x-k8s.io/v1beta2"
RUN_LABEL = "rtrain.dev/run"
JOB_LABEL = "rtrain.dev/job"
RUN_URI_ANNOTATION = "rtrain.dev/run-uri"

# The jax.distributed coordinator's port in the rounds the leader writes.  JAX's own TPU cluster detection used 8476
# once; it now uses 8482 (jax/_src/clusters/cloud_tpu_cluster.py: coordinator_port = '8482', jax 0.12.0.1), and
# k8s_cluster.py 55527.  The worker passes its address and turns detection off, so the port is ours: 8476 is free
# on a TPU VM whose host runs one process (libtpu takes 8471; the per-process ports above it only with one process
# a chip) and stays clear of JAX's 8482.
DEFAULT_COORDINATOR_PORT = 8476
DEFAULT_MEGASCALE_PORT = 8080  # libtpu's DCN transport between slices
TPU_RUNTIME_PORT = 8471
# Ports the TPU runtime may take on a TPU VM: libtpu's runtime port (8471, TPU_PROCESS_PORT; per-process ports
# above it when a host runs a process per chip), JAX's own Cloud TPU coordinator (8482, jax/_src/clusters/
# cloud_tpu_cluster.py) and libtpu's runtime metrics (8431, --runtime_metric_service_port).  The agents' own
# watches stay out of them (training.elastic.peerwatch.peer_watch_port, host.hostwatch.host_watch_port).
LIBTPU_PORTS = frozenset(range(8470, 8483)) | {8431}
WATCH_PORT_OFFSET = 14  # the watches' ports above the coordinator's (training.elastic.peerwatch.WATCH_PORT_OFFSET)

# The agent command; the entrypoint script ``exec``s it with this host's identity and addresses.
# The pod's DNS name is its hostname under the headless Service: the Job controller names an Indexed Job's
# pod host <job>-<index>, the JobSet names the Job <jobset>-<replicated job>-<job index>.  It is built from
# the downward API (the JobSet's name is the subdomain), never from $HOSTNAME: on the host network that
# is the node's name, which the Service does not know.
AGENT_ARGS = ("rtrain", "agent")
# A slice's leader pod (host index 0) also runs its slice's own repairs beside the agent (``rtrain repair-slices``:
# training.backends.gke_selfrepair), so that no watch need run for them; they end with the container.
ENTRYPOINT_SCRIPT = (
    "set -eu\n"
    'if [ "$RTRAIN_HOST_INDEX" = 0 ]; then "$1" repair-slices & fi\n'
    'exec "$@" --job "$RTRAIN_JOB" --host "s${RTRAIN_SLICE_INDEX}-h${RTRAIN_HOST_INDEX}" '
    '--coordinator-host "${RTRAIN_SUBDOMAIN}-' + REPLICATED_JOB + "-${RTRAIN_SLICE_INDEX}-${RTRAIN_HOST_INDEX}"
    '.${RTRAIN_SUBDOMAIN}" '
    '--coordinator-port "$RTRAIN_COORDINATOR_PORT" --bind-host "$RTRAIN_POD_IP"\n'
)
# A pod's way to its cluster's API server, for its slice's own repairs (training.backends.gke_selfrepair): the
# pod's in-cluster configuration, or the address in this variable where one is set (the pod emulator's server).
KUBE_API_ENV = "RTRAIN_KUBE_API"
# Agent exit codes that end the job for good (training.elastic.codes.AgentExit.FAILED, SUPERSEDED and STOPPED):
# the Job fails at once instead of recreating the pod.
FINAL_EXIT_CODES = (3, 5, 7)

# A JobSet's pod names are <jobset>-slice-<j>-<i>-<5 random>, at most 63
# characters (the JobSet webhook refuses longer ones).  30 leaves room for a
# thousand slices of a thousand hosts.
MAX_JOBSET_NAME = 30

# Node taints that mean "this host is going away or unusable" even while Ready.
UNUSABLE_TAINTS = frozenset(
    {
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
        "node.kubernetes.io/unschedulable",
        "node.kubernetes.io/out-of-disk",
        "cloud.google.com/impending-node-termination",
        "ToBeDeletedByClusterAutoscaler",
    }
)

# Pod grace (seconds).  A Spot VM's preemption gives the node 30 s of graceful shutdown, of which GKE
# keeps 15 s for system pods: a training pod gets 15 s, whatever its terminationGracePeriodSeconds.  A
# node pool can raise the node's shutdown grace to 120 s (kubelet shutdownGracePeriodSeconds, Spot only,
# newer GKE; TPUNodePoolSpec.spot_shutdown_grace_s), leaving the pods 120 - 15 = 105 s.
SPOT_POD_GRACE_S = 15
# GKE's Spot VMs (docs: concepts/spot-vms, "Termination and graceful shutdown of Spot VMs"): on a preemption
# notice the node shuts down in 30 s, the last 15 s kept for critical system pods; a Standard node pool may
# take 120 s (kubelet shutdownGracePeriodSeconds) once the control plane runs 1.35.0-gke.1171000 or later.
SPOT_SHUTDOWN_GRACE_S = (30, 120)
CRITICAL_PODS_GRACE_S = 15
EXTENDED_SPOT_GRACE_VERSION = (1, 35, 0, 1171000)
ON_DEMAND_POD_GRACE_S = 30  # Kubernetes' default terminationGracePeriodSeconds
GRACE_MARGIN_S = 5  # between the job's stop-and-commit (preemption_grace_s) and the pod's SIGKILL
# How the pods reach gs://: as their Kubernetes service account's Google identity (Workload Identity),
# or as the node's service account (the only way on the host network, where Workload Identity does not apply).
IDENTITIES = ("workload-identity", "node")

DNS_LABEL_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


class GKEConfigError(Exception):
    """A TPU shape or run config that cannot run on GKE, with a message that names the key."""


# --- names ---------------------------------------------------------------------------


def dns_label(text: str, max_len: int = 63) -> str:
    """``text`` as an RFC 1035 label (lowercase, starts with a letter), at most ``max_len`` long."""
    out = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    out = re.sub(r"-{2,}", "-", out)
    if not out or not out[0].isalpha():
        out = "r-" + out
    return out[:max_len].rstrip("-")


def label_value(text: str) -> str:
    """``text`` as a Kubernetes label value (63 characters, alphanumeric at both ends)."""
    out = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", out)


def jobset_name(run_name: str, job: str) -> str:
    """The JobSet (and headless Service) name of one job of a run.

    A new name per job: the failed JobSet of the last job may still be
    terminating when the next one is created.  A short hash of the exact run
    name and job id keeps two runs apart whose names differ only where the DNS
    form loses information (``a_b`` and ``a.b``, case, truncation).
    """
    if not job:
        raise GKEConfigError("job: a job id is required")
    digest = hashlib.sha256(f"{run_name}/{job}".encode()).hexdigest()[:8]
    suffix = f"-{digest}"
    base = dns_label(run_name, MAX_JOBSET_NAME - len(suffix))
    return base + suffix


def pod_hostname(name: str, slice_index: int, host_index: int) -> str:
    """The hostname the JobSet gives a pod: ``<jobset>-<replicated job>-<job index>-<pod index>``."""
    return f"{name}-{REPLICATED_JOB}-{slice_index}-{host_index}"


def child_job_name(name: str, slice_index: int) -> str:
    """The Job the JobSet makes for one slice: ``<jobset>-<replicated job>-<job index>`` (placement.GenJobName)."""
    return f"{name}-{REPLICATED_JOB}-{slice_index}"


def coordinator_address(name: str, port: int = DEFAULT_COORDINATOR_PORT, subdomain: str | None = None) -> str:
    """host:port of process 0 (slice 0, host 0), resolvable through the headless Service."""
    return f"{pod_hostname(name, 0, 0)}.{subdomain or name}:{port}"
