"""TPU node pools on GKE through ``google-cloud-container``: the requests, and creating them with retries.

:class:`TPUNodePoolSpec` builds the real ``container_v1`` request of one pool; :class:`NodePools`
creates a run's pools at once through a ``ClusterManagerClient`` and is done when enough are up.
Errors the API says are worth sending again (another operation on the cluster, the
concurrent-operations limit, an unavailable service) are retried with backoff; a stockout or the
project's quota is named, with the zone and the shape.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from google.api_core.exceptions import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    GoogleAPICallError,
    InternalServerError,
    NotFound,
    ResourceExhausted,
    RetryError,
    ServiceUnavailable,
)
from google.cloud import container_v1

from training.backends.base import Log, PoolsUp
from training.gke import GKEConfigError, TPUSlice

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
_STOCKOUT_RE = re.compile(
    r"ZONE_RESOURCE_POOL_EXHAUSTED|GCE_STOCKOUT|stockout|no more capacity|not have enough resources", re.I
)
_QUOTA_RE = re.compile(r"quota", re.I)


def capacity_reason(message: str, spec: TPUNodePoolSpec | None = None, location: str = "") -> str:
    """A node pool's final failure, with a stockout (naming the zone and the shape) or the quota said as such."""
    where = ", ".join(spec.node_locations) if spec is not None and spec.node_locations else location
    shape = f"{spec.machine_type} {spec.tpu_topology}" if spec is not None else "this TPU shape"
    if _STOCKOUT_RE.search(message):
        return (
            f"no {shape} capacity left in {where or 'the zone'} (a stockout): it may come back; "
            f"another zone or a reservation avoids it ({message})"
        )
    if _QUOTA_RE.search(message):
        return f"over the project's quota for {shape} in {where or 'the region'}: ask for more TPU quota ({message})"
    return message


# Requests that may well succeed when sent again: the service was unavailable or slow, another operation
# is running on the cluster (FailedPrecondition), or the concurrent-operations limit was hit (a 429,
# ResourceExhausted raised by the call itself: a project quota fails the operation, not the call).
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    ServiceUnavailable,
    DeadlineExceeded,
    InternalServerError,
    Aborted,
    RetryError,
    FailedPrecondition,
    ResourceExhausted,
)


def is_transient(e: BaseException) -> bool:
    """Whether a failed call is worth sending again (a stockout raised by the call is not)."""
    return isinstance(e, TRANSIENT_ERRORS) and not _STOCKOUT_RE.search(str(e))


def transient_reason(e: BaseException) -> str:
    """A transient refusal in words: what the API said, and why it is tried again."""
    if isinstance(e, FailedPrecondition):
        return f"another operation is running on the cluster; trying again ({e})"
    if isinstance(e, ResourceExhausted):
        return f"the cluster's concurrent-operations limit (429); trying again ({e})"
    return f"the request failed for now; trying again ({e})"


@dataclass(frozen=True)
class Backoff:
    """How long to wait before the ``n``-th resend of a refused request: doubling from ``base_s`` up to ``max_s``."""

    base_s: float = 15.0
    max_s: float = 300.0

    def delay(self, n: int) -> float:
        return float(min(self.max_s, self.base_s * 2 ** max(n - 1, 0)))


T = TypeVar("T")


@dataclass
class _Pending:
    """A pool on its way: an operation to watch, else the pool itself (or, ``retry``, a create to send again)."""

    spec: TPUNodePoolSpec
    operation: container_v1.Operation | None = None
    then: str = "up"  # when the operation is done: "up", or "create" (a delete is done: make it again)
    retry: bool = False
    tries: int = 0  # transient refusals so far (the backoff grows with them)
    not_before: float = 0.0  # monotonic time before which a retry is not sent
    why: str = ""  # the last transient refusal


@dataclass
class _Provisioning:
    """Where the pools of one :meth:`NodePools.create_all` call stand."""

    ready: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    pending: dict[str, _Pending] = field(default_factory=dict)


