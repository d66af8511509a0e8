"""GKE's side of a job, pure: TPU slices, the JobSet that runs one training job on them, and their capacity.

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
sensor's retry takes over.  It succeeds when any slice's Job does.  Everything is pure (manifests
are dicts) except :class:`GKECapacity`, which reads nodes through a callable; no Airflow, no JAX.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Required, TypedDict

from training.priorities import PRIORITIES, PriorityError, priority_value
from training.storage import GCS_MOUNTS_ENV

if TYPE_CHECKING:
    from training.config import Config

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

DEFAULT_COORDINATOR_PORT = 8476  # the port JAX's own GKE/TPU cluster detection uses
DEFAULT_MEGASCALE_PORT = 8080  # libtpu's DCN transport between slices
TPU_RUNTIME_PORT = 8471
# Ports the TPU runtime may take on a TPU VM: libtpu's runtime port (8471, TPU_PROCESS_PORT; per-process ports
# above it when a host runs a process per chip), JAX's own Cloud TPU coordinator (8482, jax/_src/clusters/
# cloud_tpu_cluster.py) and libtpu's runtime metrics (8431, --runtime_metric_service_port).  The agents' own
# watches stay out of them (training.elastic.peerwatch.peer_watch_port, hostwatch.host_watch_port).
LIBTPU_PORTS = frozenset(range(8470, 8483)) | {8431}
WATCH_PORT_OFFSET = 14  # the watches' ports above the coordinator's (training.elastic.peerwatch.WATCH_PORT_OFFSET)

# The agent command; the entrypoint script ``exec``s it with this host's identity and addresses.
# The pod's DNS name is its hostname under the headless Service: the Job controller names an Indexed Job's
# pod host <job>-<index>, the JobSet names the Job <jobset>-<replicated job>-<job index>.  It is built from
# the downward API (the JobSet's name is the subdomain), never from $HOSTNAME: on the host network that
# is the node's name, which the Service does not know.
AGENT_ARGS = ("rtrain", "agent")
ENTRYPOINT_SCRIPT = (
    "set -eu\n"
    'exec "$@" --job "$RTRAIN_JOB" --host "s${RTRAIN_SLICE_INDEX}-h${RTRAIN_HOST_INDEX}" '
    '--coordinator-host "${RTRAIN_SUBDOMAIN}-' + REPLICATED_JOB + "-${RTRAIN_SLICE_INDEX}-${RTRAIN_HOST_INDEX}"
    '.${RTRAIN_SUBDOMAIN}" '
    '--coordinator-port "$RTRAIN_COORDINATOR_PORT" --bind-host "$RTRAIN_POD_IP"\n'
)
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

_DNS_LABEL_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


class GKEConfigError(Exception):
    """A TPU shape or run config that cannot run on GKE, with a message that names the key."""


# --- TPU machine types -------------------------------------------------------------


@dataclass(frozen=True)
class TPUMachineType:
    """One GKE TPU machine type: what one host (VM) of it has."""

    machine_type: str
    generation: str
    accelerator: str  # the value of the node label cloud.google.com/gke-tpu-accelerator
    chips_per_host: int
    dims: int  # 2: a 2D torus topology "AxB"; 3: a 3D topology "AxBxC"
    topologies: tuple[str, ...] | None = None  # the topologies GKE offers; None: any whose chips fill whole hosts


_2D_MULTI = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
# v4 / v5p (3D): a slice smaller than one 4x4x4 cube is one of these; from a cube up, whole cubes
# (every dimension a multiple of 4).  Cloud TPU's v4 and v5p topology tables.
_3D_SUB_CUBE = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")

#: The one table of TPU machine types this project knows.  chips_per_host is
#: Config.devices_per_worker (JAX shows a v4/v5p megacore chip as one device).
TPU_MACHINE_TYPES: dict[str, TPUMachineType] = {
    t.machine_type: t
    for t in (
        TPUMachineType("ct4p-hightpu-4t", "v4", "tpu-v4-podslice", 4, 3),
        TPUMachineType("ct5lp-hightpu-1t", "v5e", "tpu-v5-lite-podslice", 1, 2, ("1x1",)),
        TPUMachineType("ct5lp-hightpu-4t", "v5e", "tpu-v5-lite-podslice", 4, 2, _2D_MULTI),
        TPUMachineType("ct5lp-hightpu-8t", "v5e", "tpu-v5-lite-podslice", 8, 2, ("2x4",)),
        TPUMachineType("ct5p-hightpu-4t", "v5p", "tpu-v5p-slice", 4, 3),
        TPUMachineType("ct6e-standard-1t", "v6e", "tpu-v6e-slice", 1, 2, ("1x1",)),
        TPUMachineType("ct6e-standard-4t", "v6e", "tpu-v6e-slice", 4, 2, _2D_MULTI),
        TPUMachineType("ct6e-standard-8t", "v6e", "tpu-v6e-slice", 8, 2, ("2x4",)),
    )
}


def machine_type_info(machine_type: str) -> TPUMachineType:
    try:
        return TPU_MACHINE_TYPES[machine_type]
    except KeyError:
        raise GKEConfigError(
            f"machine_type: unknown TPU machine type {machine_type!r}; known: {', '.join(sorted(TPU_MACHINE_TYPES))}"
        ) from None


@dataclass(frozen=True)
class TPUSlice:
    """A TPU slice shape: a machine type and a topology; it knows its chips and hosts."""

    machine_type: str
    topology: str

    def __post_init__(self) -> None:
        info = machine_type_info(self.machine_type)
        parts = self.topology.split("x")
        if len(parts) != info.dims or not all(p.isdigit() and int(p) >= 1 for p in parts):
            shape = "AxB" if info.dims == 2 else "AxBxC"
            raise GKEConfigError(f"tpu_topology: {self.topology!r} is not a {shape} topology for {self.machine_type}")
        if info.topologies is not None and self.topology not in info.topologies:
            raise GKEConfigError(
                f"tpu_topology: {self.machine_type} offers {', '.join(info.topologies)}, not {self.topology!r}"
            )
        if info.dims == 3 and self.topology not in _3D_SUB_CUBE and any(int(p) % 4 for p in parts):
            raise GKEConfigError(
                f"tpu_topology: {info.generation} slices are {', '.join(_3D_SUB_CUBE)} or whole 4x4x4 cubes "
                f"(each dimension a multiple of 4, e.g. 4x4x4, 4x4x8, 4x8x8), not {self.topology!r}"
            )
        if self.chips % info.chips_per_host:
            raise GKEConfigError(
                f"tpu_topology: {self.topology} has {self.chips} chips, not a whole number of "
                f"{self.machine_type} hosts ({info.chips_per_host} chips each)"
            )

    @property
    def info(self) -> TPUMachineType:
        return TPU_MACHINE_TYPES[self.machine_type]

    @property
    def accelerator(self) -> str:
        return self.info.accelerator

    @property
    def chips(self) -> int:
        return math.prod(int(p) for p in self.topology.split("x"))

    @property
    def chips_per_host(self) -> int:
        return self.info.chips_per_host

    @property
    def hosts(self) -> int:
        """Hosts (VMs, so JAX processes) of one slice."""
        return self.chips // self.chips_per_host

    @property
    def multi_host(self) -> bool:
        """A slice of several VMs: its node pool holds exactly this one slice."""
        return self.hosts > 1


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


def coordinator_address(name: str, port: int = DEFAULT_COORDINATOR_PORT, subdomain: str | None = None) -> str:
    """host:port of process 0 (slice 0, host 0), resolvable through the headless Service."""
    return f"{pod_hostname(name, 0, 0)}.{subdomain or name}:{port}"


# --- a round's worker environment ---------------------------------------------------------

# What libtpu reads of a worker's place in the job.  GKE's TPU webhook puts these into every pod of the
# JobSet for the JobSet as created (TPU_WORKER_* for the pod's slice, MEGASCALE_* for all its replicas),
# so they are wrong as soon as a round has fewer slices: the agent starts each worker without them
# (worker_base_env) and gives it the values of its round (round_env).
ROUND_ENV_KEYS = frozenset({"TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES"})
ROUND_ENV_PREFIXES = ("MEGASCALE_",)
_HOST_ID_RE = re.compile(r"^s(?P<slice>\d+)-h(?P<index>\d+)$")


def is_round_env(key: str) -> bool:
    """Whether ``key`` is a variable whose value belongs to a round, not to the pod."""
    return key in ROUND_ENV_KEYS or key.startswith(ROUND_ENV_PREFIXES)


def worker_base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The pod's environment for a worker process, without the variables of a round (:func:`is_round_env`)."""
    return {k: v for k, v in environ.items() if not is_round_env(k)}


