"""A GKE launch's options (a run's ``gke`` settings, :class:`GKELaunch`) and every check a launch would refuse,
made before any node pool exists (pure).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Required, TypedDict

from training.gke.names import (
    CRITICAL_PODS_GRACE_S,
    DEFAULT_COORDINATOR_PORT,
    DEFAULT_MEGASCALE_PORT,
    DNS_LABEL_RE,
    EXTENDED_SPOT_GRACE_VERSION,
    GRACE_MARGIN_S,
    IDENTITIES,
    LABEL_VALUE_RE,
    LIBTPU_PORTS,
    ON_DEMAND_POD_GRACE_S,
    SPOT_POD_GRACE_S,
    SPOT_SHUTDOWN_GRACE_S,
    TPU_RUNTIME_PORT,
    WATCH_PORT_OFFSET,
    GKEConfigError,
)
from training.gke.resources import pod_resources
from training.gke.tpu import TPUSlice, feasible_slices, slice_bounds
from training.priorities import PriorityError, priority_value

if TYPE_CHECKING:
    from training.config import Config
    from training.sections import CheckpointSection, DataSection


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
    admission_timeout_s: float  # how long a JobSet may wait for Kueue's admission while its pools are up
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
    # The agent container's CPU and memory, requests = limits (Guaranteed QoS); None: all the node leaves a pod
    # (training.gke.resources.agent_share).
    cpu: str | None = None
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
        if not DNS_LABEL_RE.match(self.namespace) or len(self.namespace) > 63:
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
            if not DNS_LABEL_RE.match(pool):
                raise GKEConfigError(f"node_pools: {pool!r} is not a node pool name")
        reserved = [k for k in self.env if k.startswith(("RTRAIN_", "MEGASCALE_"))]
        if reserved:
            raise GKEConfigError(f"env: {', '.join(reserved)} are set by the backend and cannot be overridden")
        for k, v in self.labels.items():
            if not LABEL_VALUE_RE.match(v) or len(v) > 63:
                raise GKEConfigError(f"labels: {k}={v!r} is not a valid label value")
        if self.kueue_queue is not None and not DNS_LABEL_RE.match(self.kueue_queue):
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
        """The peer watch's and the host watch's ports (training.elastic.peerwatch / training.elastic.host.hostwatch pick the same)."""
        return self.coordinator_port + WATCH_PORT_OFFSET, self.coordinator_port + WATCH_PORT_OFFSET + 1

    @property
    def pod_grace_s(self) -> int:
        """The pods' terminationGracePeriodSeconds."""
        if self.termination_grace_period_s is not None:
            return self.termination_grace_period_s
        return self.spot_grace_s if self.spot else ON_DEMAND_POD_GRACE_S

    def container_resources(self, cfg: Config, tpu: TPUSlice) -> dict[str, dict[str, str]]:
        """The agent container's requests and limits on ``tpu``'s nodes (refused when they do not fit a node)."""
        local_tier = self.local_tier_size if cfg.checkpoint.local_checkpoint_every else None
        return pod_resources(
            tpu.machine_type,
            tpu.chips_per_host,
            cpu=self.cpu,
            memory=self.memory,
            gcs_fuse=self.gcs_fuse,
            local_tier=local_tier,
        )

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
    fit = min(cfg.checkpoint.preemption_grace_s, settings_preemption_grace_s(gke))
    return (
        cfg
        if fit == cfg.checkpoint.preemption_grace_s
        else cfg.model_copy(update={"checkpoint.preemption_grace_s": fit})
    )


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
    k_max = check_slices(cfg, tpu, launch, None)
    if tpu.multi_host and len(launch.node_pools) < k_max:
        raise GKEConfigError(
            f"gke.node_pools: {len(launch.node_pools)} pool(s) for up to {k_max} slices of {tpu.hosts} hosts "
            f"(max_workers={cfg.elastic.max_workers}): name one pool per slice"
        )
    launch.container_resources(cfg, tpu)  # the pod's CPU and memory fit the node (and hold the local tier)
    return launch


