"""Operators for TPU node pools on GKE and the JobSet of a training job.

Thin: the hooks own the clients
(``rtrain_airflow.hooks.gke_tpu``), the long waits are a deferrable trigger
(``rtrain_airflow.triggers.gke_tpu``), and every operator checks its inputs
before it calls anything, with errors that name the parameter.  A DAG reads as
setup (create pools), body (launch and watch the job), teardown (delete the
JobSet, delete the pools, both ``ALL_DONE``).

Inputs that are Jinja templates are checked when rendered (in ``execute``);
plain values already when the DAG is parsed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.configuration import conf
from airflow.providers.common.compat.sdk import AirflowException
from airflow.providers.google.cloud.operators.cloud_base import GoogleCloudBaseOperator
from airflow.sdk import TriggerRule

from rtrain_airflow.hooks.gke_tpu import GKETPUHook, JobSetHook, TPUNodePoolSpec
from rtrain_airflow.triggers.gke_tpu import GKETPUNodePoolOperationTrigger

if TYPE_CHECKING:
    from airflow.sdk import Context
    from google.cloud.container_v1 import Operation

    from training.api import Config


def _templated(*values: Any) -> bool:
    """Whether any value still holds a Jinja template (so it can only be checked once rendered)."""
    for v in values:
        if isinstance(v, str) and ("{{" in v or "{%" in v):
            return True
        if isinstance(v, Mapping) and _templated(*v.keys(), *v.values()):
            return True
        if isinstance(v, (list, tuple)) and _templated(*v):
            return True
    return False


def _networks(value: Iterable[Any]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in value or ():
        if isinstance(item, Mapping):
            if set(item) != {"network", "subnetwork"}:
                raise ValueError(
                    f"additional_networks: each item needs exactly 'network' and 'subnetwork', got {dict(item)}"
                )
            out.append((str(item["network"]), str(item["subnetwork"])))
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            out.append((str(item[0]), str(item[1])))
        else:
            raise ValueError(f"additional_networks: {item!r} is not {{'network': ..., 'subnetwork': ...}}")
    return tuple(out)


class _GKETPUNodePoolBaseOperator(GoogleCloudBaseOperator):
    """What the node pool operators share: the cluster, the hook, the deferral."""

    template_fields: Sequence[str] = (
        "project_id",
        "location",
        "cluster_name",
        "node_pool_name",
        "gcp_conn_id",
        "impersonation_chain",
    )

    def __init__(
        self,
        *,
        location: str,
        cluster_name: str,
        node_pool_name: str,
        project_id: str | None = None,
        gcp_conn_id: str = "google_cloud_default",
        impersonation_chain: str | Sequence[str] | None = None,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        poll_interval: float = 15.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.project_id = project_id
        self.location = location
        self.cluster_name = cluster_name
        self.node_pool_name = node_pool_name
        self.gcp_conn_id = gcp_conn_id
        self.impersonation_chain = impersonation_chain
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        for key in ("location", "cluster_name", "node_pool_name"):
            if not getattr(self, key):
                raise ValueError(f"{key}: required")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval: must be > 0, got {poll_interval}")

    @cached_property
    def hook(self) -> GKETPUHook:
        return GKETPUHook(
            gcp_conn_id=self.gcp_conn_id,
            location=self.location,
            impersonation_chain=self.impersonation_chain,
            poll_interval=self.poll_interval,
        )

    def _defer(self, operation: Operation, method_name: str) -> None:
        self.defer(
            trigger=GKETPUNodePoolOperationTrigger(
                operation_name=operation.name,
                project_id=self.project_id or self.hook.project_id,
                location=self.location,
                node_pool_name=self.node_pool_name,
                gcp_conn_id=self.gcp_conn_id,
                impersonation_chain=self.impersonation_chain,
                poll_interval=self.poll_interval,
            ),
            method_name=method_name,
        )

    @staticmethod
    def _check_event(event: Mapping[str, Any]) -> None:
        if event.get("status") != "success":
            raise AirflowException(event.get("message") or f"operation failed: {event}")


class GKECreateTPUNodePoolOperator(_GKETPUNodePoolBaseOperator):
    """Create a TPU node pool in a GKE Standard cluster; an existing pool of the same shape is success.

    A multi-host shape (e.g. ``ct6e-standard-4t`` ``4x4``: 4 hosts) makes a pool
    that is exactly one slice: create one pool per slice (``.partial(...).expand(node_pool_name=[...])``).
    A single-host shape (``ct6e-standard-4t`` ``2x2``) makes ``num_slices`` VMs.

    A pool left in ``ERROR`` by an earlier try (e.g. a stockout) is deleted and
    created again once when ``recreate_failed_pool`` is set.

    Returns (XCom) ``node_pool``, ``cluster``, ``machine_type``, ``tpu_topology``,
    ``hosts_per_slice``, ``chips_per_host``, ``node_count``, ``spot``, ``created``.

    :param machine_type: a TPU machine type (``training.gke.manifests.TPU_MACHINE_TYPES``).
    :param tpu_topology: e.g. ``4x4`` (v5e/v6e), ``2x2x2`` (v4/v5p).
    :param spot: Spot VMs. Mutually exclusive with ``reservation``.
    :param reservation: a specific reservation to consume (``NAME`` or ``projects/P/reservations/NAME``).
    :param placement_policy: single-host shapes: a compact resource policy name (a multi-host slice is
        placed by its ``tpu_topology``, which GKE does not take together with a policy).
    :param compact_placement: single-host shapes: ``COMPACT`` placement (a multi-host slice is compact already).
    :param auto_upgrade: GKE node auto-upgrade (``False`` only on a cluster outside release channels;
        elsewhere keep upgrades off the pools with a maintenance exclusion, docs/gke.md §4).
    :param spot_shutdown_grace_s: Spot only: the nodes' shutdown grace, 30 or 120 (the pods get it less 15 s).
    :param flex_start: flex-start VMs: the pool is created empty and scales to its slice for the job's pods.
    :param queued_provisioning: with ``flex_start``: the slice comes all at once for a ProvisioningRequest.
    :param additional_networks: extra node networks, ``[{"network": ..., "subnetwork": ...}]``.
    :param node_locations: the zone(s) of the pool (TPUs are zonal).
    :param node_service_account: the nodes' Google service account (least privilege: see docs/gke.md).
    :param deferrable: wait for the operation in the triggerer.
    """

    template_fields: Sequence[str] = (
        *_GKETPUNodePoolBaseOperator.template_fields,
        "machine_type",
        "tpu_topology",
        "num_slices",
        "reservation",
        "placement_policy",
        "node_locations",
        "node_service_account",
        "node_labels",
    )

    def __init__(
        self,
        *,
        machine_type: str,
        tpu_topology: str,
        num_slices: int | str = 1,
        spot: bool = False,
        reservation: str | None = None,
        placement_policy: str | None = None,
        compact_placement: bool = False,
        additional_networks: Sequence[Mapping[str, str] | Sequence[str]] = (),
        node_locations: Sequence[str] = (),
        node_service_account: str | None = None,
        node_labels: Mapping[str, str] | None = None,
        disk_size_gb: int | None = None,
        disk_type: str | None = None,
        auto_upgrade: bool = True,
        spot_shutdown_grace_s: int | None = None,
        flex_start: bool = False,
        queued_provisioning: bool = False,
        recreate_failed_pool: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.machine_type = machine_type
        self.tpu_topology = tpu_topology
        self.num_slices = num_slices
        self.spot = spot
        self.reservation = reservation
        self.placement_policy = placement_policy
        self.compact_placement = compact_placement
        self.additional_networks = additional_networks
        self.node_locations = node_locations
        self.node_service_account = node_service_account
        self.node_labels = dict(node_labels or {})
        self.disk_size_gb = disk_size_gb
        self.disk_type = disk_type
        self.auto_upgrade = auto_upgrade
        self.spot_shutdown_grace_s = spot_shutdown_grace_s
        self.flex_start = flex_start
        self.queued_provisioning = queued_provisioning
        self.recreate_failed_pool = recreate_failed_pool
        if not _templated(*(getattr(self, f) for f in self.template_fields)):
            self.spec()  # refuse a bad shape when the DAG is parsed

    def spec(self) -> TPUNodePoolSpec:
        try:
            num_slices = int(self.num_slices)
        except (TypeError, ValueError):
            raise ValueError(f"num_slices: an integer, got {self.num_slices!r}") from None
        return TPUNodePoolSpec(
            name=self.node_pool_name,
            machine_type=self.machine_type,
            tpu_topology=self.tpu_topology,
            num_slices=num_slices,
            spot=self.spot,
            reservation=self.reservation or None,
            placement_policy=self.placement_policy or None,
            compact_placement=self.compact_placement,
            additional_networks=_networks(self.additional_networks),
            node_locations=tuple(self.node_locations or ()),
            service_account=self.node_service_account or None,
            node_labels=self.node_labels,
            disk_size_gb=self.disk_size_gb,
            disk_type=self.disk_type,
            auto_upgrade=self.auto_upgrade,
            spot_shutdown_grace_s=self.spot_shutdown_grace_s,
            flex_start=self.flex_start,
            queued_provisioning=self.queued_provisioning,
        )

    def _result(self, spec: TPUNodePoolSpec, created: bool) -> dict[str, Any]:
        tpu = spec.tpu
        return {
            "node_pool": spec.name,
            "cluster": self.cluster_name,
            "machine_type": spec.machine_type,
            "tpu_topology": spec.tpu_topology,
            "hosts_per_slice": tpu.hosts,
            "chips_per_host": tpu.chips_per_host,
            "node_count": spec.node_count,
            "spot": spec.spot,
            "created": created,
        }

    def execute(self, context: Context) -> dict[str, Any]:
        return self._create(recreated=False)

    def _create(self, recreated: bool) -> dict[str, Any]:
        from google.cloud.container_v1 import NodePool

        spec = self.spec()
        operation = self.hook.create_tpu_node_pool(
            cluster_name=self.cluster_name, spec=spec, project_id=self.project_id, wait_to_complete=not self.deferrable
        )
        if operation is None:  # it exists, with this shape
            pool = self.hook.get_node_pool(
                cluster_name=self.cluster_name, node_pool_name=spec.name, project_id=self.project_id
            )
            if pool.status == NodePool.Status.ERROR:
                if not self.recreate_failed_pool or recreated:
                    raise AirflowException(
                        f"node pool {spec.name} exists in state ERROR ({pool.status_message}); delete it and retry"
                    )
                self.log.warning(
                    "Node pool %s is in ERROR (%s): deleting it to create it again", spec.name, pool.status_message
                )
                delete = self.hook.delete_tpu_node_pool(
                    cluster_name=self.cluster_name,
                    node_pool_name=spec.name,
                    project_id=self.project_id,
                    wait_to_complete=not self.deferrable,
                )
                if delete is not None and self.deferrable:
                    self._defer(delete, "recreate_after_delete")
                return self._create(recreated=True)
            return self._result(spec, created=False)
        if self.deferrable:
            self._defer(operation, "execute_complete")
        return self._result(spec, created=True)

    def recreate_after_delete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        self._check_event(event)
        return self._create(recreated=True)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        self._check_event(event)
        self.log.info(event.get("message"))
        return self._result(self.spec(), created=True)


class GKEResizeTPUNodePoolOperator(_GKETPUNodePoolBaseOperator):
    """Set the number of nodes of a TPU node pool.

    A multi-host slice pool is all or nothing: 0 (release the slice) or its hosts
    (take it back).  For a single-host pool, each node is one slice.
    """

    template_fields: Sequence[str] = (*_GKETPUNodePoolBaseOperator.template_fields, "node_count")

    def __init__(self, *, node_count: int | str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.node_count = node_count
        if not _templated(node_count):
            self._count()

    def _count(self) -> int:
        try:
            count = int(self.node_count)
        except (TypeError, ValueError):
            raise ValueError(f"node_count: an integer, got {self.node_count!r}") from None
        if count < 0:
            raise ValueError(f"node_count: must be >= 0, got {count}")
        return count

    def execute(self, context: Context) -> dict[str, Any]:
        count = self._count()
        operation = self.hook.resize_tpu_node_pool(
            cluster_name=self.cluster_name,
            node_pool_name=self.node_pool_name,
            node_count=count,
            project_id=self.project_id,
            wait_to_complete=not self.deferrable,
        )
        if self.deferrable:
            self._defer(operation, "execute_complete")
        return {"node_pool": self.node_pool_name, "node_count": count}

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        self._check_event(event)
        return {"node_pool": self.node_pool_name, "node_count": self._count()}


class GKEDeleteTPUNodePoolOperator(_GKETPUNodePoolBaseOperator):
    """Delete a TPU node pool: the teardown of a training DAG. A missing pool is success.

    ``trigger_rule`` is ``ALL_DONE`` by default, and stays so under
    ``as_teardown()``: a create that *failed* can still leave a pool (in ERROR,
    or half provisioned) that holds quota and costs money, so the delete must run
    whatever happened upstream (Airflow's ``ALL_DONE_SETUP_SUCCESS`` would skip
    it exactly then).
    """

    def __init__(self, *, trigger_rule: str = TriggerRule.ALL_DONE, **kwargs: Any) -> None:
        super().__init__(trigger_rule=trigger_rule, **kwargs)

    def as_teardown(
        self, *, setups: Any = None, on_failure_fail_dagrun: bool | None = None
    ) -> GKEDeleteTPUNodePoolOperator:
        super().as_teardown(setups=setups, on_failure_fail_dagrun=on_failure_fail_dagrun)
        self.trigger_rule = TriggerRule.ALL_DONE
        return self

    def execute(self, context: Context) -> dict[str, Any]:
        operation = self.hook.delete_tpu_node_pool(
            cluster_name=self.cluster_name,
            node_pool_name=self.node_pool_name,
            project_id=self.project_id,
            wait_to_complete=not self.deferrable,
        )
        if operation is not None and self.deferrable:
            self._defer(operation, "execute_complete")
        return {"node_pool": self.node_pool_name, "deleted": operation is not None}

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        self._check_event(event)
        return {"node_pool": self.node_pool_name, "deleted": True}


# --- the JobSet of a training job ----------------------------------------------------------


class _GKEJobSetBaseOperator(GoogleCloudBaseOperator):
    """The cluster's Kubernetes API: through a ``kubernetes_conn_id``, or the GKE cluster's endpoint."""

    template_fields: Sequence[str] = ("project_id", "location", "cluster_name", "namespace", "gcp_conn_id")

    def __init__(
        self,
        *,
        location: str | None = None,
        cluster_name: str | None = None,
        project_id: str | None = None,
        namespace: str = "default",
        kubernetes_conn_id: str | None = None,
        use_internal_ip: bool = False,
        use_dns_endpoint: bool = False,
        gcp_conn_id: str = "google_cloud_default",
        impersonation_chain: str | Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.location = location
        self.cluster_name = cluster_name
        self.project_id = project_id
        self.namespace = namespace
        self.kubernetes_conn_id = kubernetes_conn_id
        self.use_internal_ip = use_internal_ip
        self.use_dns_endpoint = use_dns_endpoint
        self.gcp_conn_id = gcp_conn_id
        self.impersonation_chain = impersonation_chain
        if not kubernetes_conn_id and not (location and cluster_name):
            raise ValueError("location/cluster_name: give the GKE cluster (or a kubernetes_conn_id)")

    @cached_property
    def jobset_hook(self) -> JobSetHook:
        if self.kubernetes_conn_id:
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

            return JobSetHook(KubernetesHook(conn_id=self.kubernetes_conn_id))
        gke = GKETPUHook(
            gcp_conn_id=self.gcp_conn_id, location=self.location, impersonation_chain=self.impersonation_chain
        )
        return JobSetHook(
            gke.get_kubernetes_hook(
                cluster_name=self.cluster_name,
                project_id=self.project_id,
                use_internal_ip=self.use_internal_ip,
                use_dns_endpoint=self.use_dns_endpoint,
            )
        )


class GKEStartTPUJobSetOperator(_GKEJobSetBaseOperator):
    """Start a training job on TPU slices: take the run for it, then create its JobSet (one host agent per pod).

    The same launch path as the pipeline's GKE backend (``JobSetHook.start_job``):
    the run lock is taken and ``config.json`` written only then (a run held by
    another job is refused and nothing is written), the Service and JobSet are
    rendered from the run config (``training.gke.render``) and created.

    :param config: the run config as ``key: value`` overrides over ``configs/base.yml`` and the preset
        it names (``backend: gke``, a gs:// ``root``); checked when the DAG is parsed.
        ``hosts_per_slice`` is taken from the TPU shape when not given.
    :param machine_type: TPU machine type of the slices.
    :param tpu_topology: topology of one slice.
    :param image: the training image (docker/Dockerfile.train).
    :param num_slices: slices to ask for; ``None``: as many as ``max_workers`` allows (missing ones wait Pending).
    :param service_account: the Kubernetes service account of the agents (Workload Identity).
    :param node_pools: restrict the agents to these node pools.
    :param host_network: pods on the host network; needs ``identity="node"`` (no Workload Identity there).
    :param identity: how the pods reach gs://: ``workload-identity`` (their Kubernetes service account) or
        ``node`` (the node pool's service account).
    :param termination_grace_period_s: the pods' grace; ``None``: what a preemption gives (Spot: ``spot_grace_s``).
    :param spot_grace_s: what a Spot preemption gives a pod (15 s; 105 s on pools with ``spot_shutdown_grace_s=120``).
    :param gcs_fuse: mount the dataset's bucket with GCS FUSE; the workers read its shards there.

    Returns the job handle: ``job``, ``jobset``, ``namespace``, ``num_slices``, ``run_uri``, ``state``, ...
    """

    template_fields: Sequence[str] = (
        *_GKEJobSetBaseOperator.template_fields,
        "config",
        "machine_type",
        "tpu_topology",
        "image",
        "num_slices",
        "service_account",
        "node_pools",
    )
    template_fields_renderers = {"config": "json"}

    def __init__(
        self,
        *,
        config: Mapping[str, Any],
        machine_type: str,
        tpu_topology: str,
        image: str,
        num_slices: int | str | None = None,
        service_account: str = "rtrain-worker",
        node_pools: Sequence[str] = (),
        spot: bool = False,
        host_network: bool = False,
        cpu: str | None = None,
        memory: str | None = None,
        env: Mapping[str, str] | None = None,
        identity: str = "workload-identity",
        termination_grace_period_s: int | None = None,
        spot_grace_s: int = 15,
        gcs_fuse: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.config = dict(config)
        self.machine_type = machine_type
        self.tpu_topology = tpu_topology
        self.image = image
        self.num_slices = num_slices
        self.service_account = service_account
        self.node_pools = list(node_pools)
        self.spot = spot
        self.host_network = host_network
        self.cpu = cpu
        self.memory = memory
        self.env = dict(env or {})
        self.identity = identity
        self.termination_grace_period_s = termination_grace_period_s
        self.spot_grace_s = spot_grace_s
        self.gcs_fuse = gcs_fuse
        static = ("config", "machine_type", "tpu_topology", "image", "namespace", "service_account", "node_pools")
        if not _templated(*(getattr(self, f) for f in static)):
            self._static_inputs()  # refuse a config that cannot run on the shape when the DAG is parsed
        if not _templated(num_slices):
            self._num_slices()

    def _static_inputs(self) -> tuple[Config, Any, Any]:
        from training.api import load_config
        from training.gke import GKELaunch, TPUSlice, check_config

        tpu = TPUSlice(self.machine_type, self.tpu_topology)
        cfg = load_config(overrides={"hosts_per_slice": tpu.hosts, **self.config})  # base, preset, these keys
        check_config(cfg, tpu)
        launch = GKELaunch(
            image=self.image,
            namespace=self.namespace,
            service_account=self.service_account,
            node_pools=tuple(self.node_pools),
            spot=self.spot,
            host_network=self.host_network,
            cpu=self.cpu,
            memory=self.memory,
            env=self.env,
            identity=self.identity,
            termination_grace_period_s=self.termination_grace_period_s,
            spot_grace_s=self.spot_grace_s,
            gcs_fuse=self.gcs_fuse,
        )
        return cfg, tpu, launch

    def _num_slices(self) -> int | None:
        try:
            num_slices = None if self.num_slices in (None, "", "None") else int(self.num_slices)
        except (TypeError, ValueError):
            raise ValueError(f"num_slices: an integer, got {self.num_slices!r}") from None
        if num_slices is not None and num_slices < 1:
            raise ValueError(f"num_slices: at least 1, got {num_slices}")
        return num_slices

    def execute(self, context: Context) -> dict[str, Any]:
        from training.api import LaunchError

        cfg, tpu, launch = self._static_inputs()
        try:
            handle = self.jobset_hook.start_job(cfg, tpu, launch, by=f"{self.task_id}", num_slices=self._num_slices())
        except LaunchError as e:
            raise AirflowException(str(e)) from None
        self.log.info(
            "Job %s: JobSet %s/%s (%s)", handle["job"], handle["namespace"], handle["jobset"], handle["state"]
        )
        return dict(handle)


class GKEDeleteTPUJobSetOperator(_GKEJobSetBaseOperator):
    """Delete a training JobSet and its headless Service (teardown; ``ALL_DONE``; a missing one is success)."""

    template_fields: Sequence[str] = (*_GKEJobSetBaseOperator.template_fields, "jobset_name")

    def __init__(self, *, jobset_name: str, trigger_rule: str = TriggerRule.ALL_DONE, **kwargs: Any) -> None:
        super().__init__(trigger_rule=trigger_rule, **kwargs)
        self.jobset_name = jobset_name
        if not jobset_name:
            raise ValueError("jobset_name: required")

    def as_teardown(
        self, *, setups: Any = None, on_failure_fail_dagrun: bool | None = None
    ) -> GKEDeleteTPUJobSetOperator:
        super().as_teardown(setups=setups, on_failure_fail_dagrun=on_failure_fail_dagrun)
        self.trigger_rule = TriggerRule.ALL_DONE
        return self

    def execute(self, context: Context) -> dict[str, Any]:
        deleted = self.jobset_hook.delete(self.jobset_name, self.namespace)
        return {"jobset": self.jobset_name, "namespace": self.namespace, "deleted": deleted}