def member_dns_name(host: str, subdomain: str) -> str:
    """The DNS name of the pod of host id ``s<slice>-h<index>``: ``<jobset>-slice-<slice>-<index>.<subdomain>``."""
    m = _HOST_ID_RE.match(host)
    if not m:
        raise ValueError(f"host id {host!r} is not s<slice>-h<index> (a GKE pod's host id)")
    return f"{pod_hostname(subdomain, int(m['slice']), int(m['index']))}.{subdomain}"


def round_env(
    members: list[str], rank: int, hosts_per_slice: int, coordinator: str, megascale_port: str | int | None = None
) -> dict[str, str]:
    """The TPU environment of the worker of rank ``rank`` in a round of ``members`` (slice-major, whole slices).

    Every round of multi-host slices: ``TPU_WORKER_ID`` (the worker's rank in its slice) and
    ``TPU_WORKER_HOSTNAMES`` (its slice's members in rank order); a single-host slice runs without them,
    as GKE starts it (its webhook sets them only for multi-host Jobs).  A round on 2 or more slices adds libtpu's Multislice variables:
    ``MEGASCALE_COORDINATOR_ADDRESS`` (rank 0's host), ``MEGASCALE_NUM_SLICES``, ``MEGASCALE_SLICE_ID``
    and ``MEGASCALE_PORT``.  A round on one slice has none: a single slice needs no Multislice runtime,
    and one told of other slices waits for them.  ``coordinator`` is the round's ``<rank 0's DNS name>:port``,
    whose domain is the JobSet's subdomain.
    """
    if not 0 <= rank < len(members) or len(members) % hosts_per_slice:
        raise ValueError(f"rank {rank} of {len(members)} members in slices of {hosts_per_slice}")
    host = coordinator.rsplit(":", 1)[0]
    if "." not in host:
        raise ValueError(f"coordinator {coordinator!r} is not <pod hostname>.<subdomain>:port")
    subdomain = host.split(".", 1)[1]
    env: dict[str, str] = {}
    if hosts_per_slice > 1:
        first = rank - rank % hosts_per_slice
        env["TPU_WORKER_ID"] = str(rank % hosts_per_slice)
        env["TPU_WORKER_HOSTNAMES"] = ",".join(
            member_dns_name(h, subdomain) for h in members[first : first + hosts_per_slice]
        )
    slices = len(members) // hosts_per_slice
    if slices > 1:
        env |= {
            "MEGASCALE_COORDINATOR_ADDRESS": host,
            "MEGASCALE_NUM_SLICES": str(slices),
            "MEGASCALE_SLICE_ID": str(rank // hosts_per_slice),
            "MEGASCALE_PORT": str(megascale_port or DEFAULT_MEGASCALE_PORT),
        }
    return env


# --- launch options and the run config --------------------------------------------------


class GKESettings(TypedDict, total=False):
    """A run's ``gke`` settings: the cluster, the slices' shape and where the pods run (the DAG's ``gke`` param)."""

    project_id: str
    location: Required[str]
    cluster_name: Required[str]
    machine_type: Required[str]  # the TPU machine type, e.g. ct5lp-hightpu-4t
    tpu_topology: Required[str]  # e.g. 2x4
    image: Required[str]  # the training image the pods run
    node_pools: Required[list[str]]  # one per slice
    namespace: str
    spot: bool
    node_locations: list[str]
    service_account: str  # the pods' Kubernetes service account
    node_service_account: str  # the nodes' Google service account
    gcp_conn_id: str  # the Airflow connection the cluster calls use
    kueue_queue: str  # a Kueue LocalQueue: it admits the JobSet by the run's priority
    provision_timeout_s: float  # how long provisioning waits for enough node pools for min_workers
    flex_start: bool
    queued_provisioning: bool
    gcs_fuse: bool
    spot_shutdown_grace_s: int  # Spot pools: the nodes' shutdown grace, 30 (GKE's default) or 120 (1.35.0-gke.1171000+)


@dataclass(frozen=True)
class GKELaunch:
    """Where and how the workers run on the cluster (what the run config does not say)."""

    image: str
    namespace: str = "default"
    service_account: str = "rtrain-worker"  # the Kubernetes SA bound to a Google identity (Workload Identity)
    coordinator_port: int = DEFAULT_COORDINATOR_PORT
    megascale_port: int = DEFAULT_MEGASCALE_PORT
    node_pools: tuple[str, ...] = ()  # restrict the pods to these node pools (empty: any pool of the TPU shape)
    spot: bool = False  # select Spot VMs (node label cloud.google.com/gke-spot=true)
    host_network: bool = False  # pods on the host network: faster DCN between slices (needs identity="node")
    cpu: str | None = None  # CPU / memory requests of the worker container (None: none)
    memory: str | None = None
    # The pods' terminationGracePeriodSeconds; None: what a preemption gives them (Spot: spot_grace_s, else 30).
    termination_grace_period_s: int | None = None
    # What a Spot node's preemption gives a pod: 15 s by default on GKE; 105 s on a pool made with
    # TPUNodePoolSpec.spot_shutdown_grace_s=120.
    spot_grace_s: int = SPOT_POD_GRACE_S
    identity: str = "workload-identity"  # how the pods reach gs:// (IDENTITIES)
    # Mount the dataset's bucket with GCS FUSE: the workers read its shards there instead of downloading them,
    # through a file cache of up to gcs_fuse_cache on the node's disk (the FUSE sidecar's ephemeral storage).
    gcs_fuse: bool = False
    gcs_fuse_cache: str = "20Gi"
    # The local checkpoint tier's volume (an emptyDir in memory; counts against the pod's memory).
    local_tier_size: str = "16Gi"
    env: Mapping[str, str] = field(default_factory=dict)  # more environment for every worker
    labels: Mapping[str, str] = field(default_factory=dict)  # more labels for the JobSet and its pods
    # Kueue: submit the JobSet to this LocalQueue (None: created at once, no queueing), at this priority level.
    kueue_queue: str | None = None
    priority: str | None = None

    def __post_init__(self) -> None:
        if not self.image or any(c.isspace() for c in self.image):
            raise GKEConfigError(f"image: a container image reference is required, got {self.image!r}")
        if not _DNS_LABEL_RE.match(self.namespace) or len(self.namespace) > 63:
            raise GKEConfigError(f"namespace: {self.namespace!r} is not a Kubernetes namespace name")
        if self.service_account and not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", self.service_account):
            raise GKEConfigError(f"service_account: {self.service_account!r} is not a Kubernetes service account name")
        for key in ("coordinator_port", "megascale_port"):
            port = getattr(self, key)
            if not 1 <= port <= 65535:
                raise GKEConfigError(f"{key}: {port} is not a TCP port")
        taken = {self.megascale_port, TPU_RUNTIME_PORT}
        peer, host = self.watch_ports
        if taken & {self.coordinator_port, peer, host} or {peer, host} & LIBTPU_PORTS:
            raise GKEConfigError(
                f"coordinator_port: {self.coordinator_port} (and the peer watch's {peer}, the host watch's {host}) "
                f"collides with a TPU runtime port (megascale {self.megascale_port}, libtpu's 8431 and 8470-8482)"
            )
        if not 1 <= host <= 65535:
            raise GKEConfigError(f"coordinator_port: {self.coordinator_port} leaves no port for the watches")
        if self.termination_grace_period_s is not None and self.termination_grace_period_s < 1:
            raise GKEConfigError(f"termination_grace_period_s: at least 1, got {self.termination_grace_period_s}")
        if not 1 <= self.spot_grace_s <= 120:
            raise GKEConfigError(f"spot_grace_s: 1..120 (GKE's Spot shutdown grace), got {self.spot_grace_s}")
        if self.identity not in IDENTITIES:
            raise GKEConfigError(f"identity: one of {', '.join(IDENTITIES)}, got {self.identity!r}")
        if self.host_network and self.identity != "node":
            raise GKEConfigError(
                "identity: pods on the host network (host_network=True) cannot use Workload Identity: GKE's "
                "metadata server only serves the pod network, so gs:// would answer 403.  Set identity='node' "
                "and grant the node pool's service account the bucket (docs/gke.md), or leave host_network off"
            )
        if not re.fullmatch(r"[1-9][0-9]*(Ki|Mi|Gi|Ti)?", self.gcs_fuse_cache):
            raise GKEConfigError(f"gcs_fuse_cache: a size such as 20Gi, got {self.gcs_fuse_cache!r}")
        if self.gcs_fuse and self.identity != "workload-identity":
            raise GKEConfigError(
                "gcs_fuse: the GCS FUSE sidecar reads the bucket as the pod's Kubernetes service account "
                "(Workload Identity); it does not work with identity='node' (the host network)"
            )
        for pool in self.node_pools:
            if not _DNS_LABEL_RE.match(pool):
                raise GKEConfigError(f"node_pools: {pool!r} is not a node pool name")
        reserved = [k for k in self.env if k.startswith(("RTRAIN_", "MEGASCALE_"))]
        if reserved:
            raise GKEConfigError(f"env: {', '.join(reserved)} are set by the backend and cannot be overridden")
        for k, v in self.labels.items():
            if not _LABEL_VALUE_RE.match(v) or len(v) > 63:
                raise GKEConfigError(f"labels: {k}={v!r} is not a valid label value")
        if self.kueue_queue is not None and not _DNS_LABEL_RE.match(self.kueue_queue):
            raise GKEConfigError(f"kueue_queue: {self.kueue_queue!r} is not a LocalQueue name")
        if self.priority is not None:
            if self.kueue_queue is None:
                raise GKEConfigError("priority: needs kueue_queue (the priority is a Kueue WorkloadPriorityClass)")
            try:
                priority_value(self.priority)
            except PriorityError as e:
                raise GKEConfigError(f"priority: {e}") from None

    @property
    def watch_ports(self) -> tuple[int, int]:
        """The peer watch's and the host watch's ports (training.elastic.peerwatch / hostwatch pick the same)."""
        return self.coordinator_port + WATCH_PORT_OFFSET, self.coordinator_port + WATCH_PORT_OFFSET + 1

    @property
    def pod_grace_s(self) -> int:
        """The pods' terminationGracePeriodSeconds."""
        if self.termination_grace_period_s is not None:
            return self.termination_grace_period_s
        return self.spot_grace_s if self.spot else ON_DEMAND_POD_GRACE_S

    @property
    def preemption_window_s(self) -> int:
        """The seconds a pod really has after a preemption notice: on Spot, no more than the node gives."""
        return min(self.pod_grace_s, self.spot_grace_s) if self.spot else self.pod_grace_s


def gke_version(version: str) -> tuple[int, int, int, int]:
    """A GKE version (``1.35.0-gke.1171000``) as numbers; a plain Kubernetes one (``1.35.0``) as ``-gke.0``."""
    m = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)(?:-gke\.(\d+))?", version.strip())
    if not m:
        raise GKEConfigError(f"cluster version: {version!r} is not a GKE version such as 1.35.0-gke.1171000")
    return int(m[1]), int(m[2]), int(m[3]), int(m[4] or 0)