def check_config(cfg: Config, tpu: TPUSlice) -> None:
    """Refuse a run config that cannot run on this TPU shape; messages name the key."""
    if cfg.placement.backend != "gke":
        raise GKEConfigError(f"backend: the GKE launch needs backend=gke, got {cfg.placement.backend!r}")
    if not cfg.root.startswith("gs://"):
        raise GKEConfigError(f"root: workers on GKE need a gs:// run root, got {cfg.root!r}")
    if cfg.placement.devices_per_worker != tpu.chips_per_host:
        raise GKEConfigError(
            f"devices_per_worker: {tpu.machine_type} has {tpu.chips_per_host} chips per host, "
            f"but devices_per_worker={cfg.placement.devices_per_worker}"
        )
    if cfg.placement.hosts_per_slice != tpu.hosts:
        raise GKEConfigError(
            f"hosts_per_slice: a {tpu.machine_type} {tpu.topology} slice has {tpu.hosts} host(s), "
            f"but hosts_per_slice={cfg.placement.hosts_per_slice} (a slice is lost and gained whole)"
        )
    slice_bounds(cfg.elastic, tpu)


def dataset_bucket(data: DataSection) -> str:
    """The bucket of the run's dataset (GCS FUSE mounts it); the dataset must be on gs://."""
    if not data.dataset.startswith("gs://"):
        raise GKEConfigError(f"gcs_fuse: mounts the dataset's bucket, but dataset={data.dataset!r} is not on gs://")
    return data.dataset[len("gs://") :].split("/", 1)[0]


def check_grace(checkpoint: CheckpointSection, launch: GKELaunch) -> None:
    """The job's stop-and-commit after a notice (``preemption_grace_s``) must fit in the pods' grace, with a margin.

    On Spot the pods have what the node's shutdown gives them (``spot_grace_s``, 15 s by default), whatever
    their own ``terminationGracePeriodSeconds`` says.
    """
    window = launch.preemption_window_s
    if checkpoint.preemption_grace_s + GRACE_MARGIN_S > window:
        if launch.spot and window == launch.spot_grace_s:
            where = (
                f"a Spot preemption gives the pods {window}s (GKE's default is {SPOT_POD_GRACE_S}s; 105s with "
                "gke.spot_shutdown_grace_s: 120, on GKE 1.35.0-gke.1171000 or later)"
            )
        else:
            where = f"the pods get termination_grace_period_s={window}s"
        raise GKEConfigError(
            f"preemption_grace_s: {checkpoint.preemption_grace_s:g}s (the job's stop-and-commit after a preemption "
            f"notice) does not fit: {where}, minus a {GRACE_MARGIN_S}s margin; lower preemption_grace_s to at most "
            f"{window - GRACE_MARGIN_S}s or give the pods more (termination_grace_period_s)"
        )


def check_slices(cfg: Config, tpu: TPUSlice, launch: GKELaunch, num_slices: int | None) -> int:
    """The number of slices to render (the most the job may use by default), checked against the config."""
    check_config(cfg, tpu)
    check_grace(cfg.checkpoint, launch)
    k_min, k_max = slice_bounds(cfg.elastic, tpu)
    num_slices = k_max if num_slices is None else num_slices
    if not k_min <= num_slices <= k_max:
        raise GKEConfigError(
            f"num_slices: {num_slices} slices of {tpu.hosts} host(s) is outside min_workers..max_workers "
            f"({cfg.elastic.min_workers}..{cfg.elastic.max_workers}); allowed: {k_min}..{k_max}"
        )
    if not feasible_slices(cfg, tpu):
        raise GKEConfigError(
            f"min_workers/max_workers: the mesh or global_batch={cfg.optimizer.global_batch} splits over no number of "
            f"{tpu.machine_type} {tpu.topology} slices in {cfg.elastic.min_workers}..{cfg.elastic.max_workers} hosts"
        )
    return num_slices
