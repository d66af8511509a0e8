"""Hooks for the Google Cloud production path: TPU node pools on GKE, and JobSets on the cluster.

:class:`GKETPUHook` extends the Google provider's ``GKEHook`` (which owns the
``ClusterManagerClient``) with TPU node pools: it builds the real
``google.cloud.container_v1`` requests from a :class:`TPUNodePoolSpec`, and
creates (idempotently), resizes and deletes pools.

:class:`JobSetHook` launches, watches and deletes the JobSet of a training job
through the cncf-kubernetes provider's ``KubernetesHook`` (custom objects API
for ``jobset.x-k8s.io/v1alpha2``); the manifests come from the engine
(``training.gke.render``).  :meth:`JobSetHook.start_job` is the one GKE launch
path: the pipeline's GKE backend and ``GKEStartTPUJobSetOperator`` both use it.

No JAX here: the TPU table and the manifests are plain Python.
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow.providers.google.cloud.hooks.kubernetes_engine import GKEHook
from airflow.providers.google.common.hooks.base_google import PROVIDE_PROJECT_ID, GoogleBaseHook
from google.api_core.exceptions import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    GoogleAPICallError,
    InternalServerError,
    NotFound,
    RetryError,
    ServiceUnavailable,
)
from google.cloud import container_v1

from training.api import JobHandle
from training.backends import PoolsUp
from training.gke import (
    ACCELERATOR_LABEL,
    JOBSET_API_VERSION,
    JOBSET_GROUP,
    JOBSET_NAME_LABEL,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    NODEPOOL_LABEL,
    GKECapacity,
    GKEConfigError,
    GKELaunch,
    GKEManifests,
    GKESettings,
    TPUSlice,
    check_config,
    describe_waiting,
    jobset_state,
    node_is_usable,
    pods_waiting,
    render,
)

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from airflow.providers.google.cloud.hooks.kubernetes_engine import GKEKubernetesHook

RESERVATION_KEY = "compute.googleapis.com/reservation-name"
# The nodes' OAuth scope: without one GKE gives only logging and monitoring, and the kubelet cannot pull
# the image from Artifact Registry.  What the nodes may do is then their service account's IAM roles.
NODE_OAUTH_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
# Spot node shutdown grace GKE accepts (kubelet shutdownGracePeriodSeconds; Spot only; 30 by default),
# and what of it is kept for system pods: the training pods get the rest (15 s by default).
SPOT_SHUTDOWN_GRACE_S = (30, 120)
CRITICAL_PODS_GRACE_S = 15
_POOL_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")  # GKE: <= 40 characters
_RESERVATION_RE = re.compile(r"^(projects/[a-z][-a-z0-9]{4,28}[a-z0-9]/reservations/)?[a-z]([-a-z0-9]*[a-z0-9])?$")


class TPUNodePoolError(RuntimeError):
    """A node pool operation that failed, or an existing pool that is not the one asked for."""


class PoolBeingDeleted(TPUNodePoolError):
    """A pool of that name is being deleted: it can be created again once it is gone."""


class JobSetError(RuntimeError):
    """A JobSet that could not be created or attached to."""


@dataclass(frozen=True)
class TPUNodePoolSpec:
    """One TPU node pool: for a multi-host shape exactly one slice, for a single-host shape ``num_slices`` VMs.

    :param name: node pool name (lowercase letters, digits and ``-``; at most 40).
    :param machine_type: a TPU machine type (``training.gke.TPUSlice`` knows them).
    :param tpu_topology: the slice topology, e.g. ``4x4`` (v5e/v6e) or ``2x2x2`` (v4/v5p).
    :param num_slices: single-host shapes only: how many one-VM slices the pool holds.
    :param spot: Spot VMs (cheap, preemptible; the elastic agent absorbs their loss).
    :param reservation: consume this reservation (``NAME`` or ``projects/P/reservations/NAME``).
    :param placement_policy: single-host shapes only: a compact resource policy name
        (``PlacementPolicy.policy_name``, sent with ``type: COMPACT``).  A multi-host slice is placed by its
        ``tpu_topology``, which GKE does not accept together with a policy name.
    :param compact_placement: single-host shapes: ``COMPACT`` placement of the pool's VMs.  A multi-host
        slice is one ICI-connected unit already (its ``tpu_topology``): nothing more is sent.
    :param additional_networks: extra node networks, ``(network, subnetwork)`` pairs (multi-networking clusters).
    :param node_locations: zones of the pool (TPUs are zonal; a regional cluster must say which zone).
    :param service_account: the nodes' Google service account (defaults to the cluster's).
    :param node_labels: extra Kubernetes labels on the nodes.
    :param workload_identity: run the GKE metadata server on the nodes, so that the worker pods
        act as their Kubernetes service account's Google identity (Workload Identity).
    :param auto_upgrade: GKE's node auto-upgrade.  An upgrade recreates every VM of a multi-host slice
        mid-run; GKE refuses ``False`` on a cluster in a release channel (docs/gke.md §4: a maintenance
        exclusion keeps upgrades off the training pools there), so ``False`` is for static-version clusters.
    :param spot_shutdown_grace_s: Spot only: the node's graceful shutdown on preemption, 30 or 120
        (newer GKE).  GKE keeps 15 s of it for system pods; the training pods get the rest (default: 15 s).
    :param flex_start: flex-start VMs (Dynamic Workload Scheduler): the pool is created empty and scales
        to its slice when the job's pods ask for it, for up to 7 days; neither Spot nor a reservation.
    :param queued_provisioning: with ``flex_start``: the slice is provisioned all at once for a
        ProvisioningRequest (Kueue's ProvisioningRequest admission check makes one for the JobSet).
    """

    name: str
    machine_type: str
    tpu_topology: str
    num_slices: int = 1
    spot: bool = False
    reservation: str | None = None
    placement_policy: str | None = None
    compact_placement: bool = False
    additional_networks: tuple[tuple[str, str], ...] = ()
    node_locations: tuple[str, ...] = ()
    service_account: str | None = None
    node_labels: Mapping[str, str] = field(default_factory=dict)
    disk_size_gb: int | None = None
    disk_type: str | None = None
    workload_identity: bool = True
    auto_upgrade: bool = True
    spot_shutdown_grace_s: int | None = None
    flex_start: bool = False
    queued_provisioning: bool = False

    def __post_init__(self) -> None:
        if not _POOL_NAME_RE.match(self.name):
            raise GKEConfigError(
                f"node_pool_name: {self.name!r} must be lowercase letters, digits and '-', start with a letter, "
                "and be at most 40 characters"
            )
        tpu = TPUSlice(self.machine_type, self.tpu_topology)  # validates both
        if self.num_slices < 1:
            raise GKEConfigError(f"num_slices: must be >= 1, got {self.num_slices}")
        if tpu.multi_host and self.num_slices != 1:
            raise GKEConfigError(
                f"num_slices: a {self.machine_type} {self.tpu_topology} pool is one {tpu.hosts}-host slice; "
                f"create {self.num_slices} node pools instead of one with num_slices={self.num_slices}"
            )
        if self.spot and self.reservation:
            raise GKEConfigError("spot/reservation: Spot VMs cannot consume a reservation; choose one")
        if self.reservation is not None and not _RESERVATION_RE.match(self.reservation):
            raise GKEConfigError(f"reservation: {self.reservation!r} is not NAME or projects/PROJECT/reservations/NAME")
        for pair in self.additional_networks:
            if len(pair) != 2 or not all(isinstance(p, str) and p for p in pair):
                raise GKEConfigError(f"additional_networks: {pair!r} is not a (network, subnetwork) pair")
        if self.disk_size_gb is not None and self.disk_size_gb < 10:
            raise GKEConfigError(f"disk_size_gb: at least 10, got {self.disk_size_gb}")
        if tpu.multi_host and self.placement_policy:
            raise GKEConfigError(
                f"placement_policy: a {self.machine_type} {self.tpu_topology} pool is a multi-host slice, placed by "
                "its tpu_topology; GKE refuses a placement policy name together with it"
            )
        if self.flex_start and (self.spot or self.reservation):
            raise GKEConfigError(
                "flex_start: flex-start VMs are neither Spot nor from a reservation; choose one of spot, "
                "reservation, flex_start"
            )
        if self.queued_provisioning and not self.flex_start:
            raise GKEConfigError(
                "queued_provisioning: GKE queues the provisioning of flex-start pools only (flex_start=True)"
            )
        if self.spot_shutdown_grace_s is not None:
            if not self.spot:
                raise GKEConfigError("spot_shutdown_grace_s: only Spot nodes take a shutdown grace period (spot=True)")
            if self.spot_shutdown_grace_s not in SPOT_SHUTDOWN_GRACE_S:
                raise GKEConfigError(
                    f"spot_shutdown_grace_s: GKE accepts {' or '.join(map(str, SPOT_SHUTDOWN_GRACE_S))}, "
                    f"got {self.spot_shutdown_grace_s}"
                )

    @property
    def tpu(self) -> TPUSlice:
        return TPUSlice(self.machine_type, self.tpu_topology)

    @property
    def pod_grace_s(self) -> int:
        """What a preemption gives the training pods on these nodes (GKELaunch.spot_grace_s for Spot pools)."""
        return (self.spot_shutdown_grace_s or SPOT_SHUTDOWN_GRACE_S[0]) - CRITICAL_PODS_GRACE_S

    @property
    def node_count(self) -> int:
        """Nodes (TPU VMs) of the pool: the hosts of its one slice, or one per single-host slice."""
        tpu = self.tpu
        return tpu.hosts if tpu.multi_host else self.num_slices

    def to_node_pool(self) -> container_v1.NodePool:
        """The ``container_v1.NodePool`` of this spec."""
        tpu = self.tpu
        config = container_v1.NodeConfig(
            machine_type=self.machine_type,
            spot=self.spot,
            labels=dict(self.node_labels),
            oauth_scopes=list(NODE_OAUTH_SCOPES),
        )
        if self.spot_shutdown_grace_s is not None:
            config.kubelet_config = container_v1.NodeKubeletConfig(
                shutdown_grace_period_seconds=self.spot_shutdown_grace_s,
                shutdown_grace_period_critical_pods_seconds=CRITICAL_PODS_GRACE_S,
            )
        if self.reservation:
            config.reservation_affinity = container_v1.ReservationAffinity(
                consume_reservation_type=container_v1.ReservationAffinity.Type.SPECIFIC_RESERVATION,
                key=RESERVATION_KEY,
                values=[self.reservation],
            )
        if self.service_account:
            config.service_account = self.service_account
        if self.workload_identity:
            config.workload_metadata_config = container_v1.WorkloadMetadataConfig(
                mode=container_v1.WorkloadMetadataConfig.Mode.GKE_METADATA
            )
        if self.disk_size_gb is not None:
            config.disk_size_gb = self.disk_size_gb
        if self.disk_type:
            config.disk_type = self.disk_type
        pool = container_v1.NodePool(
            name=self.name,
            config=config,
            initial_node_count=self.node_count,
            locations=list(self.node_locations),
            management=container_v1.NodeManagement(auto_repair=True, auto_upgrade=self.auto_upgrade),
        )
        if self.flex_start:
            # Empty until the pods ask: the autoscaler makes the slice (all of its VMs at once) and removes it.
            pool.config.flex_start = True  # the pool holds a copy of config
            pool.config.reservation_affinity = container_v1.ReservationAffinity(
                consume_reservation_type=container_v1.ReservationAffinity.Type.NO_RESERVATION
            )
            pool.initial_node_count = 0
            pool.autoscaling = container_v1.NodePoolAutoscaling(
                enabled=True,
                total_min_node_count=0,
                total_max_node_count=self.node_count,
                location_policy=container_v1.NodePoolAutoscaling.LocationPolicy.ANY,
            )
            pool.management.auto_repair = False  # a repair would recreate a flex-start VM GKE cannot give back
        if self.queued_provisioning:
            pool.queued_provisioning = container_v1.NodePool.QueuedProvisioning(enabled=True)
        if tpu.multi_host:
            # The topology makes GKE provision the VMs as one ICI-connected slice (compact by construction);
            # GKE takes no placement type or policy name with it.
            pool.placement_policy = container_v1.NodePool.PlacementPolicy(tpu_topology=self.tpu_topology)
        elif self.compact_placement or self.placement_policy:
            placement: dict[str, Any] = {"type_": container_v1.NodePool.PlacementPolicy.Type.COMPACT}
            if self.placement_policy:
                placement["policy_name"] = self.placement_policy
            pool.placement_policy = container_v1.NodePool.PlacementPolicy(**placement)
        if self.additional_networks:
            pool.network_config = container_v1.NodeNetworkConfig(
                additional_node_network_configs=[
                    container_v1.AdditionalNodeNetworkConfig(network=net, subnetwork=sub)
                    for net, sub in self.additional_networks
                ]
            )
        return pool


def operation_error(operation: container_v1.Operation) -> str | None:
    """The error of a finished operation (a DONE operation can still have failed), else None."""
    pb = container_v1.Operation.pb(operation)
    if pb.HasField("error") and pb.error.code != 0:
        return f"{operation.error.message or 'error'} (code {operation.error.code})"
    if operation.status not in (
        container_v1.Operation.Status.DONE,
        container_v1.Operation.Status.RUNNING,
        container_v1.Operation.Status.PENDING,
    ):
        return f"operation {operation.name} is {operation.status.name}: {operation.status_message}"
    return None


# Why a node pool could not be made, in words a person acts on (the API's own message follows).
_CAPACITY_WORDS = (
    (
        re.compile(r"ZONE_RESOURCE_POOL_EXHAUSTED|stockout|no more capacity|not have enough resources", re.I),
        "no TPU capacity left in the zone (a stockout): it may come back; another zone or a reservation avoids it",
    ),
    (re.compile(r"quota", re.I), "over the project's quota: ask for more TPU quota in this region"),
)


def capacity_reason(message: str) -> str:
    """A node pool's failure, with a stockout or a quota named as such."""
    for pattern, words in _CAPACITY_WORDS:
        if pattern.search(message):
            return f"{words} ({message})"
    return message


# A request that may well succeed when sent again.
TRANSIENT_ERRORS = (ServiceUnavailable, DeadlineExceeded, InternalServerError, Aborted, RetryError)


@dataclass
class _Pending:
    """A pool on its way: an operation to watch, else the pool itself (or, ``retry``, a create to send again)."""

    spec: TPUNodePoolSpec
    operation: container_v1.Operation | None = None
    then: str = "up"  # when the operation is done: "up", or "create" (a delete is done: make it again)
    retry: bool = False


@dataclass
class _Provisioning:
    """Where the pools of one :meth:`GKETPUHook.create_tpu_node_pools` call stand."""

    cluster_name: str
    project_id: str
    ready: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    pending: dict[str, _Pending] = field(default_factory=dict)


class GKETPUHook(GKEHook):
    """GKE TPU node pools through the cluster manager client the provider's ``GKEHook`` owns.

    All methods taking ``project_id`` must be called with keyword arguments (the
    provider's convention: ``project_id`` falls back to the connection's project).
    """

    def __init__(
        self,
        gcp_conn_id: str = "google_cloud_default",
        location: str | None = None,
        impersonation_chain: str | Sequence[str] | None = None,
        poll_interval: float = 15.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(gcp_conn_id=gcp_conn_id, location=location, impersonation_chain=impersonation_chain, **kwargs)
        self.poll_interval = poll_interval

    # --- resource names and requests (pure) -------------------------------------------------

    def cluster_path(self, project_id: str, cluster_name: str) -> str:
        if not self.location:
            raise GKEConfigError("location: the cluster's region or zone is required")
        return f"projects/{project_id}/locations/{self.location}/clusters/{cluster_name}"

    def node_pool_path(self, project_id: str, cluster_name: str, node_pool_name: str) -> str:
        return f"{self.cluster_path(project_id, cluster_name)}/nodePools/{node_pool_name}"

    def create_request(
        self, spec: TPUNodePoolSpec, *, project_id: str, cluster_name: str
    ) -> container_v1.CreateNodePoolRequest:
        return container_v1.CreateNodePoolRequest(
            parent=self.cluster_path(project_id, cluster_name), node_pool=spec.to_node_pool()
        )

    def resize_request(
        self, node_pool_name: str, node_count: int, *, project_id: str, cluster_name: str
    ) -> container_v1.SetNodePoolSizeRequest:
        return container_v1.SetNodePoolSizeRequest(
            name=self.node_pool_path(project_id, cluster_name, node_pool_name), node_count=node_count
        )

    def delete_request(
        self, node_pool_name: str, *, project_id: str, cluster_name: str
    ) -> container_v1.DeleteNodePoolRequest:
        return container_v1.DeleteNodePoolRequest(name=self.node_pool_path(project_id, cluster_name, node_pool_name))

    # --- calls --------------------------------------------------------------------------------

    @GoogleBaseHook.fallback_to_default_project_id
    def get_node_pool(
        self, cluster_name: str, node_pool_name: str, project_id: str = PROVIDE_PROJECT_ID
    ) -> container_v1.NodePool:
        request = container_v1.GetNodePoolRequest(name=self.node_pool_path(project_id, cluster_name, node_pool_name))
        return self.get_cluster_manager_client().get_node_pool(request=request)

    @GoogleBaseHook.fallback_to_default_project_id
    def create_tpu_node_pool(
        self,
        cluster_name: str,
        spec: TPUNodePoolSpec,
        project_id: str = PROVIDE_PROJECT_ID,
        wait_to_complete: bool = True,
    ) -> container_v1.Operation | None:
        """Start creating the pool; ``None`` when a pool of that name and shape exists already.

        An existing pool of another machine type or topology is an error (the
        job would run on the wrong shape), and so is one being deleted.
        """
        request = self.create_request(spec, project_id=project_id, cluster_name=cluster_name)
        self.log.info(
            "Creating TPU node pool %s (%s, %s, %d nodes)",
            request.parent + "/nodePools/" + spec.name,
            spec.machine_type,
            spec.tpu_topology,
            spec.node_count,
        )
        try:
            operation = self.get_cluster_manager_client().create_node_pool(request=request)
        except AlreadyExists:
            existing = self.get_node_pool(cluster_name=cluster_name, node_pool_name=spec.name, project_id=project_id)
            check_same_shape(existing, spec)
            if existing.status == container_v1.NodePool.Status.STOPPING:
                raise PoolBeingDeleted(
                    f"node pool {spec.name} exists but is being deleted; retry once it is gone"
                ) from None
            self.log.info("Node pool %s exists already (%s): assuming success", spec.name, existing.status.name)
            return None
        if wait_to_complete:
            operation = self.wait_for_operation(operation, project_id=project_id)
        return operation

    @GoogleBaseHook.fallback_to_default_project_id
    def resize_tpu_node_pool(
        self,
        cluster_name: str,
        node_pool_name: str,
        node_count: int,
        project_id: str = PROVIDE_PROJECT_ID,
        wait_to_complete: bool = True,
    ) -> container_v1.Operation:
        """Set the number of nodes; a multi-host slice pool is all or nothing (0 or its hosts)."""
        if node_count < 0:
            raise GKEConfigError(f"node_count: must be >= 0, got {node_count}")
        pool = self.get_node_pool(cluster_name=cluster_name, node_pool_name=node_pool_name, project_id=project_id)
        topology = pool.placement_policy.tpu_topology
        if topology:
            tpu = TPUSlice(pool.config.machine_type, topology)
            if tpu.multi_host and node_count not in (0, tpu.hosts):
                raise GKEConfigError(
                    f"node_count: {node_pool_name} is one {tpu.hosts}-host {topology} slice; "
                    f"it can have 0 or {tpu.hosts} nodes, not {node_count}"
                )
        request = self.resize_request(node_pool_name, node_count, project_id=project_id, cluster_name=cluster_name)
        self.log.info("Resizing node pool %s to %d nodes", request.name, node_count)
        operation = self.get_cluster_manager_client().set_node_pool_size(request=request)
        if wait_to_complete:
            operation = self.wait_for_operation(operation, project_id=project_id)
        return operation

    @GoogleBaseHook.fallback_to_default_project_id
    def delete_tpu_node_pool(
        self,
        cluster_name: str,
        node_pool_name: str,
        project_id: str = PROVIDE_PROJECT_ID,
        wait_to_complete: bool = True,
    ) -> container_v1.Operation | None:
        """Start deleting the pool; ``None`` when there is no such pool (nothing to tear down)."""
        request = self.delete_request(node_pool_name, project_id=project_id, cluster_name=cluster_name)
        self.log.info("Deleting node pool %s", request.name)
        try:
            operation = self.get_cluster_manager_client().delete_node_pool(request=request)
        except NotFound:
            self.log.info("Node pool %s does not exist: nothing to delete", request.name)
            return None
        if wait_to_complete:
            operation = self.wait_for_operation(operation, project_id=project_id)
        return operation

    def wait_for_operation(
        self, operation: container_v1.Operation, project_id: str = PROVIDE_PROJECT_ID
    ) -> container_v1.Operation:
        """Poll until the operation is done; raise TPUNodePoolError if it failed (also when DONE with an error)."""
        while operation.status in (container_v1.Operation.Status.PENDING, container_v1.Operation.Status.RUNNING):
            time.sleep(self.poll_interval)
            operation = self.get_operation(operation.name, project_id=project_id or self.project_id)
        error = operation_error(operation)
        if error:
            raise TPUNodePoolError(f"operation {operation.name} failed: {error}")
        return operation

    @GoogleBaseHook.fallback_to_default_project_id
    def create_tpu_node_pools(
        self,
        cluster_name: str,
        specs: Sequence[TPUNodePoolSpec],
        need: int,
        project_id: str = PROVIDE_PROJECT_ID,
        timeout_s: float = 3600.0,
    ) -> PoolsUp:
        """Create every pool at once; return as soon as ``need`` of them are up.

        The others go on being created (their hosts join the job when they are up);
        a pool that fails (a stockout, the quota) is named in the log and the
        result. A pool left in ERROR by an earlier try is deleted and created
        again. Fewer than ``need`` up, once nothing is on its way or after
        ``timeout_s``: TPUNodePoolError naming each pool's fate.
        """
        st = _Provisioning(cluster_name, project_id)
        for spec in specs:
            self._start_pool(st, spec)
        deadline = time.monotonic() + timeout_s
        while st.pending and len(st.ready) < need <= len(st.ready) + len(st.pending):
            if time.monotonic() >= deadline:
                break
            time.sleep(self.poll_interval)
            for p in list(st.pending.values()):
                self._advance_pool(st, p)
        ready, failed, pending = st.ready, st.failed, st.pending
        if len(ready) < need:
            fates = [f"{n}: {why}" for n, why in failed.items()] + [f"{n}: still being created" for n in pending]
            raise TPUNodePoolError(
                f"{len(ready)} of the {need} node pools the job needs at least are up "
                f"({', '.join(ready) or 'none'}); " + "; ".join(fates)
            )
        if pending:
            self.log.info(
                "Node pools %s are still being created: their hosts join the job when they are up",
                ", ".join(pending),
            )
        return PoolsUp(ready=ready, creating=list(pending), failed=failed)

    def _start_pool(self, st: _Provisioning, spec: TPUNodePoolSpec) -> None:
        """Send the pool's create request (or find it made, on its way, or in ERROR: delete it first)."""
        try:
            op = self.create_tpu_node_pool(
                cluster_name=st.cluster_name, spec=spec, project_id=st.project_id, wait_to_complete=False
            )
        except (PoolBeingDeleted, *TRANSIENT_ERRORS) as e:
            self.log.warning("Node pool %s: %s; asking again", spec.name, e)
            st.pending[spec.name] = _Pending(spec, retry=True)
            return
        except GoogleAPICallError as e:  # refused: quota, permissions, a bad request
            st.failed[spec.name] = capacity_reason(str(e))
            self.log.warning("Node pool %s was refused: %s", spec.name, st.failed[spec.name])
            return
        if op is not None:
            st.pending[spec.name] = _Pending(spec, op)
            return
        try:
            pool = self.get_node_pool(cluster_name=st.cluster_name, node_pool_name=spec.name, project_id=st.project_id)
            if pool.status == container_v1.NodePool.Status.ERROR:
                self.log.warning(
                    "Node pool %s is in ERROR (%s): deleting it to create it again", spec.name, pool.status_message
                )
                delete = self.delete_tpu_node_pool(
                    cluster_name=st.cluster_name,
                    node_pool_name=spec.name,
                    project_id=st.project_id,
                    wait_to_complete=False,
                )
                st.pending[spec.name] = _Pending(spec, delete, then="create", retry=delete is None)
            else:
                self._pool_seen(st, _Pending(spec), pool)
        except (NotFound, *TRANSIENT_ERRORS) as e:  # gone meanwhile, or a look that failed: ask again
            self.log.warning("Node pool %s: %s; asking again", spec.name, e)
            st.pending[spec.name] = _Pending(spec, retry=True)

    def _pool_seen(self, st: _Provisioning, p: _Pending, pool: container_v1.NodePool) -> None:
        """A pool found made by an earlier try: up when RUNNING, watched while on its way, failed in ERROR."""
        status = container_v1.NodePool.Status
        name = p.spec.name
        st.pending.pop(name, None)
        if pool.status == status.RUNNING:
            st.ready.append(name)
        elif pool.status == status.ERROR:
            st.failed[name] = capacity_reason(pool.status_message or "ERROR")
            self.log.warning("Node pool %s failed: %s", name, st.failed[name])
        elif pool.status == status.STOPPING:
            st.pending[name] = _Pending(p.spec, retry=True)  # create it again once it is gone
        else:  # PROVISIONING, RECONCILING, RUNNING_WITH_ERROR (hosts of the slice missing): watch it
            st.pending[name] = _Pending(p.spec)

    def _advance_pool(self, st: _Provisioning, p: _Pending) -> None:
        """One look at a pool on its way: still going, up, failed, or (gone) to be created again."""
        name = p.spec.name
        if p.retry:
            del st.pending[name]
            self._start_pool(st, p.spec)
            return
        try:
            if p.operation is None:
                pool = self.get_node_pool(cluster_name=st.cluster_name, node_pool_name=name, project_id=st.project_id)
                self._pool_seen(st, p, pool)
                return
            op = self.get_operation(p.operation.name, project_id=st.project_id)
        except NotFound:  # the pool (or its operation) is gone meanwhile: ask for it again
            st.pending[name] = _Pending(p.spec, retry=True)
            return
        except (GoogleAPICallError, RetryError) as e:  # a look that failed: look again at the next poll
            self.log.warning("Looking at node pool %s failed (%s); looking again", name, e)
            return
        if op.status in (container_v1.Operation.Status.PENDING, container_v1.Operation.Status.RUNNING):
            return
        del st.pending[name]
        error = operation_error(op)
        if error:
            st.failed[name] = capacity_reason(error)
            self.log.warning("Node pool %s failed: %s", name, st.failed[name])
        elif p.then == "create":
            self._start_pool(st, p.spec)
        else:
            st.ready.append(name)
            self.log.info("Node pool %s is up", name)

    # --- the cluster's Kubernetes API ----------------------------------------------------------

    @GoogleBaseHook.fallback_to_default_project_id
    def get_kubernetes_hook(
        self,
        cluster_name: str,
        project_id: str = PROVIDE_PROJECT_ID,
        use_internal_ip: bool = False,
        use_dns_endpoint: bool = False,
    ) -> GKEKubernetesHook:
        """A KubernetesHook for the cluster, authenticated with this hook's Google credentials."""
        from airflow.providers.google.cloud.hooks.kubernetes_engine import GKEKubernetesHook

        cluster = self.get_cluster(name=cluster_name, project_id=project_id)
        return GKEKubernetesHook(
            gcp_conn_id=self.gcp_conn_id,
            impersonation_chain=self.impersonation_chain,
            cluster_url=cluster_url(cluster, use_internal_ip=use_internal_ip, use_dns_endpoint=use_dns_endpoint),
            ssl_ca_cert=cluster.master_auth.cluster_ca_certificate,
            use_dns_endpoint=use_dns_endpoint,
        )


def cluster_url(cluster: container_v1.Cluster, *, use_internal_ip: bool, use_dns_endpoint: bool) -> str:
    """The address of a cluster's control plane: its DNS endpoint, its private endpoint or its public one."""
    if use_dns_endpoint:
        return f"https://{cluster.control_plane_endpoints_config.dns_endpoint_config.endpoint}"
    if use_internal_ip:
        return f"https://{cluster.private_cluster_config.private_endpoint}"
    return f"https://{cluster.endpoint}"


def check_same_shape(existing: container_v1.NodePool, spec: TPUNodePoolSpec) -> None:
    """An existing pool counts as the one asked for only if its TPU shape is the same."""
    problems = []
    if existing.config.machine_type != spec.machine_type:
        problems.append(f"machine type {existing.config.machine_type!r}, not {spec.machine_type!r}")
    if spec.tpu.multi_host and existing.placement_policy.tpu_topology != spec.tpu_topology:
        problems.append(f"topology {existing.placement_policy.tpu_topology!r}, not {spec.tpu_topology!r}")
    if existing.config.spot != spec.spot:
        problems.append(f"spot={existing.config.spot}, not {spec.spot}")
    if bool(existing.config.flex_start) != spec.flex_start:
        problems.append(f"flex_start={bool(existing.config.flex_start)}, not {spec.flex_start}")
    if bool(existing.queued_provisioning.enabled) != spec.queued_provisioning:
        problems.append(
            f"queued_provisioning={bool(existing.queued_provisioning.enabled)}, not {spec.queued_provisioning}"
        )
    if problems:
        raise TPUNodePoolError(
            f"node pool {spec.name} exists with {'; '.join(problems)}: delete it or pick another name"
        )


class JobSetHook:
    """The JobSet of a training job, through the provider's KubernetesHook.

    :param kube: a ``KubernetesHook`` (or the GKE one from ``GKETPUHook.get_kubernetes_hook``).
    """

    def __init__(self, kube: KubernetesHook) -> None:
        self.kube = kube

    def create(self, manifests: GKEManifests) -> dict[str, Any]:
        """Create the JobSet and its headless Service; a JobSet of the same name is re-attached to.

        The Service is owned by the JobSet (``ownerReferences``), so deleting the
        JobSet, by us or by anyone, takes the Service with it.  If the JobSet
        controller made its own Service of that name first, that one is used.
        """
        from kubernetes.client.exceptions import ApiException

        try:
            jobset = dict(
                self.kube.create_custom_object(
                    group=JOBSET_GROUP,
                    version=JOBSET_VERSION,
                    plural=JOBSET_PLURAL,
                    body=manifests.jobset,
                    namespace=manifests.namespace,
                )
            )
        except ApiException as e:
            if e.status != 409:
                raise
            existing = self.get(manifests.name, manifests.namespace)
            if existing is None:  # deleted between the two calls
                raise JobSetError(f"JobSet {manifests.name} was deleted while we created it; launch again") from None
            jobset = existing
        service = copy.deepcopy(manifests.service)
        uid = (jobset.get("metadata") or {}).get("uid")
        if uid:
            service["metadata"]["ownerReferences"] = [
                {
                    "apiVersion": JOBSET_API_VERSION,
                    "kind": "JobSet",
                    "name": manifests.name,
                    "uid": uid,
                    "blockOwnerDeletion": True,
                }
            ]
        try:
            self.kube.core_v1_client.create_namespaced_service(namespace=manifests.namespace, body=service)
        except ApiException as e:
            if e.status != 409:
                raise
        return jobset

    def start_job(
        self, cfg: Any, tpu: TPUSlice, launch: GKELaunch, by: str = "Airflow", num_slices: int | None = None
    ) -> JobHandle:
        """Start a job of the run on GKE: take the run for it (lock, config), then create its JobSet.

        The one launch path of the GKE backend and of ``GKEStartTPUJobSetOperator``.
        Refused (``training.api.LaunchRefused``, nothing written) while another job
        holds the run.  The JobSet runs one host agent per pod on up to ``num_slices``
        slices (default: as many as ``max_workers`` allows; missing slices wait Pending).
        """
        import time

        from training import api

        check_config(cfg, tpu)
        api.check_fit(cfg)  # a model that cannot fit at the minimum topology is refused before any TPU is used
        after = api.newest_event_key(cfg.run_uri)
        job = api.begin_job(cfg, backend="gke", by=by)
        manifests = render(cfg, tpu, launch, job, num_slices)
        obj = self.create(manifests)
        return JobHandle(
            backend="gke",
            run_uri=cfg.run_uri,
            job=job,
            attached=False,
            jobset=manifests.name,
            namespace=manifests.namespace,
            num_slices=manifests.num_slices,
            launched_at=time.time(),
            state=jobset_state(obj),
            events_after=after,
        )

    def get(self, name: str, namespace: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return dict(
                self.kube.get_custom_object(
                    group=JOBSET_GROUP, version=JOBSET_VERSION, plural=JOBSET_PLURAL, name=name, namespace=namespace
                )
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def state(self, name: str, namespace: str) -> str:
        """``missing``, ``running``, ``suspended``, ``completed`` or ``failed``."""
        return jobset_state(self.get(name, namespace))

    def waiting(self, name: str, namespace: str) -> str:
        """Why the JobSet's pods that do not run wait (scheduling, the image, ...), in one line; "" when none does."""
        pods = self.kube.core_v1_client.list_namespaced_pod(
            namespace=namespace, label_selector=f"{JOBSET_NAME_LABEL}={name}"
        )
        serialize = self.kube.core_v1_client.api_client.sanitize_for_serialization
        return describe_waiting(pods_waiting([serialize(p) for p in pods.items]))

    def delete(self, name: str, namespace: str) -> bool:
        """Delete the JobSet (its Jobs and pods with it) and its Service; False if neither existed."""
        from kubernetes.client.exceptions import ApiException

        deleted = False
        try:
            self.kube.delete_custom_object(
                group=JOBSET_GROUP,
                version=JOBSET_VERSION,
                plural=JOBSET_PLURAL,
                name=name,
                namespace=namespace,
                propagation_policy="Foreground",
            )
            deleted = True
        except ApiException as e:
            if e.status != 404:
                raise
        try:
            self.kube.core_v1_client.delete_namespaced_service(name=name, namespace=namespace)
            deleted = True
        except ApiException as e:
            if e.status != 404:
                raise
        return deleted

    def capacity(self, tpu: TPUSlice, node_pools: Sequence[str] | None = None) -> GKECapacity:
        """The capacity source over this cluster's nodes."""
        return GKECapacity.from_core_v1(self.kube.core_v1_client, tpu, node_pools)

    def list_nodes(self, node_pool_name: str | None = None, accelerator: str | None = None) -> list[Any]:
        """V1Node objects of a pool (or of a TPU accelerator type), ready or not."""
        selectors = []
        if node_pool_name:
            selectors.append(f"{NODEPOOL_LABEL}={node_pool_name}")
        if accelerator:
            selectors.append(f"{ACCELERATOR_LABEL}={accelerator}")
        return list(self.kube.core_v1_client.list_node(label_selector=",".join(selectors)).items)

    def list_ready_nodes(self, node_pool_name: str) -> list[Any]:
        """The pool's nodes that are Ready, schedulable and not about to go away."""
        return [n for n in self.list_nodes(node_pool_name) if node_is_usable(n)]


class ProviderCluster:
    """The GKE backend's cluster calls through the Google provider's hooks, for one run's ``gke`` settings.

    Satisfies ``training.backends.GKECluster``: node pools through :class:`GKETPUHook`, JobSets through
    :class:`JobSetHook` on the cluster's Kubernetes API, both with the connection ``gke.gcp_conn_id``.
    """

    def __init__(self, gke: GKESettings) -> None:
        self.gke = gke

    def gke_hook(self) -> GKETPUHook:
        return GKETPUHook(
            gcp_conn_id=self.gke.get("gcp_conn_id", "google_cloud_default"), location=self.gke["location"]
        )

    def jobsets(self) -> JobSetHook:
        kube = self.gke_hook().get_kubernetes_hook(
            cluster_name=self.gke["cluster_name"], project_id=self.gke.get("project_id")
        )
        return JobSetHook(kube)

    def pool_specs(self) -> list[TPUNodePoolSpec]:
        """One pool per slice of the settings' TPU shape."""
        return [
            TPUNodePoolSpec(
                name=pool,
                machine_type=self.gke["machine_type"],
                tpu_topology=self.gke["tpu_topology"],
                spot=bool(self.gke.get("spot", False)),
                node_locations=tuple(self.gke.get("node_locations", ())),
                service_account=self.gke.get("node_service_account"),
                flex_start=bool(self.gke.get("flex_start", False)),
                queued_provisioning=bool(self.gke.get("queued_provisioning", False)),
            )
            for pool in self.gke["node_pools"]
        ]

    def create_node_pools(self, need: int, timeout_s: float) -> PoolsUp:
        return self.gke_hook().create_tpu_node_pools(
            cluster_name=self.gke["cluster_name"],
            specs=self.pool_specs(),
            need=need,
            project_id=self.gke.get("project_id"),
            timeout_s=timeout_s,
        )

    def delete_node_pools(self) -> list[str]:
        hook = self.gke_hook()
        for pool in self.gke["node_pools"]:
            hook.delete_tpu_node_pool(
                cluster_name=self.gke["cluster_name"],
                node_pool_name=pool,
                project_id=self.gke.get("project_id"),
                wait_to_complete=True,
            )
        return list(self.gke["node_pools"])