def spot_shutdown_grace_s(cluster_version: str | None) -> int:
    """The longest Spot shutdown grace a node pool of this cluster may ask for: 120 s from 1.35.0-gke.1171000, else 30 s."""
    if cluster_version and gke_version(cluster_version) >= EXTENDED_SPOT_GRACE_VERSION:
        return SPOT_SHUTDOWN_GRACE_S[1]
    return SPOT_SHUTDOWN_GRACE_S[0]


def spot_pod_grace_s(shutdown_grace_s: int) -> int:
    """What a Spot preemption leaves the training pods of a node with this shutdown grace (15 s are the system's)."""
    if shutdown_grace_s not in SPOT_SHUTDOWN_GRACE_S:
        raise GKEConfigError(
            f"spot_shutdown_grace_s: GKE accepts {' or '.join(map(str, SPOT_SHUTDOWN_GRACE_S))}, got {shutdown_grace_s}"
        )
    return shutdown_grace_s - CRITICAL_PODS_GRACE_S


def check_spot_grace(gke: GKESettings, cluster_version: str) -> None:
    """Refuse a Spot shutdown grace the cluster cannot give its node pools, before any is created."""
    asked = gke.get("spot_shutdown_grace_s")
    if gke.get("spot") and asked and asked > spot_shutdown_grace_s(cluster_version):
        raise GKEConfigError(
            f"gke.spot_shutdown_grace_s: {asked}s needs GKE 1.35.0-gke.1171000 or later; cluster {cluster_version} "
            f"gives Spot nodes {SPOT_SHUTDOWN_GRACE_S[0]}s (leave it out, or upgrade the control plane)"
        )