@dataclass(frozen=True)
class PoolRequests:
    """The resource names of one cluster's node pools and the requests about them: built, not sent (pure)."""

    project: str
    location: str
    cluster: str

    @property
    def cluster_path(self) -> str:
        return f"projects/{self.project}/locations/{self.location}/clusters/{self.cluster}"

    def pool_path(self, name: str) -> str:
        return f"{self.cluster_path}/nodePools/{name}"

    def create_request(self, spec: TPUNodePoolSpec) -> container_v1.CreateNodePoolRequest:
        return container_v1.CreateNodePoolRequest(parent=self.cluster_path, node_pool=spec.to_node_pool())

    def resize_request(self, name: str, node_count: int) -> container_v1.SetNodePoolSizeRequest:
        return container_v1.SetNodePoolSizeRequest(name=self.pool_path(name), node_count=node_count)

    def delete_request(self, name: str) -> container_v1.DeleteNodePoolRequest:
        return container_v1.DeleteNodePoolRequest(name=self.pool_path(name))

    def operation_path(self, operation: container_v1.Operation) -> str:
        name = operation.name
        return (
            name
            if name.startswith("projects/")
            else f"projects/{self.project}/locations/{self.location}/operations/{name}"
        )


class NodePools:
    """One cluster's TPU node pools through a ``ClusterManagerClient``: create (all at once), delete, look.

    ``project``, ``location`` and ``cluster`` name the cluster (``requests``: its pools' names and requests);
    ``poll_s`` is how often an operation on its way is looked at; ``backoff`` spaces the resends of a refused
    request.
    """

    def __init__(
        self,
        client: container_v1.ClusterManagerClient,
        project: str,
        location: str,
        cluster: str,
        log: Log | None = None,
        poll_s: float = 15.0,
        backoff: Backoff = Backoff(),
    ) -> None:
        self.client = client
        self.project = project
        self.location = location
        self.cluster = cluster
        self.requests = PoolRequests(project, location, cluster)
        self.log = log
        self.poll_s = poll_s
        self.backoff = backoff
        self.unfinished: _Provisioning | None = None  # the pools still on their way when create_all returned

    def _say(self, msg: str, *args: Any) -> None:
        if self.log is not None:
            self.log.info(msg, *args)

    def _warn(self, msg: str, *args: Any) -> None:
        if self.log is not None:
            self.log.warning(msg, *args)

    # --- calls --------------------------------------------------------------------------------

    def get_cluster(self) -> container_v1.Cluster:
        return self.client.get_cluster(request=container_v1.GetClusterRequest(name=self.requests.cluster_path))

    def get(self, name: str) -> container_v1.NodePool:
        return self.client.get_node_pool(request=container_v1.GetNodePoolRequest(name=self.requests.pool_path(name)))

    def get_operation(self, operation: container_v1.Operation) -> container_v1.Operation:
        request = container_v1.GetOperationRequest(name=self.requests.operation_path(operation))
        return self.client.get_operation(request=request)

    def create(self, spec: TPUNodePoolSpec) -> container_v1.Operation | None:
        """Send the create request; ``None`` when a pool of that name and shape exists already.

        An existing pool of another shape is an error (the job would run on the wrong shape);
        one being deleted is :class:`PoolBeingDeleted`.
        """
        request = self.requests.create_request(spec)
        self._say(
            "Creating TPU node pool %s (%s, %s, %d nodes)",
            self.requests.pool_path(spec.name),
            spec.machine_type,
            spec.tpu_topology,
            spec.node_count,
        )
        try:
            return self.client.create_node_pool(request=request)
        except AlreadyExists:
            existing = self.get(spec.name)
            check_same_shape(existing, spec)
            if existing.status == container_v1.NodePool.Status.STOPPING:
                raise PoolBeingDeleted(f"node pool {spec.name} exists but is being deleted") from None
            self._say("Node pool %s exists already (%s): assuming success", spec.name, existing.status.name)
            return None

    def delete(self, name: str) -> container_v1.Operation | None:
        """Send the delete request; ``None`` when there is no such pool (nothing to tear down)."""
        self._say("Deleting node pool %s", self.requests.pool_path(name))
        try:
            return self.client.delete_node_pool(request=self.requests.delete_request(name))
        except NotFound:
            self._say("Node pool %s does not exist: nothing to delete", name)
            return None

    def resize(self, name: str, node_count: int) -> container_v1.Operation:
        """Set the number of nodes; a multi-host slice pool is all or nothing (0 or its hosts)."""
        if node_count < 0:
            raise GKEConfigError(f"node_count: must be >= 0, got {node_count}")
        pool = self.get(name)
        topology = pool.placement_policy.tpu_topology
        if topology:
            tpu = TPUSlice(pool.config.machine_type, topology)
            if tpu.multi_host and node_count not in (0, tpu.hosts):
                raise GKEConfigError(
                    f"node_count: {name} is one {tpu.hosts}-host {topology} slice; "
                    f"it can have 0 or {tpu.hosts} nodes, not {node_count}"
                )
        return self.client.set_node_pool_size(request=self.requests.resize_request(name, node_count))

    def retrying(self, what: str, call: Callable[[], T], deadline: float) -> T:
        """``call()``, sent again with backoff while it fails for now (until the monotonic ``deadline``)."""
        tries = 0
        while True:
            try:
                return call()
            except GoogleAPICallError as e:
                tries += 1
                wait = self.backoff.delay(tries)
                if not is_transient(e) or time.monotonic() + wait > deadline:
                    raise
                self._warn("%s: %s; again in %.0fs", what, transient_reason(e), wait)
                time.sleep(wait)

    def wait(self, operation: container_v1.Operation, deadline: float) -> container_v1.Operation:
        """Poll until the operation is done; TPUNodePoolError if it failed (also when DONE with an error)."""
        status = container_v1.Operation.Status
        while operation.status in (status.PENDING, status.RUNNING):
            if time.monotonic() >= deadline:
                raise TPUNodePoolError(f"operation {operation.name} is still {operation.status.name}")
            time.sleep(self.poll_s)
            operation = self.retrying("Looking at " + operation.name, partial(self.get_operation, operation), deadline)
        error = operation_error(operation)
        if error:
            raise TPUNodePoolError(f"operation {operation.name} failed: {error}")
        return operation

    def delete_all(self, names: Sequence[str], timeout_s: float = 3600.0) -> list[str]:
        """Delete the pools (each waited for; refusals for now sent again); the names deleted or already gone."""
        deadline = time.monotonic() + timeout_s
        for name in names:
            op = self.retrying(f"Deleting node pool {name}", partial(self.delete, name), deadline)
            if op is not None:
                self.wait(op, deadline)
        return list(names)

    def create_all(self, specs: Sequence[TPUNodePoolSpec], need: int, timeout_s: float = 3600.0) -> PoolsUp:
        """Create every pool at once; return as soon as ``need`` of them are up.

        The others go on being created (their hosts join the job when they are up). A request
        refused for now is sent again with backoff; a pool that fails for good (a stockout, the
        quota) is named in the log and the result; one left in ERROR by an earlier try is deleted
        and created again. Fewer than ``need`` up, once nothing is on its way or after
        ``timeout_s``: TPUNodePoolError naming each pool's fate.
        """
        st = _Provisioning()
        for spec in specs:
            self._start(st, _Pending(spec))
        deadline = time.monotonic() + timeout_s
        while st.pending and len(st.ready) < need <= len(st.ready) + len(st.pending):
            if time.monotonic() >= deadline:
                break
            time.sleep(self.poll_s)
            for p in list(st.pending.values()):
                self._advance(st, p)
        if len(st.ready) < need:
            fates = [f"{n}: {why}" for n, why in st.failed.items()] + [
                f"{n}: {p.why or 'still being created'}" for n, p in st.pending.items()
            ]
            raise TPUNodePoolError(
                f"{len(st.ready)} of the {need} node pools the job needs at least are up "
                f"({', '.join(st.ready) or 'none'}); " + "; ".join(fates)
            )
        if st.pending:
            self._say(
                "Node pools %s are still on their way (each look at the job sees to them): their hosts join "
                "the job when they are up",
                ", ".join(st.pending),
            )
        self.unfinished = st
        return where(st)

    def _again(self, st: _Provisioning, p: _Pending, e: BaseException) -> None:
        """A request refused for now: send it again after the backoff."""
        tries = p.tries + 1
        why = transient_reason(e) if isinstance(e, GoogleAPICallError) else f"{e}; trying again"
        self._warn("Node pool %s: %s", p.spec.name, why)
        st.pending[p.spec.name] = _Pending(
            p.spec, retry=True, tries=tries, not_before=time.monotonic() + self.backoff.delay(tries), why=why
        )

    def _start(self, st: _Provisioning, p: _Pending) -> None:
        """Send the pool's create request (or find it made, on its way, or in ERROR: delete it first)."""
        spec = p.spec
        try:
            op = self.create(spec)
        except PoolBeingDeleted as e:
            self._again(st, p, e)
            return
        except GoogleAPICallError as e:
            if is_transient(e):
                self._again(st, p, e)
            else:  # refused for good: permissions, a bad request, a stockout
                st.failed[spec.name] = capacity_reason(str(e), spec, self.location)
                self._warn("Node pool %s was refused: %s", spec.name, st.failed[spec.name])
            return
        if op is not None:
            st.pending[spec.name] = _Pending(spec, op)
            return
        try:
            pool = self.get(spec.name)
        except GoogleAPICallError as e:  # gone meanwhile, or a look that failed: ask again
            self._again(st, p, e)
            return
        if pool.status == container_v1.NodePool.Status.ERROR:
            self._warn("Node pool %s is in ERROR (%s): deleting it to create it again", spec.name, pool.status_message)
            try:
                delete = self.delete(spec.name)
            except GoogleAPICallError as e:
                self._again(st, p, e)
                return
            st.pending[spec.name] = _Pending(spec, delete, then="create", retry=delete is None)
        else:
            self._seen(st, _Pending(spec), pool)

    def _seen(self, st: _Provisioning, p: _Pending, pool: container_v1.NodePool) -> None:
        """A pool found made by an earlier try: up when RUNNING, watched while on its way, failed in ERROR."""
        status = container_v1.NodePool.Status
        name = p.spec.name
        st.pending.pop(name, None)
        if pool.status == status.RUNNING:
            st.ready.append(name)
        elif pool.status == status.ERROR:
            st.failed[name] = capacity_reason(pool.status_message or "ERROR", p.spec, self.location)
            self._warn("Node pool %s failed: %s", name, st.failed[name])
        elif pool.status == status.STOPPING:
            st.pending[name] = _Pending(p.spec, retry=True)  # create it again once it is gone
        else:  # PROVISIONING, RECONCILING, RUNNING_WITH_ERROR (hosts of the slice missing): watch it
            st.pending[name] = _Pending(p.spec)

    def _advance(self, st: _Provisioning, p: _Pending) -> None:
        """One look at a pool on its way: still going, up, failed, or (gone) to be created again."""
        name = p.spec.name
        if p.retry:
            if time.monotonic() < p.not_before:
                return
            del st.pending[name]
            self._start(st, p)
            return
        try:
            if p.operation is None:
                self._seen(st, p, self.get(name))
                return
            op = self.get_operation(p.operation)
        except NotFound:  # the pool (or its operation) is gone meanwhile: ask for it again
            st.pending[name] = _Pending(p.spec, retry=True)
            return
        except (GoogleAPICallError, RetryError) as e:  # a look that failed: look again at the next poll
            self._warn("Looking at node pool %s failed (%s); looking again", name, e)
            return
        if op.status in (container_v1.Operation.Status.PENDING, container_v1.Operation.Status.RUNNING):
            return
        del st.pending[name]
        error = operation_error(op)
        if error:
            st.failed[name] = capacity_reason(error, p.spec, self.location)
            self._warn("Node pool %s failed: %s", name, st.failed[name])
        elif p.then == "create":
            self._start(st, _Pending(p.spec))
        else:
            st.ready.append(name)
            self._say("Node pool %s is up", name)


def where(st: _Provisioning) -> PoolsUp:
    """Where the pools stand: up, being created (a create accepted), refused for now and sent again, failed."""
    again = [n for n, p in st.pending.items() if p.retry]
    creating = [n for n in st.pending if n not in again]
    return PoolsUp(ready=list(st.ready), creating=creating, failed=dict(st.failed), retrying=again)


def see_to(pools: NodePools, specs: Sequence[TPUNodePoolSpec]) -> PoolsUp:
    """One look, without waiting, at the pools still on their way after ``create_all``; where they stand.

    A create refused for now is sent again once its backoff is over, a pool being deleted is made
    again once gone.  In a process that did not create them (Airflow's trigger), the first look
    finds each pool: a missing one is created, one on its way watched; one in ERROR is left failed.
    """
    st = pools.unfinished
    if st is None:
        st = pools.unfinished = _Provisioning()
        for spec in specs:
            try:
                pool = pools.get(spec.name)
            except NotFound:
                pools._start(st, _Pending(spec))
                continue
            pools._seen(st, _Pending(spec), pool)
        return where(st)
    for p in list(st.pending.values()):
        pools._advance(st, p)
    return where(st)


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