def settings_spot_grace_s(gke: GKESettings) -> int:
    """What a Spot preemption leaves the pods on the settings' pools (``spot_shutdown_grace_s`` less 15 s)."""
    return spot_pod_grace_s(int(gke.get("spot_shutdown_grace_s") or SPOT_SHUTDOWN_GRACE_S[0]))


def settings_preemption_grace_s(gke: GKESettings) -> float:
    """The longest stop-and-commit after a notice that the settings' pods have room for (their grace less 5 s)."""
    grace = settings_spot_grace_s(gke) if gke.get("spot") else ON_DEMAND_POD_GRACE_S
    return float(grace - GRACE_MARGIN_S)


def settings_launch(gke: GKESettings, priority: str | None = None) -> GKELaunch:
    """Where and how a run's pods go, from its ``gke`` settings (the GKE backend's placement)."""
    for key in ("image", "node_pools"):
        if not gke.get(key):
            raise GKEConfigError(f"gke.{key}: required")
    if gke.get("spot_shutdown_grace_s") is not None and not gke.get("spot"):
        raise GKEConfigError("gke.spot_shutdown_grace_s: only Spot nodes take a shutdown grace (gke.spot: true)")
    return GKELaunch(
        image=gke["image"],
        namespace=gke.get("namespace", "default"),
        service_account=gke.get("service_account", "rtrain-worker"),
        node_pools=tuple(gke["node_pools"]),
        spot=bool(gke.get("spot", False)),
        spot_grace_s=settings_spot_grace_s(gke),
        kueue_queue=gke.get("kueue_queue"),
        priority=priority,
        gcs_fuse=bool(gke.get("gcs_fuse", False)),
    )


def settings_keys(gke: GKESettings) -> dict[str, int]:
    """The config keys a run takes from its TPU type: hosts per slice, and chips per host (one process a host)."""
    for key in ("machine_type", "tpu_topology"):
        if not gke.get(key):
            raise GKEConfigError(f"gke.{key}: required")
    tpu = TPUSlice(gke["machine_type"], gke["tpu_topology"])
    return {"hosts_per_slice": tpu.hosts, "devices_per_worker": tpu.chips_per_host}


def fit_grace(cfg: Config, gke: GKESettings) -> Config:
    """The config with its stop-and-commit after a notice (``preemption_grace_s``) no longer than the pods have."""
    fit = min(cfg.preemption_grace_s, settings_preemption_grace_s(gke))
    return cfg if fit == cfg.preemption_grace_s else cfg.model_copy(update={"preemption_grace_s": fit})


def check_launch(cfg: Config, gke: GKESettings, priority: str | None = None) -> GKELaunch:
    """Everything a launch would refuse, before anything is created: the config against the TPU shape (chips
    per host, hosts per slice, slices in ``min_workers..max_workers`` the batch splits over), the grace against
    Spot, the ports, the image, the Kueue queue and priority, and a node pool for every slice.  Raises
    :class:`GKEConfigError` naming the key; returns the launch."""
    for key in ("machine_type", "tpu_topology"):
        if not gke.get(key):
            raise GKEConfigError(f"gke.{key}: required")
    tpu = TPUSlice(gke["machine_type"], gke["tpu_topology"])
    launch = settings_launch(gke, priority)
    k_max = _check_slices(cfg, tpu, launch, None)
    if tpu.multi_host and len(launch.node_pools) < k_max:
        raise GKEConfigError(
            f"gke.node_pools: {len(launch.node_pools)} pool(s) for up to {k_max} slices of {tpu.hosts} hosts "
            f"(max_workers={cfg.max_workers}): name one pool per slice"
        )
    return launch


def check_config(cfg: Config, tpu: TPUSlice) -> None:
    """Refuse a run config that cannot run on this TPU shape; messages name the key."""
    if cfg.backend != "gke":
        raise GKEConfigError(f"backend: the GKE launch needs backend=gke, got {cfg.backend!r}")
    if not cfg.root.startswith("gs://"):
        raise GKEConfigError(f"root: workers on GKE need a gs:// run root, got {cfg.root!r}")
    if cfg.devices_per_worker != tpu.chips_per_host:
        raise GKEConfigError(
            f"devices_per_worker: {tpu.machine_type} has {tpu.chips_per_host} chips per host, "
            f"but devices_per_worker={cfg.devices_per_worker}"
        )
    if cfg.hosts_per_slice != tpu.hosts:
        raise GKEConfigError(
            f"hosts_per_slice: a {tpu.machine_type} {tpu.topology} slice has {tpu.hosts} host(s), "
            f"but hosts_per_slice={cfg.hosts_per_slice} (a slice is lost and gained whole)"
        )
    slice_bounds(cfg, tpu)


def dataset_bucket(cfg: Config) -> str:
    """The bucket of the run's dataset (GCS FUSE mounts it); the dataset must be on gs://."""
    if not cfg.dataset.startswith("gs://"):
        raise GKEConfigError(f"gcs_fuse: mounts the dataset's bucket, but dataset={cfg.dataset!r} is not on gs://")
    return cfg.dataset[len("gs://") :].split("/", 1)[0]


def check_grace(cfg: Config, launch: GKELaunch) -> None:
    """The job's stop-and-commit after a notice (``preemption_grace_s``) must fit in the pods' grace, with a margin.

    On Spot the pods have what the node's shutdown gives them (``spot_grace_s``, 15 s by default), whatever
    their own ``terminationGracePeriodSeconds`` says.
    """
    window = launch.preemption_window_s
    if cfg.preemption_grace_s + GRACE_MARGIN_S > window:
        if launch.spot and window == launch.spot_grace_s:
            where = (
                f"a Spot preemption gives the pods {window}s (GKE's default is {SPOT_POD_GRACE_S}s; 105s with "
                "gke.spot_shutdown_grace_s: 120, on GKE 1.35.0-gke.1171000 or later)"
            )
        else:
            where = f"the pods get termination_grace_period_s={window}s"
        raise GKEConfigError(
            f"preemption_grace_s: {cfg.preemption_grace_s:g}s (the job's stop-and-commit after a preemption "
            f"notice) does not fit: {where}, minus a {GRACE_MARGIN_S}s margin; lower preemption_grace_s to at most "
            f"{window - GRACE_MARGIN_S}s or give the pods more (termination_grace_period_s)"
        )


def slice_bounds(cfg: Config, tpu: TPUSlice) -> tuple[int, int]:
    """The numbers of slices ``k`` whose hosts ``k * hosts`` lie in ``min_workers..max_workers``.

    A single-host slice cannot join others (GKE Multislice needs multi-host
    slices), so with one host per slice ``k`` is 1.
    """
    k_min = max(1, math.ceil(cfg.min_workers / tpu.hosts))
    k_max = cfg.max_workers // tpu.hosts
    if not tpu.multi_host:
        k_max = min(k_max, 1)
    if k_min > k_max:
        raise GKEConfigError(
            f"min_workers/max_workers: a {tpu.machine_type} {tpu.topology} slice has {tpu.hosts} host(s); "
            f"no number of slices gives {cfg.min_workers}..{cfg.max_workers} workers"
            + ("" if tpu.multi_host else " (single-host slices cannot form a multislice: k is 1)")
        )
    return k_min, k_max


def feasible_slices(cfg: Config, tpu: TPUSlice) -> list[int]:
    """The slice counts in :func:`slice_bounds` whose hosts the mesh and the global batch split over."""
    from training.mesh import feasible_sizes  # arithmetic only, no JAX

    k_min, k_max = slice_bounds(cfg, tpu)
    sizes = set(feasible_sizes(cfg))
    return [k for k in range(k_min, k_max + 1) if k * tpu.hosts in sizes]


def plan_slices(cfg: Config, tpu: TPUSlice, available_hosts: int) -> int:
    """The most slices the job can run on with ``available_hosts`` ready hosts; 0 when none fits."""
    fits = [k for k in feasible_slices(cfg, tpu) if k * tpu.hosts <= available_hosts]
    return max(fits) if fits else 0


# --- manifests -------------------------------------------------------------------------


@dataclass(frozen=True)
class GKEManifests:
    """What one launch attempt creates: the headless Service first, then the JobSet."""

    name: str
    namespace: str
    service: dict[str, Any]
    jobset: dict[str, Any]
    num_slices: int
    num_processes: int
    coordinator: str


def _env(name: str, value: str | int) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def _env_field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def render_service(name: str, namespace: str, labels: Mapping[str, str]) -> dict[str, Any]:
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
    num_slices = _check_slices(cfg, tpu, launch, num_slices)
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
    job_template = _job_template(cfg, tpu.hosts, labels, annotations, {**annotations, **pod_annotations}, pod_spec)
    return GKEManifests(
        name=name,
        namespace=launch.namespace,
        service=render_service(name, launch.namespace, labels),
        jobset=_jobset(name, tpu, launch, labels, annotations, job_template, num_slices),
        num_slices=num_slices,
        num_processes=num_slices * tpu.hosts,
        coordinator=coordinator_address(name, launch.coordinator_port),
    )


def _check_slices(cfg: Config, tpu: TPUSlice, launch: GKELaunch, num_slices: int | None) -> int:
    """The number of slices to render (the most the job may use by default), checked against the config."""
    check_config(cfg, tpu)
    check_grace(cfg, launch)
    k_min, k_max = slice_bounds(cfg, tpu)
    num_slices = k_max if num_slices is None else num_slices
    if not k_min <= num_slices <= k_max:
        raise GKEConfigError(
            f"num_slices: {num_slices} slices of {tpu.hosts} host(s) is outside min_workers..max_workers "
            f"({cfg.min_workers}..{cfg.max_workers}); allowed: {k_min}..{k_max}"
        )
    if not feasible_slices(cfg, tpu):
        raise GKEConfigError(
            f"min_workers/max_workers: the mesh or global_batch={cfg.global_batch} splits over no number of "
            f"{tpu.machine_type} {tpu.topology} slices in {cfg.min_workers}..{cfg.max_workers} hosts"
        )
    return num_slices


def _container(cfg: Config, tpu: TPUSlice, launch: GKELaunch, job: str, name: str) -> dict[str, Any]:
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
    ]
    env += [_env(k, v) for k, v in sorted(launch.env.items())]
    chips = str(tpu.chips_per_host)
    resources: dict[str, dict[str, str]] = {"requests": {TPU_RESOURCE: chips}, "limits": {TPU_RESOURCE: chips}}
    if launch.cpu:
        resources["requests"]["cpu"] = launch.cpu
    if launch.memory:
        resources["requests"]["memory"] = launch.memory
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


def _volumes(cfg: Config, launch: GKELaunch, container: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """(the pod's volumes, the pod annotations they need); mounts them in ``container`` and adds their env."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    pod_annotations: dict[str, str] = {}
    env = container["env"]
    if cfg.local_checkpoint_every:
        # The local checkpoint tier: host memory that survives the worker (not the pod), as Orbax's
        # multi-tier checkpointing uses on GKE.
        volumes.append(
            {"name": LOCAL_TIER_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": launch.local_tier_size}}
        )
        mounts.append({"name": LOCAL_TIER_VOLUME, "mountPath": LOCAL_TIER_PATH})
        env.append(_env("RTRAIN_LOCAL_CHECKPOINT_DIR", LOCAL_TIER_PATH))
    if launch.gcs_fuse:
        bucket = dataset_bucket(cfg)
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
    if mounts:
        container["volumeMounts"] = mounts
    return volumes, pod_annotations


def _pod_spec(
    tpu: TPUSlice, launch: GKELaunch, container: dict[str, Any], volumes: list[dict[str, Any]]
) -> dict[str, Any]:
    """One host's pod: on a node of the slice's shape (and pools), never restarted in place."""
    node_selector = {ACCELERATOR_LABEL: tpu.accelerator, TOPOLOGY_LABEL: tpu.topology}
    if launch.spot:
        node_selector[SPOT_LABEL] = "true"
    pod_spec: dict[str, Any] = {
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
    cfg: Config,
    hosts: int,
    labels: dict[str, str],
    annotations: dict[str, str],
    pod_annotations: dict[str, str],
    pod_spec: dict[str, Any],
) -> dict[str, Any]:
    """The Job of one slice: an indexed pod per host, recreated when it fails."""
    return {
        "metadata": {"labels": dict(labels), "annotations": dict(annotations)},
        "spec": {
            "parallelism": hosts,
            "completions": hosts,
            "completionMode": "Indexed",
            # A host's pod is recreated when it fails (its agent rejoins); preemptions and evictions
            # do not count, and a job that has failed for good fails the Job at once.
            "backoffLimitPerIndex": max(cfg.max_failures, 1),
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
    job_template: dict[str, Any],
    num_slices: int,
) -> dict[str, Any]:
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


def workload_priority_classes() -> list[dict[str, Any]]:
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
