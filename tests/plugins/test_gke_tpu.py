"""The Google Cloud production path, from the Airflow side: TPU node pools, the operation trigger, JobSets.

GKE cannot be reached from here, so:

* the requests the hook builds are real ``google.cloud.container_v1`` types,
  checked field by field (and as the JSON that goes on the wire) for each TPU
  machine type and topology;
* the hook's and operators' create / resize / delete logic runs against a small
  in-memory fake of the ``ClusterManagerClient`` methods it calls, which takes
  the real request types, answers with real ``Operation`` / ``NodePool``
  objects and raises the real ``google.api_core`` exceptions;
* the JobSet hook talks, through the provider's real ``KubernetesHook`` and
  the real kubernetes client, to a small fake Kubernetes API server on
  127.0.0.1.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import kubernetes_validate
import pytest
import yaml
from airflow.sdk import DAG, TriggerRule
from airflow.sdk.exceptions import TaskDeferred
from google.api_core.exceptions import AlreadyExists, NotFound, ResourceExhausted, ServiceUnavailable
from google.cloud import container_v1
from rtrain_airflow.hooks.gke_tpu import (
    GKETPUHook,
    JobSetHook,
    ProviderCluster,
    TPUNodePoolError,
    TPUNodePoolSpec,
)
from rtrain_airflow.operators.gke_tpu import (
    GKECreateTPUNodePoolOperator,
    GKEDeleteTPUJobSetOperator,
    GKEDeleteTPUNodePoolOperator,
    GKEResizeTPUNodePoolOperator,
    GKEStartTPUJobSetOperator,
)
from rtrain_airflow.triggers.gke_tpu import GKETPUNodePoolOperationTrigger

from training.api import load_config
from training.backends import BackendError, GKEBackend
from training.gke import GKEConfigError, GKELaunch, TPUSlice, render

REPO = Path(__file__).resolve().parents[2]
PROJECT = "rtrain-prod"
LOCATION = "us-east5"
CLUSTER = "train"
CONN_ID = "rtrain_test_gcp"
Status = container_v1.Operation.Status
PoolStatus = container_v1.NodePool.Status


@pytest.fixture(autouse=True)
def gcp_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Google connection as Airflow reads it from the environment (anonymous: nothing is called)."""
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{CONN_ID.upper()}",
        json.dumps({"conn_type": "google_cloud_platform", "extra": {"project": PROJECT, "is_anonymous": True}}),
    )


# --- a fake of the ClusterManagerClient methods the hook calls ------------------------------------


class FakeClusterManager:
    """An in-memory cluster's node pools behind the ClusterManagerClient methods the hook uses.

    Requests must be the real request types with well-formed resource names;
    answers are real container_v1 objects; errors are the real exceptions.
    An operation is RUNNING for ``polls`` polls, then DONE and in effect.
    """

    CLUSTER_RE = re.compile(r"^projects/([^/]+)/locations/([^/]+)/clusters/([^/]+)$")
    POOL_RE = re.compile(r"^(projects/[^/]+/locations/[^/]+/clusters/[^/]+)/nodePools/([a-z][-a-z0-9]*)$")
    OP_RE = re.compile(r"^projects/([^/]+)/locations/([^/]+)/operations/(operation-\d+)$")

    def __init__(self, polls: int = 2) -> None:
        self.polls = polls
        self.pools: dict[str, container_v1.NodePool] = {}
        self.ops: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.create_fails_with: str | None = None  # the create operation ends DONE with this error; pool left in ERROR
        self.refuse_create: Exception | None = None  # raised by the create call itself; nothing is made
        self.fail_pools: dict[str, str] = {}  # pool name -> the error its create operation ends with
        self.refuse_pools: dict[str, Exception] = {}  # pool name -> raised by its create call
        self.slow_pools: dict[str, int] = {}  # pool name -> polls its create operation runs for
        self.refuse_once: dict[str, Exception] = {}  # pool name -> raised by its next create call only
        self.failed_looks = 0  # the next this many get_operation calls fail with a 503
        self._ids = itertools.count(1)

    def _start(
        self,
        type_: container_v1.Operation.Type,
        path: str,
        effect: Any,
        error: str | None = None,
        polls: int | None = None,
    ) -> container_v1.Operation:
        project, location = path.split("/")[1], path.split("/")[3]
        name = f"operation-{next(self._ids)}"
        self.ops[name] = {
            "project": project,
            "location": location,
            "type": type_,
            "target": path,
            "effect": effect,
            "error": error,
            "polls": 0,
            "need": polls,  # None: self.polls when looked at
        }
        return container_v1.Operation(
            name=name, operation_type=type_, status=Status.PENDING, target_link=path, location=location
        )

    def _pool(self, name: str) -> container_v1.NodePool:
        if not self.POOL_RE.match(name):
            raise ValueError(f"bad node pool name {name}")
        if name not in self.pools:
            raise NotFound(f'Node pool "{name}" not found.')
        return self.pools[name]

    def create_node_pool(self, request: container_v1.CreateNodePoolRequest) -> container_v1.Operation:
        assert isinstance(request, container_v1.CreateNodePoolRequest)
        self.calls.append("create")
        assert self.CLUSTER_RE.match(request.parent), request.parent
        path = f"{request.parent}/nodePools/{request.node_pool.name}"
        if self.refuse_create is not None:
            raise self.refuse_create
        if request.node_pool.name in self.refuse_pools:
            raise self.refuse_pools[request.node_pool.name]
        if request.node_pool.name in self.refuse_once:
            raise self.refuse_once.pop(request.node_pool.name)
        if path in self.pools:
            raise AlreadyExists(f"Already exists: {path}.")
        pool = container_v1.NodePool(request.node_pool)
        pool.status = PoolStatus.PROVISIONING
        self.pools[path] = pool
        error = self.fail_pools.get(request.node_pool.name, self.create_fails_with)

        def effect() -> None:
            if error:
                pool.status, pool.status_message = PoolStatus.ERROR, error
            else:
                pool.status = PoolStatus.RUNNING

        polls = self.slow_pools.get(request.node_pool.name)
        return self._start(container_v1.Operation.Type.CREATE_NODE_POOL, path, effect, error, polls)

    def get_node_pool(self, request: container_v1.GetNodePoolRequest) -> container_v1.NodePool:
        assert isinstance(request, container_v1.GetNodePoolRequest)
        self.calls.append("get")
        return container_v1.NodePool(self._pool(request.name))

    def set_node_pool_size(self, request: container_v1.SetNodePoolSizeRequest) -> container_v1.Operation:
        assert isinstance(request, container_v1.SetNodePoolSizeRequest)
        self.calls.append("resize")
        pool = self._pool(request.name)

        def effect() -> None:
            pool.initial_node_count = request.node_count

        return self._start(container_v1.Operation.Type.SET_NODE_POOL_SIZE, request.name, effect)

    def delete_node_pool(self, request: container_v1.DeleteNodePoolRequest) -> container_v1.Operation:
        assert isinstance(request, container_v1.DeleteNodePoolRequest)
        self.calls.append("delete")
        pool = self._pool(request.name)
        pool.status = PoolStatus.STOPPING
        return self._start(
            container_v1.Operation.Type.DELETE_NODE_POOL, request.name, lambda: self.pools.pop(request.name)
        )

    def get_operation(self, name: str) -> container_v1.Operation:
        if self.failed_looks:
            self.failed_looks -= 1
            raise ServiceUnavailable("The service is currently unavailable.")
        m = self.OP_RE.match(name)
        assert m, name
        op = self.ops.get(m.group(3))
        if op is None or (op["project"], op["location"]) != (m.group(1), m.group(2)):
            raise NotFound(f"Operation {name} not found.")
        op["polls"] += 1
        done = op["polls"] >= (self.polls if op["need"] is None else op["need"])
        if done and op["effect"] is not None:
            op["effect"]()
            op["effect"] = None
        out = container_v1.Operation(
            name=m.group(3),
            operation_type=op["type"],
            target_link=op["target"],
            status=Status.DONE if done else Status.RUNNING,
        )
        if done and op["error"]:
            out.error = {"code": 8, "message": op["error"]}  # RESOURCE_EXHAUSTED
        return out

    def pool(self, name: str) -> container_v1.NodePool | None:
        return self.pools.get(f"projects/{PROJECT}/locations/{LOCATION}/clusters/{CLUSTER}/nodePools/{name}")


class FakeAsyncHook:
    """GKEAsyncHook.get_operation over the same fake (what the trigger calls)."""

    def __init__(self, fake: FakeClusterManager, location: str = LOCATION, fail_times: int = 0) -> None:
        self.fake = fake
        self.location = location
        self.fail_times = fail_times

    async def get_operation(self, operation_name: str, project_id: str | None) -> container_v1.Operation:
        if self.fail_times:
            self.fail_times -= 1
            raise ConnectionResetError("connection reset by peer")
        return self.fake.get_operation(
            name=f"projects/{project_id}/locations/{self.location}/operations/{operation_name}"
        )


@pytest.fixture
def fake() -> FakeClusterManager:
    return FakeClusterManager()


@pytest.fixture
def hook(fake: FakeClusterManager) -> GKETPUHook:
    h = GKETPUHook(gcp_conn_id=CONN_ID, location=LOCATION, poll_interval=0.001)
    h._client = fake  # type: ignore[assignment]  # the provider's hook keeps its client here
    return h


def pool_kwargs(**overrides: Any) -> dict[str, Any]:
    return {
        "task_id": overrides.pop("task_id", "pool"),
        "project_id": PROJECT,
        "location": LOCATION,
        "cluster_name": CLUSTER,
        "node_pool_name": "slice-0",
        "gcp_conn_id": CONN_ID,
        "poll_interval": 0.001,
        **overrides,
    }


def create_op(hook: GKETPUHook, **overrides: Any) -> GKECreateTPUNodePoolOperator:
    op = GKECreateTPUNodePoolOperator(
        **pool_kwargs(**{"machine_type": "ct6e-standard-4t", "tpu_topology": "4x4", **overrides})
    )
    op.hook = hook  # the operator's cached hook, with the fake client
    return op


def delete_op(hook: GKETPUHook, **overrides: Any) -> GKEDeleteTPUNodePoolOperator:
    op = GKEDeleteTPUNodePoolOperator(**pool_kwargs(task_id="delete", **overrides))
    op.hook = hook
    return op


def collect(trigger: GKETPUNodePoolOperationTrigger) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [event.payload async for event in trigger.run()]

    return asyncio.run(run())


# --- the requests the hook builds ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine_type", "topology", "nodes", "placement_topology"),
    [
        ("ct6e-standard-4t", "4x4", 4, "4x4"),
        ("ct6e-standard-4t", "2x4", 2, "2x4"),
        ("ct6e-standard-4t", "2x2", 1, ""),  # single host: no slice topology to place
        ("ct5p-hightpu-4t", "2x2x2", 2, "2x2x2"),
        ("ct5p-hightpu-4t", "2x4x4", 8, "2x4x4"),
        ("ct5lp-hightpu-4t", "4x8", 8, "4x8"),
        ("ct4p-hightpu-4t", "2x2x1", 1, ""),
        ("ct6e-standard-8t", "2x4", 1, ""),
    ],
)
def test_create_request_for_each_tpu_shape(
    hook: GKETPUHook, machine_type: str, topology: str, nodes: int, placement_topology: str
) -> None:
    spec = TPUNodePoolSpec(name="slice-0", machine_type=machine_type, tpu_topology=topology)
    req = hook.create_request(spec, project_id=PROJECT, cluster_name=CLUSTER)
    assert isinstance(req, container_v1.CreateNodePoolRequest)
    assert req.parent == f"projects/{PROJECT}/locations/{LOCATION}/clusters/{CLUSTER}"
    pool = req.node_pool
    assert pool.name == "slice-0"
    assert pool.config.machine_type == machine_type
    assert pool.initial_node_count == nodes == TPUSlice(machine_type, topology).hosts
    assert pool.placement_policy.tpu_topology == placement_topology
    assert not pool.config.spot
    assert pool.config.workload_metadata_config.mode == container_v1.WorkloadMetadataConfig.Mode.GKE_METADATA
    # The nodes can pull the image (without a scope GKE gives only logging and monitoring).
    assert list(pool.config.oauth_scopes) == ["https://www.googleapis.com/auth/cloud-platform"]
    # A multi-host slice is placed by its topology alone: no placement type, no policy name.
    assert pool.placement_policy.type_ == container_v1.NodePool.PlacementPolicy.Type.TYPE_UNSPECIFIED
    assert not pool.placement_policy.policy_name
    assert pool.management.auto_repair is True
    assert (
        pool.config.reservation_affinity.consume_reservation_type == container_v1.ReservationAffinity.Type.UNSPECIFIED
    )
    # What goes on the wire (the REST/JSON form of the same message).
    wire = json.loads(container_v1.CreateNodePoolRequest.to_json(req))
    assert wire["nodePool"]["config"]["machineType"] == machine_type
    assert wire["nodePool"]["initialNodeCount"] == nodes
    assert wire["nodePool"].get("placementPolicy", {}).get("tpuTopology", "") == placement_topology
    assert wire["nodePool"]["config"]["oauthScopes"] == ["https://www.googleapis.com/auth/cloud-platform"]


def test_create_request_for_spot_networks_zones_and_placement(hook: GKETPUHook) -> None:
    spec = TPUNodePoolSpec(
        name="slice-spot",
        machine_type="ct6e-standard-4t",
        tpu_topology="8x8",
        spot=True,
        compact_placement=True,  # a multi-host slice is compact by its topology: nothing more is sent
        additional_networks=(("rdma-net", "rdma-subnet"), ("data-net", "data-subnet")),
        node_locations=("us-east5-b",),
        service_account="tpu-nodes@rtrain-prod.iam.gserviceaccount.com",
        node_labels={"team": "lm"},
    )
    pool = hook.create_request(spec, project_id=PROJECT, cluster_name=CLUSTER).node_pool
    assert pool.config.spot is True
    assert pool.initial_node_count == 16
    assert pool.placement_policy.tpu_topology == "8x8"
    assert pool.placement_policy.type_ == container_v1.NodePool.PlacementPolicy.Type.TYPE_UNSPECIFIED
    assert not pool.placement_policy.policy_name
    assert [(n.network, n.subnetwork) for n in pool.network_config.additional_node_network_configs] == [
        ("rdma-net", "rdma-subnet"),
        ("data-net", "data-subnet"),
    ]
    assert list(pool.locations) == ["us-east5-b"]
    assert pool.config.service_account == "tpu-nodes@rtrain-prod.iam.gserviceaccount.com"
    assert list(pool.config.oauth_scopes) == ["https://www.googleapis.com/auth/cloud-platform"]
    assert dict(pool.config.labels) == {"team": "lm"}


def sent(request: container_v1.CreateNodePoolRequest) -> dict[str, Any]:
    """What goes on the wire: the request's JSON without the fields left at their defaults, enums by name."""
    return json.loads(
        container_v1.CreateNodePoolRequest.to_json(
            request, use_integers_for_enums=False, always_print_fields_with_no_presence=False
        )
    )


@pytest.mark.parametrize(("policy", "wire_policy"), [(None, {}), ("compact-v6e", {"policyName": "compact-v6e"})])
def test_single_host_pools_get_compact_placement_when_asked(
    hook: GKETPUHook, policy: str | None, wire_policy: dict[str, str]
) -> None:
    spec = TPUNodePoolSpec(
        name="singles",
        machine_type="ct6e-standard-4t",
        tpu_topology="2x2",
        num_slices=4,
        compact_placement=True,
        placement_policy=policy,
    )
    wire = sent(hook.create_request(spec, project_id=PROJECT, cluster_name=CLUSTER))
    assert wire["nodePool"]["placementPolicy"] == {"type": "COMPACT", **wire_policy}  # and no tpuTopology
    plain = TPUNodePoolSpec(name="singles", machine_type="ct6e-standard-4t", tpu_topology="2x2")
    assert (
        "placementPolicy" not in sent(hook.create_request(plain, project_id=PROJECT, cluster_name=CLUSTER))["nodePool"]
    )


def test_multi_host_pools_send_their_topology_and_nothing_else_as_placement(hook: GKETPUHook) -> None:
    spec = TPUNodePoolSpec(name="slice-0", machine_type="ct5p-hightpu-4t", tpu_topology="2x2x4", compact_placement=True)
    wire = sent(hook.create_request(spec, project_id=PROJECT, cluster_name=CLUSTER))
    assert wire["nodePool"]["placementPolicy"] == {"tpuTopology": "2x2x4"}


def test_node_auto_upgrade_is_what_the_spec_says(hook: GKETPUHook) -> None:
    """An upgrade recreates a slice mid-run: off where GKE allows it (no release channel), else an exclusion."""
    base = {"name": "slice-0", "machine_type": "ct6e-standard-4t", "tpu_topology": "4x4"}
    default = hook.create_request(TPUNodePoolSpec(**base), project_id=PROJECT, cluster_name=CLUSTER).node_pool
    # GKE refuses auto_upgrade=false on a release-channel cluster (docs/gke.md §4's); there the maintenance
    # exclusion of §4 keeps upgrades off the training pools.
    assert default.management.auto_upgrade is True and default.management.auto_repair is True
    off = hook.create_request(TPUNodePoolSpec(**base, auto_upgrade=False), project_id=PROJECT, cluster_name=CLUSTER)
    assert off.node_pool.management.auto_upgrade is False and off.node_pool.management.auto_repair is True
    assert sent(off)["nodePool"]["management"] == {"autoRepair": True}  # autoUpgrade: false (the default)
    docs = (Path(__file__).resolve().parents[2] / "docs" / "gke.md").read_text()
    assert "--add-maintenance-exclusion-scope=no_minor_or_node_upgrades" in docs


def test_spot_pools_can_give_the_pods_more_shutdown_grace(hook: GKETPUHook) -> None:
    base = {"name": "slice-0", "machine_type": "ct6e-standard-4t", "tpu_topology": "4x4", "spot": True}
    assert TPUNodePoolSpec(**base).pod_grace_s == 15  # GKE's default: 30 s, 15 of them for system pods
    default = sent(hook.create_request(TPUNodePoolSpec(**base), project_id=PROJECT, cluster_name=CLUSTER))
    assert "kubeletConfig" not in default["nodePool"]["config"]
    spec = TPUNodePoolSpec(**base, spot_shutdown_grace_s=120)
    assert spec.pod_grace_s == 105
    wire = sent(hook.create_request(spec, project_id=PROJECT, cluster_name=CLUSTER))
    assert wire["nodePool"]["config"]["kubeletConfig"] == {
        "shutdownGracePeriodSeconds": 120,
        "shutdownGracePeriodCriticalPodsSeconds": 15,
    }


@pytest.mark.parametrize("queued", [False, True])
def test_flex_start_pools_are_created_empty_and_scale_to_their_slice(hook: GKETPUHook, queued: bool) -> None:
    spec = TPUNodePoolSpec(
        name="slice-flex",
        machine_type="ct5p-hightpu-4t",
        tpu_topology="2x2x4",
        flex_start=True,
        queued_provisioning=queued,
    )
    pool = sent(hook.create_request(spec, project_id=PROJECT, cluster_name=CLUSTER))["nodePool"]
    assert pool["config"]["flexStart"] is True and "spot" not in pool["config"]
    assert pool["config"]["reservationAffinity"] == {"consumeReservationType": "NO_RESERVATION"}
    assert "initialNodeCount" not in pool  # 0: the pods' demand makes the slice
    assert pool["autoscaling"] == {
        "enabled": True,
        "totalMaxNodeCount": 4,  # the slice's 4 hosts, made and removed together
        "locationPolicy": "ANY",
    }
    assert pool["management"] == {"autoUpgrade": True}  # no auto-repair: a repaired flex-start VM is a new request
    assert pool["placementPolicy"] == {"tpuTopology": "2x2x4"}
    assert pool.get("queuedProvisioning") == ({"enabled": True} if queued else None)
    plain = sent(
        hook.create_request(
            TPUNodePoolSpec(name="s", machine_type="ct5p-hightpu-4t", tpu_topology="2x2x4"),
            project_id=PROJECT,
            cluster_name=CLUSTER,
        )
    )
    assert "autoscaling" not in plain["nodePool"] and "flexStart" not in plain["nodePool"]["config"]


def test_create_request_for_a_reservation(hook: GKETPUHook) -> None:
    spec = TPUNodePoolSpec(
        name="slice-r",
        machine_type="ct5p-hightpu-4t",
        tpu_topology="2x2x2",
        reservation="projects/shared-capacity/reservations/v5p-res",
    )
    affinity = hook.create_request(spec, project_id=PROJECT, cluster_name=CLUSTER).node_pool.config.reservation_affinity
    assert affinity.consume_reservation_type == container_v1.ReservationAffinity.Type.SPECIFIC_RESERVATION
    assert affinity.key == "compute.googleapis.com/reservation-name"
    assert list(affinity.values) == ["projects/shared-capacity/reservations/v5p-res"]


def test_single_host_pools_hold_num_slices_nodes(hook: GKETPUHook) -> None:
    spec = TPUNodePoolSpec(name="singles", machine_type="ct6e-standard-4t", tpu_topology="2x2", num_slices=6)
    assert hook.create_request(spec, project_id=PROJECT, cluster_name=CLUSTER).node_pool.initial_node_count == 6


def test_resize_and_delete_requests_name_the_pool(hook: GKETPUHook) -> None:
    path = f"projects/{PROJECT}/locations/{LOCATION}/clusters/{CLUSTER}/nodePools/slice-0"
    resize = hook.resize_request("slice-0", 0, project_id=PROJECT, cluster_name=CLUSTER)
    assert isinstance(resize, container_v1.SetNodePoolSizeRequest) and resize.name == path and resize.node_count == 0
    delete = hook.delete_request("slice-0", project_id=PROJECT, cluster_name=CLUSTER)
    assert isinstance(delete, container_v1.DeleteNodePoolRequest) and delete.name == path


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"name": "Slice_0"}, "node_pool_name"),
        ({"name": "x" * 41}, "node_pool_name"),
        ({"machine_type": "n2-standard-8"}, "machine_type"),
        ({"tpu_topology": "3x3"}, "tpu_topology"),
        ({"num_slices": 2}, "num_slices"),  # a 4x4 pool is one slice
        ({"spot": True, "reservation": "res"}, "spot/reservation"),
        ({"reservation": "Bad Name"}, "reservation"),
        ({"additional_networks": (("net",),)}, "additional_networks"),
        ({"placement_policy": "my-policy"}, "placement_policy"),  # a 4x4 slice is placed by its tpu_topology
        ({"spot_shutdown_grace_s": 120}, "spot_shutdown_grace_s"),  # not Spot
        ({"spot": True, "spot_shutdown_grace_s": 60}, "spot_shutdown_grace_s"),  # GKE takes 30 or 120
        ({"flex_start": True, "spot": True}, "flex_start"),
        ({"flex_start": True, "reservation": "res"}, "flex_start"),
        ({"queued_provisioning": True}, "queued_provisioning"),  # flex-start pools only
    ],
)
def test_node_pool_spec_refuses_bad_inputs_naming_them(kwargs: dict[str, Any], key: str) -> None:
    base = {"name": "slice-0", "machine_type": "ct6e-standard-4t", "tpu_topology": "4x4"}
    with pytest.raises(GKEConfigError, match=f"^{key}:"):
        TPUNodePoolSpec(**{**base, **kwargs})


def test_operators_refuse_bad_inputs_when_the_dag_is_parsed(hook: GKETPUHook) -> None:
    with pytest.raises(GKEConfigError, match="^tpu_topology:"):
        create_op(hook, tpu_topology="2x2x2")
    with pytest.raises(ValueError, match="^additional_networks:"):
        create_op(hook, additional_networks=[{"network": "n"}])
    with pytest.raises(ValueError, match="^node_count:"):
        GKEResizeTPUNodePoolOperator(**pool_kwargs(node_count=-1))
    with pytest.raises(ValueError, match="^cluster_name:"):
        GKEDeleteTPUNodePoolOperator(**pool_kwargs(cluster_name=""))
    # A templated value is checked once rendered, not at parse time.
    op = create_op(hook, tpu_topology="{{ params.topology }}")
    op.tpu_topology = "2x2x2"
    with pytest.raises(GKEConfigError, match="^tpu_topology:"):
        op.execute(context={})


# --- create / resize / delete against the fake cluster manager ------------------------------------


def test_create_waits_for_the_operation_and_returns_the_pool(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    result = create_op(hook).execute(context={})
    assert result == {
        "node_pool": "slice-0",
        "cluster": CLUSTER,
        "machine_type": "ct6e-standard-4t",
        "tpu_topology": "4x4",
        "hosts_per_slice": 4,
        "chips_per_host": 4,
        "node_count": 4,
        "spot": False,
        "created": True,
    }
    pool = fake.pool("slice-0")
    assert pool is not None and pool.status == PoolStatus.RUNNING and pool.initial_node_count == 4


def test_an_existing_pool_is_success(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    create_op(hook).execute(context={})
    fake.calls.clear()
    result = create_op(hook).execute(context={})
    assert result["created"] is False
    assert fake.calls[0] == "create" and "delete" not in fake.calls  # AlreadyExists was raised and absorbed
    assert fake.pool("slice-0").status == PoolStatus.RUNNING


def test_an_existing_pool_of_another_shape_is_an_error(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    create_op(hook, tpu_topology="4x8").execute(context={})
    with pytest.raises(TPUNodePoolError, match="topology '4x8', not '4x4'"):
        create_op(hook, tpu_topology="4x4").execute(context={})


def test_an_existing_on_demand_pool_is_not_a_flex_start_one(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    create_op(hook).execute(context={})
    with pytest.raises(TPUNodePoolError, match="flex_start=False, not True"):
        create_op(hook, flex_start=True).execute(context={})


def test_the_project_falls_back_to_the_connection(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    op = create_op(hook, project_id=None)
    op.execute(context={})
    assert fake.pool("slice-0") is not None  # created under projects/<the connection's project>


def test_a_failed_create_operation_fails_the_task(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    fake.create_fails_with = "There is no more capacity in the zone us-east5-b"
    with pytest.raises(TPUNodePoolError, match="no more capacity"):
        create_op(hook).execute(context={})
    assert fake.pool("slice-0").status == PoolStatus.ERROR  # what a stockout leaves behind


def test_a_pool_left_in_error_is_deleted_and_created_again(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    fake.create_fails_with = "stockout"
    with pytest.raises(TPUNodePoolError):
        create_op(hook).execute(context={})
    fake.create_fails_with = None
    fake.calls.clear()
    result = create_op(hook).execute(context={})  # the Airflow retry
    assert result["created"] is True
    assert fake.calls.count("delete") == 1 and fake.calls.count("create") == 2
    assert fake.pool("slice-0").status == PoolStatus.RUNNING


def test_a_pool_left_in_error_is_an_error_when_recreating_is_off(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    fake.create_fails_with = "stockout"
    with pytest.raises(TPUNodePoolError):
        create_op(hook).execute(context={})
    with pytest.raises(Exception, match="state ERROR"):
        create_op(hook, recreate_failed_pool=False).execute(context={})


# --- a run's node pools: all at once, done when enough are up --------------------------------------


def slices(n: int) -> list[TPUNodePoolSpec]:
    return [TPUNodePoolSpec(name=f"slice-{i}", machine_type="ct6e-standard-4t", tpu_topology="4x4") for i in range(n)]


def test_all_pools_are_asked_for_before_any_is_waited_on(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    up = hook.create_tpu_node_pools(cluster_name=CLUSTER, specs=slices(3), need=3, project_id=PROJECT)
    assert sorted(up.ready) == ["slice-0", "slice-1", "slice-2"] and up.creating == [] and up.failed == {}
    assert fake.calls[:3] == ["create", "create", "create"], fake.calls
    assert all(fake.pool(f"slice-{i}").status == PoolStatus.RUNNING for i in range(3))


def test_enough_pools_up_is_done_and_the_slow_one_goes_on_being_created(
    hook: GKETPUHook, fake: FakeClusterManager, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.slow_pools["slice-2"] = 1000
    up = hook.create_tpu_node_pools(cluster_name=CLUSTER, specs=slices(3), need=2, project_id=PROJECT)
    assert sorted(up.ready) == ["slice-0", "slice-1"] and up.creating == ["slice-2"]
    assert fake.pool("slice-2").status == PoolStatus.PROVISIONING, "left to GKE, not cancelled"
    assert "slice-2 are still being created: their hosts join the job when they are up" in capsys.readouterr().out
    # The next try (an Airflow retry, a rerun) finds it on its way and watches the pool itself.
    op = next(o for o in fake.ops.values() if o["target"].endswith("slice-2"))
    op["need"] = op["polls"] + 1  # GKE finishes it while the next try looks
    threading.Timer(
        0.05, lambda: fake.get_operation(f"projects/{PROJECT}/locations/{LOCATION}/operations/operation-3")
    ).start()
    up = hook.create_tpu_node_pools(cluster_name=CLUSTER, specs=slices(3), need=3, project_id=PROJECT)
    assert sorted(up.ready) == ["slice-0", "slice-1", "slice-2"]


def test_a_stockout_and_a_quota_are_named_and_the_job_starts_on_what_is_up(
    hook: GKETPUHook, fake: FakeClusterManager, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.fail_pools["slice-1"] = "GCE_STOCKOUT: ZONE_RESOURCE_POOL_EXHAUSTED in us-east5-b"
    fake.refuse_pools["slice-2"] = ResourceExhausted("Quota 'TPU_V6E_PODSLICE_LITE_DEVICES' exceeded. Limit: 32.0")
    up = hook.create_tpu_node_pools(cluster_name=CLUSTER, specs=slices(3), need=1, project_id=PROJECT)
    assert up.ready == ["slice-0"]
    assert up.failed["slice-1"].startswith("no TPU capacity left in the zone (a stockout)")
    assert "ZONE_RESOURCE_POOL_EXHAUSTED" in up.failed["slice-1"]
    assert up.failed["slice-2"].startswith("over the project's quota") and "TPU_V6E" in up.failed["slice-2"]
    out = capsys.readouterr().out
    assert "Node pool slice-1 failed: no TPU capacity left in the zone" in out
    assert "Node pool slice-2 was refused: over the project's quota" in out


def test_too_few_pools_up_fails_naming_each_pool_s_fate(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    fake.fail_pools["slice-1"] = "ZONE_RESOURCE_POOL_EXHAUSTED"
    fake.slow_pools["slice-2"] = 1000
    with pytest.raises(TPUNodePoolError) as e:
        hook.create_tpu_node_pools(cluster_name=CLUSTER, specs=slices(3), need=3, project_id=PROJECT, timeout_s=0.05)
    msg = str(e.value)
    assert msg.startswith("1 of the 3 node pools the job needs at least are up (slice-0)")
    assert "slice-1: no TPU capacity left in the zone (a stockout)" in msg and "slice-2: still being created" in msg


def test_requests_that_fail_for_now_are_sent_again_and_a_pool_being_deleted_is_made_once_gone(
    hook: GKETPUHook, fake: FakeClusterManager
) -> None:
    fake.refuse_once["slice-0"] = ServiceUnavailable("backend unavailable")
    fake.failed_looks = 3
    hook.create_tpu_node_pools(cluster_name=CLUSTER, specs=slices(1), need=1, project_id=PROJECT)
    op = hook.delete_tpu_node_pool(
        cluster_name=CLUSTER, node_pool_name="slice-0", project_id=PROJECT, wait_to_complete=False
    )
    assert op is not None and fake.pool("slice-0").status == PoolStatus.STOPPING
    name = f"projects/{PROJECT}/locations/{LOCATION}/operations/{op.name}"
    gone = threading.Timer(0.2, lambda: [fake.get_operation(name) for _ in range(fake.polls)])
    gone.start()  # GKE finishes the delete while the next try waits for it
    up = hook.create_tpu_node_pools(cluster_name=CLUSTER, specs=slices(2), need=2, project_id=PROJECT, timeout_s=30)
    gone.join()
    assert sorted(up.ready) == ["slice-0", "slice-1"] and up.failed == {}
    assert fake.pool("slice-0").status == PoolStatus.RUNNING


def test_when_too_few_can_still_come_up_it_fails_at_once(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    fake.fail_pools["slice-0"] = "ZONE_RESOURCE_POOL_EXHAUSTED"
    fake.refuse_pools["slice-1"] = ResourceExhausted("Quota exceeded")
    fake.slow_pools["slice-2"] = 10**6
    t0 = time.monotonic()
    with pytest.raises(TPUNodePoolError, match="0 of the 3 node pools"):
        hook.create_tpu_node_pools(cluster_name=CLUSTER, specs=slices(3), need=3, project_id=PROJECT)
    assert time.monotonic() - t0 < 30, "it did not wait for the slow pool: 3 can no longer be up"


def test_a_pool_an_earlier_try_left_in_error_is_made_again(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    fake.fail_pools["slice-1"] = "ZONE_RESOURCE_POOL_EXHAUSTED"
    hook.create_tpu_node_pools(cluster_name=CLUSTER, specs=slices(2), need=1, project_id=PROJECT)
    assert fake.pool("slice-1").status == PoolStatus.ERROR
    fake.fail_pools.clear()  # the capacity came back
    fake.calls.clear()
    up = hook.create_tpu_node_pools(cluster_name=CLUSTER, specs=slices(2), need=2, project_id=PROJECT)
    assert sorted(up.ready) == ["slice-0", "slice-1"] and fake.calls.count("delete") == 1
    assert fake.pool("slice-1").status == PoolStatus.RUNNING


def test_delete_removes_the_pool_and_a_missing_pool_is_fine(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    create_op(hook).execute(context={})
    assert delete_op(hook).execute(context={}) == {"node_pool": "slice-0", "deleted": True}
    assert fake.pool("slice-0") is None
    assert delete_op(hook).execute(context={}) == {"node_pool": "slice-0", "deleted": False}  # NotFound absorbed


def test_resize_sets_the_node_count_all_or_nothing_for_a_multi_host_slice(
    hook: GKETPUHook, fake: FakeClusterManager
) -> None:
    create_op(hook).execute(context={})
    resize = GKEResizeTPUNodePoolOperator(**pool_kwargs(node_count=0))
    resize.hook = hook
    assert resize.execute(context={}) == {"node_pool": "slice-0", "node_count": 0}
    assert fake.pool("slice-0").initial_node_count == 0
    partial = GKEResizeTPUNodePoolOperator(**pool_kwargs(node_count=2))
    partial.hook = hook
    with pytest.raises(GKEConfigError, match="0 or 4 nodes, not 2"):
        partial.execute(context={})


def test_resize_of_a_missing_pool_raises_not_found(hook: GKETPUHook) -> None:
    resize = GKEResizeTPUNodePoolOperator(**pool_kwargs(node_count=4))
    resize.hook = hook
    with pytest.raises(NotFound):
        resize.execute(context={})


# --- teardown ----------------------------------------------------------------------------------------


def test_delete_is_requested_whatever_happened_upstream(hook: GKETPUHook) -> None:
    assert delete_op(hook).trigger_rule == TriggerRule.ALL_DONE
    with DAG("gke_teardown", schedule=None, start_date=datetime(2025, 1, 1)):
        create = create_op(hook)
        delete = delete_op(hook).as_teardown(setups=create)
    assert delete.is_teardown and create.is_setup
    assert create.task_id in delete.upstream_task_ids
    # Not ALL_DONE_SETUP_SUCCESS: that would skip the delete exactly when the create failed.
    assert delete.trigger_rule == TriggerRule.ALL_DONE
    with DAG("gke_teardown_mapped", schedule=None, start_date=datetime(2025, 1, 1)):
        mapped = GKEDeleteTPUNodePoolOperator.partial(
            **{k: v for k, v in pool_kwargs(task_id="rm").items() if k != "node_pool_name"}
        ).expand(node_pool_name=["a", "b"])
    assert mapped.trigger_rule == TriggerRule.ALL_DONE


def test_teardown_after_a_failed_create_deletes_what_it_left(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    fake.create_fails_with = "stockout"
    with pytest.raises(TPUNodePoolError):
        create_op(hook).execute(context={})
    assert fake.pool("slice-0") is not None  # a pool in ERROR still holds quota
    assert delete_op(hook).execute(context={})["deleted"] is True
    assert fake.pool("slice-0") is None


def test_teardown_after_a_refused_create_is_a_no_op(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    fake.refuse_create = ResourceExhausted("Quota 'TPU_V6E_CHIPS' exceeded")
    with pytest.raises(ResourceExhausted):
        create_op(hook).execute(context={})
    assert delete_op(hook).execute(context={}) == {"node_pool": "slice-0", "deleted": False}


# --- deferral and the trigger -----------------------------------------------------------------------


TRIGGER_KWARGS: dict[str, Any] = {
    "operation_name": "operation-1717171717-abc",
    "project_id": PROJECT,
    "location": LOCATION,
    "node_pool_name": "slice-0",
    "gcp_conn_id": CONN_ID,
    "impersonation_chain": ["a@b.iam.gserviceaccount.com"],
    "poll_interval": 2.5,
    "max_poll_errors": 4,
}


def test_trigger_serialize_round_trips_exactly() -> None:
    classpath, kwargs = GKETPUNodePoolOperationTrigger(**TRIGGER_KWARGS).serialize()
    assert classpath == "rtrain_airflow.triggers.gke_tpu.GKETPUNodePoolOperationTrigger"
    assert kwargs == TRIGGER_KWARGS
    module, _, name = classpath.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert cls is GKETPUNodePoolOperationTrigger
    assert cls(**kwargs).serialize() == (classpath, kwargs)


def test_trigger_reports_success_once_the_operation_is_done(fake: FakeClusterManager) -> None:
    op = fake.create_node_pool(
        request=container_v1.CreateNodePoolRequest(
            parent=f"projects/{PROJECT}/locations/{LOCATION}/clusters/{CLUSTER}",
            node_pool=TPUNodePoolSpec(
                name="slice-0", machine_type="ct6e-standard-4t", tpu_topology="4x4"
            ).to_node_pool(),
        )
    )
    fake.polls = 3
    trigger = GKETPUNodePoolOperationTrigger(
        operation_name=op.name, project_id=PROJECT, location=LOCATION, poll_interval=0
    )
    trigger._hook = FakeAsyncHook(fake, fail_times=1)  # one transient poll failure is absorbed
    (event,) = collect(trigger)
    assert event["status"] == "success" and event["operation_name"] == op.name
    assert fake.ops[op.name]["polls"] == 3
    assert fake.pool("slice-0").status == PoolStatus.RUNNING


def test_trigger_reports_a_done_operation_with_an_error_as_failed(fake: FakeClusterManager) -> None:
    fake.create_fails_with = "stockout in us-east5-b"
    op = fake.create_node_pool(
        request=container_v1.CreateNodePoolRequest(
            parent=f"projects/{PROJECT}/locations/{LOCATION}/clusters/{CLUSTER}",
            node_pool=TPUNodePoolSpec(
                name="slice-0", machine_type="ct6e-standard-4t", tpu_topology="4x4"
            ).to_node_pool(),
        )
    )
    trigger = GKETPUNodePoolOperationTrigger(
        operation_name=op.name, project_id=PROJECT, location=LOCATION, poll_interval=0
    )
    trigger._hook = FakeAsyncHook(fake)
    (event,) = collect(trigger)
    assert event["status"] == "failed" and "stockout in us-east5-b" in event["message"]


def test_trigger_gives_up_after_repeated_poll_errors(fake: FakeClusterManager) -> None:
    trigger = GKETPUNodePoolOperationTrigger(
        operation_name="operation-9", project_id=PROJECT, location=LOCATION, poll_interval=0, max_poll_errors=2
    )
    trigger._hook = FakeAsyncHook(fake, fail_times=5)
    (event,) = collect(trigger)
    assert event["status"] == "error" and "connection reset" in event["message"]


def test_deferrable_create_defers_to_the_trigger_and_completes(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    op = create_op(hook, deferrable=True)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context={})
    trigger = deferred.value.trigger
    assert isinstance(trigger, GKETPUNodePoolOperationTrigger)
    assert deferred.value.method_name == "execute_complete"
    assert (trigger.project_id, trigger.location, trigger.node_pool_name) == (PROJECT, LOCATION, "slice-0")
    trigger.poll_interval = 0
    trigger._hook = FakeAsyncHook(fake)
    (event,) = collect(trigger)
    assert op.execute_complete(context={}, event=event)["created"] is True
    with pytest.raises(Exception, match="stockout"):
        op.execute_complete(context={}, event={"status": "failed", "message": "stockout"})


def test_deferrable_recreate_of_a_failed_pool_chains_two_deferrals(hook: GKETPUHook, fake: FakeClusterManager) -> None:
    fake.create_fails_with = "stockout"
    with pytest.raises(TPUNodePoolError):
        create_op(hook).execute(context={})
    fake.create_fails_with = None
    op = create_op(hook, deferrable=True)
    with pytest.raises(TaskDeferred) as deleting:
        op.execute(context={})
    assert deleting.value.method_name == "recreate_after_delete"
    deleting.value.trigger.poll_interval, deleting.value.trigger._hook = 0, FakeAsyncHook(fake)
    (event,) = collect(deleting.value.trigger)
    assert fake.pool("slice-0") is None
    with pytest.raises(TaskDeferred) as creating:
        op.recreate_after_delete(context={}, event=event)
    assert creating.value.method_name == "execute_complete"
    creating.value.trigger.poll_interval, creating.value.trigger._hook = 0, FakeAsyncHook(fake)
    (event,) = collect(creating.value.trigger)
    assert op.execute_complete(context={}, event=event)["created"] is True
    assert fake.pool("slice-0").status == PoolStatus.RUNNING


def test_deferrable_delete_defers_only_when_there_is_something_to_delete(
    hook: GKETPUHook, fake: FakeClusterManager
) -> None:
    assert delete_op(hook, deferrable=True).execute(context={})["deleted"] is False
    create_op(hook).execute(context={})
    with pytest.raises(TaskDeferred) as deferred:
        delete_op(hook, deferrable=True).execute(context={})
    deferred.value.trigger.poll_interval = 0
    deferred.value.trigger._hook = FakeAsyncHook(fake)
    (event,) = collect(deferred.value.trigger)
    assert event["status"] == "success" and fake.pool("slice-0") is None


# --- JobSets through the KubernetesHook, against a fake Kubernetes API server --------------------------


class FakeKubernetes:
    """Services, JobSets and Nodes of one cluster, served over HTTP as the Kubernetes API does."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, namespace, name)
        self.nodes: list[dict[str, Any]] = []
        self.pods: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def handle(self, method: str, url: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        path, query = urlparse(url).path, parse_qs(urlparse(url).query)
        self.requests.append((method, path))
        if path == "/api/v1/nodes" and method == "GET":
            wanted = dict(kv.split("=", 1) for kv in query.get("labelSelector", [""])[0].split(",") if kv)
            items = [
                n for n in self.nodes if all(n["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
            ]
            return 200, {"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": items}
        pods = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", path)
        if pods and method == "GET":
            wanted = dict(kv.split("=", 1) for kv in query.get("labelSelector", [""])[0].split(",") if kv)
            items = [
                p
                for p in self.pods
                if p["metadata"].get("namespace") == pods.group(1)
                and all(p["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
            ]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/services(?:/([^/]+))?", path) or re.fullmatch(
            r"/apis/jobset\.x-k8s\.io/v1alpha2/namespaces/([^/]+)/jobsets(?:/([^/]+))?", path
        )
        if not m:
            return 404, status(404, "NotFound", path)
        kind = "Service" if "/services" in path else "JobSet"
        ns, name = m.group(1), m.group(2)
        with self.lock:
            if method == "POST" and name is None:
                assert body is not None and body["kind"] == kind
                key = (kind, ns, body["metadata"]["name"])
                if key in self.objects:
                    return 409, status(409, "AlreadyExists", f'{kind.lower()}s "{key[2]}" already exists')
                obj = copy.deepcopy(body)
                obj["metadata"].update(namespace=ns, uid=f"uid-{len(self.objects)}")
                self.objects[key] = obj
                return 201, obj
            key = (kind, ns, name or "")
            if key not in self.objects:
                return 404, status(404, "NotFound", f'{kind.lower()}s "{name}" not found')
            if method == "GET":
                return 200, self.objects[key]
            if method == "DELETE":
                self.objects[key]["deleteOptions"] = body
                return 200, self.objects.pop(key)
        return 405, status(405, "MethodNotAllowed", method)


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "reason": reason,
        "message": message,
        "code": code,
    }


@pytest.fixture
def k8s() -> Iterator[tuple[FakeKubernetes, str]]:
    api = FakeKubernetes()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            code, payload = api.handle(self.command, self.path, json.loads(raw) if raw else None)
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _serve

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def jobset_hook(url: str) -> JobSetHook:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from kubernetes.client import Configuration

    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "airflow", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "airflow"}}],
        "current-context": "fake",
    }
    kube = KubernetesHook(
        conn_id=None, kubernetes_conn_id=None, config_dict=kubeconfig, client_configuration=Configuration()
    )
    return JobSetHook(kube)


def tpu_node(name: str, pool: str, ready: bool = True, topology: str = "4x4") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "cloud.google.com/gke-nodepool": pool,
                "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                "cloud.google.com/gke-tpu-topology": topology,
            },
        },
        "spec": {},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


CONFIG = {
    "preset": "tiny",
    "backend": "gke",
    "root": "gs://rtrain-prod/runs",
    "run_name": "llama-8b",
    "devices_per_worker": 4,
    "min_workers": 4,
    "max_workers": 16,
    "global_batch": 64,
}


@pytest.fixture(scope="module")
def gs_config(gcs_emulator: str) -> dict[str, Any]:
    """CONFIG with a gs:// run root and a prepared gs:// dataset in the emulator (a launch checks both)."""
    import uuid

    from training import data

    prefix = f"gs://rtrain-test/gke-{uuid.uuid4().hex[:8]}"
    data.prepare(None, f"{prefix}/data", 64, max_bytes=60_000)
    return {**CONFIG, "root": f"{prefix}/runs", "dataset": f"{prefix}/data"}


def start_op(url: str, config: dict[str, Any] | None = None, **overrides: Any) -> GKEStartTPUJobSetOperator:
    op = GKEStartTPUJobSetOperator(
        **{
            "task_id": "launch",
            "location": LOCATION,
            "cluster_name": CLUSTER,
            "project_id": PROJECT,
            "gcp_conn_id": CONN_ID,
            "namespace": "training",
            "config": config or CONFIG,
            "machine_type": "ct6e-standard-4t",
            "tpu_topology": "4x4",
            "image": "us-docker.pkg.dev/p/rtrain/train:1",
            **overrides,
        }
    )
    op.jobset_hook = jobset_hook(url)
    return op


@pytest.mark.gcs
def test_start_takes_the_run_writes_its_config_and_creates_a_jobset_of_agents(
    k8s: tuple[FakeKubernetes, str], gs_config: dict[str, Any]
) -> None:
    from training import api as engine

    api, url = k8s
    cfg = dict(gs_config, run_name="start-1")
    result = start_op(url, cfg).execute(context={})
    # Every slice max_workers allows is asked for (missing nodes leave pods Pending; the job is elastic).
    assert result["num_slices"] == 4 and result["backend"] == "gke" and result["state"] == "running"
    run_uri = f"{gs_config['root']}/start-1"
    assert result["run_uri"] == run_uri
    jobset = api.objects[("JobSet", "training", result["jobset"])]
    assert jobset["spec"]["replicatedJobs"][0]["replicas"] == 4
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 0}
    (container,) = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["rtrain", "agent", run_uri]
    assert {"name": "RTRAIN_JOB", "value": result["job"]} in container["env"]
    service = api.objects[("Service", "training", result["jobset"])]
    # The Service belongs to the JobSet: deleting the JobSet (anyone's delete) takes it along.
    assert service["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "name": result["jobset"],
            "uid": jobset["metadata"]["uid"],
            "blockOwnerDeletion": True,
        }
    ]
    kubernetes_validate.validate(
        {k: v for k, v in service.items() if k != "deleteOptions"}, kubernetes_validate.latest_version(), strict=True
    )
    # The run is the job's: its config (hosts_per_slice from the TPU shape), a pending status, the lock handed over.
    written = engine.load_run_config(run_uri)
    assert (written.hosts_per_slice, written.backend) == (4, "gke")
    assert engine.status(run_uri)["job"] == result["job"]
    assert engine.job_state(result)["state"] == "pending"


@pytest.mark.gcs
def test_a_second_start_while_a_job_holds_the_run_is_refused_and_writes_nothing(
    k8s: tuple[FakeKubernetes, str], gs_config: dict[str, Any]
) -> None:
    from training import api as engine

    api, url = k8s
    cfg = dict(gs_config, run_name="start-2")
    first = start_op(url, cfg).execute(context={})
    run_uri = f"{gs_config['root']}/start-2"
    before = engine.load_run_config(run_uri).learning_rate
    with pytest.raises(Exception, match="refused: run .* is locked by") as e:
        start_op(url, {**cfg, "learning_rate": 0.5}).execute(context={})
    assert first["job"] in str(e.value)
    assert engine.load_run_config(run_uri).learning_rate == before  # the refused launch wrote nothing
    assert sum(1 for k in api.objects if k[0] == "JobSet") == 1


def test_start_refuses_a_config_that_cannot_run_on_gke_when_parsed(k8s: tuple[FakeKubernetes, str]) -> None:
    _, url = k8s
    with pytest.raises(GKEConfigError, match="^root:"):
        start_op(url, {**CONFIG, "root": "var/runs"})
    with pytest.raises(GKEConfigError, match="^devices_per_worker:"):
        start_op(url, machine_type="ct6e-standard-8t", tpu_topology="2x4")


def test_jobset_state_and_delete(k8s: tuple[FakeKubernetes, str]) -> None:
    api, url = k8s
    hook = jobset_hook(url)
    cfg = load_config(overrides={**CONFIG, "hosts_per_slice": 4})
    m = render(cfg, TPUSlice("ct6e-standard-4t", "4x4"), GKELaunch(image="img:1", namespace="training"), "j5")
    hook.create(m)
    assert hook.state(m.name, "training") == "running"
    api.objects[("JobSet", "training", m.name)]["status"] = {"terminalState": "Failed", "restarts": 0}
    assert hook.state(m.name, "training") == "failed"

    delete = GKEDeleteTPUJobSetOperator(
        task_id="rm",
        location=LOCATION,
        cluster_name=CLUSTER,
        gcp_conn_id=CONN_ID,
        namespace="training",
        jobset_name=m.name,
    )
    assert delete.trigger_rule == TriggerRule.ALL_DONE
    delete.jobset_hook = hook
    assert delete.execute(context={})["deleted"] is True
    assert not api.objects
    assert hook.state(m.name, "training") == "missing"
    assert delete.execute(context={})["deleted"] is False


def pod(name: str, jobset: str, status: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "training", "labels": {"jobset.sigs.k8s.io/jobset-name": jobset}},
        "spec": {"containers": [{"name": "agent", "image": "img:1"}]},
        "status": status,
    }


UNSCHEDULABLE = {
    "phase": "Pending",
    "conditions": [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient google.com/tpu. preemption: 0/3 nodes are available",
        }
    ],
}
IMAGE_PULL = {
    "phase": "Pending",
    "conditions": [{"type": "PodScheduled", "status": "True"}],
    "containerStatuses": [
        {
            "name": "agent",
            "ready": False,
            "restartCount": 0,
            "image": "img:1",
            "imageID": "",
            "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "img:1"'}},
        }
    ],
}
RUNNING = {
    "phase": "Running",
    "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
    "containerStatuses": [
        {
            "name": "agent",
            "ready": True,
            "restartCount": 0,
            "image": "img:1",
            "imageID": "x",
            "state": {"running": {"startedAt": "2026-12-01T10:00:00Z"}},
        }
    ],
}


def test_why_the_jobset_s_pods_wait_is_read_from_the_cluster_and_told_in_one_line(
    k8s: tuple[FakeKubernetes, str],
) -> None:
    api, url = k8s
    hook = jobset_hook(url)
    api.pods = [
        pod("js-slice-0-0", "js", RUNNING),
        pod("js-slice-1-0", "js", UNSCHEDULABLE),
        pod("js-slice-1-1", "js", UNSCHEDULABLE),
        pod("js-slice-2-0", "js", IMAGE_PULL),
        pod("other-0", "other", UNSCHEDULABLE),  # another JobSet's
    ]
    line = hook.waiting("js", "training")
    assert line.startswith("2 pods Unschedulable (0/3 nodes are available: 3 Insufficient google.com/tpu.")
    assert "no node can take it: the TPU node pools are still being created" in line
    assert '1 pod ImagePullBackOff (Back-off pulling image "img:1"): the nodes cannot pull the image' in line
    api.pods = [pod("js-slice-0-0", "js", RUNNING)]
    assert hook.waiting("js", "training") == ""

    # An agent that exits at start leaves a Failed pod (restartPolicy Never); one on its way out is not told.
    def ended(code: int, reason: str, message: str = "") -> dict[str, Any]:
        state = {"terminated": {"exitCode": code, "reason": reason, **({"message": message} if message else {})}}
        return {"name": "agent", "ready": False, "restartCount": 0, "image": "img:1", "imageID": "x", "state": state}

    failed = {"phase": "Failed", "containerStatuses": [ended(3, "Error", "config refused")]}
    oom = {"phase": "Failed", "containerStatuses": [ended(137, "OOMKilled")]}
    evicted = {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."}
    leaving = pod("js-slice-3-0", "js", UNSCHEDULABLE)
    leaving["metadata"]["deletionTimestamp"] = "2026-12-01T10:00:00Z"
    api.pods = [pod("a", "js", failed), pod("b", "js", oom), pod("c", "js", evicted), leaving]
    line = hook.waiting("js", "training")
    assert "1 pod Failed (exit code 3: config refused): the agent exited with an error" in line
    assert "1 pod OOMKilled (exit code 137): the agent ran out of the pod's memory" in line
    assert "1 pod Evicted (The node was low on resource: memory.)" in line and "Unschedulable" not in line
    # A failed pod stays after its index's next pod started: that one is told, not the old one.
    index = {"jobset.sigs.k8s.io/job-index": "0", "batch.kubernetes.io/job-completion-index": "1"}
    old, new = pod("js-slice-0-1-a", "js", failed), pod("js-slice-0-1-b", "js", RUNNING)
    for p in (old, new):
        p["metadata"]["labels"].update(index)
    api.pods = [old, new]
    assert hook.waiting("js", "training") == ""


def test_the_gke_backend_s_poll_says_why_pods_wait_or_that_kueue_holds_the_jobset(
    k8s: tuple[FakeKubernetes, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    api, url = k8s
    hook = jobset_hook(url)
    cfg = load_config(overrides={**CONFIG, "hosts_per_slice": 4})
    m = render(cfg, TPUSlice("ct6e-standard-4t", "4x4"), GKELaunch(image="img:1", namespace="training"), "j7")
    hook.create(m)
    api.pods = [pod(f"{m.name}-slice-0-0", m.name, UNSCHEDULABLE)]
    gke = {
        "location": LOCATION,
        "cluster_name": CLUSTER,
        "machine_type": "ct6e-standard-4t",
        "tpu_topology": "4x4",
        "image": "img:1",
        "node_pools": ["slice-0"],
        "kueue_queue": "tpu-v6e",
    }
    backend = GKEBackend(gke, ProviderCluster(gke))
    monkeypatch.setattr(backend.cluster, "jobsets", lambda: hook)
    run = tmp_path / "run"
    handle: dict[str, Any] = {"backend": "gke", "run_uri": str(run), "job": "j7", "jobset": m.name}
    handle |= {"namespace": "training", "launched_at": time.time()}
    look = backend.poll(handle, {"start_timeout_s": 900})
    assert look["state"] not in ("finished", "failed")
    assert look["waiting"].startswith("1 pod Unschedulable (0/3 nodes are available")
    # Pods waiting for nodes the cluster is still to make (flex-start, a stockout): past the start timeout,
    # the job waits up to the provisioning timeout, then fails saying why.
    later = handle["launched_at"] + 1000
    assert backend.poll(handle, {"start_timeout_s": 900}, now=later)["state"] == "pending"
    failed = backend.poll(handle, {"start_timeout_s": 900}, now=handle["launched_at"] + 3700)
    assert (
        failed["state"] == "failed"
        and "did not start within 3600s; pods waiting: 1 pod Unschedulable" in failed["reason"]
    )
    # Kueue holds the JobSet: no start timeout at all.
    api.objects[("JobSet", "training", m.name)]["spec"]["suspend"] = True
    look = backend.poll(handle, {"start_timeout_s": 900}, now=handle["launched_at"] + 99_999)
    assert look["state"] == "pending"
    assert look["waiting"] == "the JobSet is suspended: waiting for Kueue to admit it (queue tpu-v6e)"
    # Pods that run but whose agents never write the job's status: the start timeout.
    api.objects[("JobSet", "training", m.name)]["spec"]["suspend"] = False
    api.pods = [pod(f"{m.name}-slice-0-0", m.name, RUNNING)]
    assert backend.poll(handle, {"start_timeout_s": 900}, now=later)["state"] == "failed"


def test_capacity_and_ready_nodes_through_the_kubernetes_client(k8s: tuple[FakeKubernetes, str]) -> None:
    api, url = k8s
    api.nodes = [tpu_node(f"a-{i}", "slice-a") for i in range(4)] + [tpu_node("b-0", "slice-b", ready=False)]
    hook = jobset_hook(url)
    assert hook.capacity(TPUSlice("ct6e-standard-4t", "4x4")).available() == 4
    assert [n.metadata.name for n in hook.list_ready_nodes("slice-a")] == ["a-0", "a-1", "a-2", "a-3"]
    assert hook.list_ready_nodes("slice-b") == []
    assert len(hook.list_nodes("slice-b")) == 1


def _docs_dag_source() -> str:
    text = (REPO / "docs" / "gke.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "with DAG(" in b]
    return block


def test_the_dag_in_docs_gke_md_parses_with_these_operators() -> None:
    namespace: dict[str, Any] = {}
    exec(compile(_docs_dag_source(), "docs/gke.md", "exec"), namespace)  # noqa: S102 - our own documentation
    dag = namespace["launch"].dag  # the block opens its DAG as a context manager; its tasks know it
    assert set(dag.task_ids) == {"create_tpu_pools", "launch", "watch", "delete_jobset", "delete_tpu_pools"}
    assert dag.get_task("delete_tpu_pools").trigger_rule == TriggerRule.ALL_DONE
    assert dag.get_task("delete_jobset").trigger_rule == TriggerRule.ALL_DONE
    assert "watch" in dag.get_task("delete_jobset").upstream_task_ids
    assert dag.get_task("watch").upstream_task_ids == {"launch"}
    # The example's run config fits the shape it names: slices, mesh, batch and memory.
    from training.gke.manifests import feasible_slices
    from training.mesh import check_fit

    launch = dag.get_task("launch")
    cfg, tpu, _ = launch._static_inputs()
    assert (cfg.preset, tpu.machine_type, tpu.hosts) == ("llama3-8b", "ct5p-hightpu-4t", 4)
    assert feasible_slices(cfg, tpu) == [1, 2, 4]
    check_fit(cfg)


def test_the_docs_dag_refuses_a_config_that_cannot_run_when_parsed() -> None:
    source = _docs_dag_source().replace('"devices_per_worker": 4', '"devices_per_worker": 8')
    with pytest.raises(GKEConfigError, match="^devices_per_worker:"):
        exec(compile(source, "docs/gke.md", "exec"), {})  # noqa: S102


def _shipped_dag_params() -> dict[str, Any]:
    """The trigger form (Params) of the shipped DAG ``resilient_training``, from dags/resilient_training.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rtrain_shipped_dags", REPO / "dags" / "resilient_training.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.training_params(continual=False))


def test_the_gke_conf_in_docs_gke_md_triggers_the_shipped_dag() -> None:
    """The conf of §7.1 passes the DAG's params, resolves, and fits the TPU shape it names."""
    from airflow.sdk.definitions.param import ParamsDict
    from rtrain_airflow.operators.training import RTrainResolveRunConfigOperator

    from training.api import check_fit, config_from_dict
    from training.gke import TPUSlice, check_config
    from training.gke.manifests import feasible_slices, slice_bounds

    text = (REPO / "docs" / "gke.md").read_text()
    (raw,) = [b for b in re.findall(r"```json\n(.*?)```", text, re.S) if '"backend": "gke"' in b]
    conf = json.loads(raw)
    params = ParamsDict(_shipped_dag_params())
    params.update(conf)
    values = params.validate()  # what the REST API and the CLI check before they create the DAG run
    spec = RTrainResolveRunConfigOperator(task_id="resolve_config").execute({"params": values})
    assert (
        spec["backend"] == "gke"
        and spec["run_uri"].startswith("gs://")
        and spec["config"]["dataset"].startswith("gs://")
    )
    gke = spec["gke"]
    cfg, tpu = config_from_dict(spec["config"]), TPUSlice(gke["machine_type"], gke["tpu_topology"])
    check_config(cfg, tpu)
    assert feasible_slices(cfg, tpu) == [1, 2, 4]
    assert len(gke["node_pools"]) == slice_bounds(cfg, tpu)[1]  # one pool per slice the job may use
    check_fit(cfg)
    # The REST call and the CLI both send this file.
    assert "/api/v2/dags/resilient_training/dagRuns" in text and '"conf\\": $(cat conf.json)' in text
    assert 'airflow dags trigger resilient_training --conf "$(cat conf.json)"' in text


def test_docs_gke_md_uses_one_zone_and_cites_only_the_repository() -> None:
    text = (REPO / "docs" / "gke.md").read_text()
    zones = set(re.findall(r"\bus-east5-[a-z]\b", text))
    assert zones == {"us-east5-a"}, zones
    assert "ZONE=us-east5-a" in text
    assert not re.search(r"\.\./|DESIGN\.md|shared/", text)
    for path in set(re.findall(r"`((?:docker|docs|dags|plugins|training|tests)/[\w./-]+\.\w+)`", text)):
        assert (REPO / path).exists(), path


# --- module hygiene ------------------------------------------------------------------------------------


def test_plugins_import_no_ml_framework() -> None:
    code = (
        "import sys; sys.path.insert(0, 'plugins')\n"
        "import rtrain_airflow.hooks.gke_tpu, rtrain_airflow.operators.gke_tpu, rtrain_airflow.triggers.gke_tpu\n"
        "heavy = ('jax', 'flax', 'optax', 'orbax', 'grain', 'tensorstore')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


# --- the production-like Airflow: docker/ ------------------------------------------------------------------

COMPOSE = REPO / "docker" / "compose.yaml"
COMPOSE_ENV = {
    "POSTGRES_PASSWORD": "pw",
    "AIRFLOW_JWT_SECRET": "jwt",
    "AIRFLOW_FERNET_KEY": "fernet",
    "GCP_PROJECT": PROJECT,
}


def test_compose_file_runs_airflow_3_components_on_postgres_with_local_executor() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())  # PyYAML resolves the << merge keys as compose does
    services = spec["services"]
    commands = {name: s.get("command") for name, s in services.items()}
    for component in ("api-server", "scheduler", "dag-processor", "triggerer"):
        assert component in commands.values(), f"no {component} service"
    assert "webserver" not in commands.values()  # the Airflow 2 name
    assert services["postgres"]["image"].startswith("postgres:")
    assert "healthcheck" in services["postgres"]
    airflow = {n: s for n, s in services.items() if n.startswith("airflow-")}
    for name, s in airflow.items():
        env = s["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor", name
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://airflow:"), name
        assert "@postgres:5432/airflow" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"], name
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"
        assert s["depends_on"]["postgres"]["condition"] == "service_healthy", name
        assert s["build"]["dockerfile"] == "docker/Dockerfile.airflow"
        assert (
            json.loads(re.sub(r"\$\{[^}]*\}", "", env["AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT"]))["conn_type"]
            == "google_cloud_platform"
        )
        if name != "airflow-init":
            assert s["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully", name
            assert "healthcheck" in s, name
    assert airflow["airflow-init"]["environment"]["_AIRFLOW_DB_MIGRATE"] == "true"
    assert (REPO / services["airflow-scheduler"]["build"]["dockerfile"]).exists()


def test_airflow_image_is_the_official_one_with_our_code() -> None:
    text = (REPO / "docker" / "Dockerfile.airflow").read_text()
    version = re.search(r"^ARG AIRFLOW_VERSION=(\S+)$", text, re.M)
    assert version and "FROM apache/airflow:${AIRFLOW_VERSION}-python3.12" in text
    pinned = re.search(r"^apache-airflow==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert pinned and version.group(1) == pinned.group(1) == "3.3.2"
    assert "--constraint constraints.txt" in text
    for path in ("dags /opt/airflow/dags", "plugins /opt/airflow/plugins"):
        assert path in text


# The Airflow containers that read or write run roots and prepared data: the scheduler (its LocalExecutor task
# processes launch the local slice and its agents, prepare data, validate), the triggerer (the deferrable watch
# reads the run root), the api-server (the plugin's /rtrain API) and the dag-processor (callbacks of tasks that
# died outside a task process run there).
RUN_ROOT_READERS = ("airflow-scheduler", "airflow-triggerer", "airflow-apiserver", "airflow-dag-processor")


def test_compose_shares_the_project_var_volume_and_names_the_training_image_once() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    mounts = {}
    for name in RUN_ROOT_READERS:
        s = services[name]
        root = s["environment"]["RTRAIN_PROJECT_ROOT"]
        assert root.startswith("/"), name
        targets = {v.split(":")[1]: v.split(":")[0] for v in s["volumes"]}
        assert f"{root}/var" in targets, f"{name}: nothing mounted at {root}/var"
        mounts[name] = (root, targets[f"{root}/var"])
    ((root, volume),) = set(mounts.values())  # one volume, at one path, in all of them
    assert volume in spec["volumes"], "the shared var/ must be a named volume of the file"
    # The image seeds the new volume writable for the airflow user (uid 50000, the compose file's user).
    dockerfile = (REPO / "docker" / "Dockerfile.airflow").read_text()
    assert f"mkdir -p {root}/var" in dockerfile and f"chown -R airflow:root {root}" in dockerfile
    assert all(s.get("user", "").startswith("50000:") for n, s in services.items() if n.startswith("airflow-"))

    # The training image: one variable, defined once (in the common environment), seen by every Airflow
    # container, and no image reference for the pods anywhere else in the file.
    text = COMPOSE.read_text()
    assert len(re.findall(r"^\s+RTRAIN_TRAIN_IMAGE:", text, re.M)) == 1
    assert all(
        s["environment"]["RTRAIN_TRAIN_IMAGE"] == "${RTRAIN_TRAIN_IMAGE:-}"
        for n, s in services.items()
        if n.startswith("airflow-")
    )

    def strings(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for k, v in node.items():
                yield str(k)
                yield from strings(v)
        elif isinstance(node, list):
            for v in node:
                yield from strings(v)
        elif isinstance(node, str):
            yield node

    assert not [s for s in strings(spec) if "/rtrain/train" in s or "Dockerfile.train" in s]


def test_resolve_takes_the_training_image_from_the_environment_unless_the_conf_names_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow.sdk.exceptions import AirflowFailException
    from rtrain_airflow.operators.training import RTrainResolveRunConfigOperator

    gke = {
        "project_id": PROJECT,
        "location": LOCATION,
        "cluster_name": CLUSTER,
        "machine_type": "ct5p-hightpu-4t",
        "tpu_topology": "2x2x4",
        "node_pools": ["p0", "p1"],
        "namespace": "training",
    }
    params = {
        "run_name": "img",
        "preset": "tiny",
        "storage_root": "gs://rtrain-prod-runs/runs",
        "dataset": "gs://rtrain-prod-runs/data/stdlib",
        "backend": "gke",
        "gke": gke,
        "min_workers": 4,
        "max_workers": 8,
        "devices_per_worker": 4,
        "chaos": [],
        "overrides": {},
    }
    op = RTrainResolveRunConfigOperator(task_id="resolve_config")
    monkeypatch.delenv("RTRAIN_TRAIN_IMAGE", raising=False)
    with pytest.raises(AirflowFailException, match="gke.image"):
        op.execute({"params": params})
    monkeypatch.setenv("RTRAIN_TRAIN_IMAGE", "")  # compose's default when the host leaves it unset
    with pytest.raises(AirflowFailException, match="gke.image"):
        op.execute({"params": params})
    monkeypatch.setenv("RTRAIN_TRAIN_IMAGE", "us-east5-docker.pkg.dev/rtrain-prod/rtrain/train:env")
    spec = op.execute({"params": params})
    assert spec["gke"] == {**gke, "image": "us-east5-docker.pkg.dev/rtrain-prod/rtrain/train:env"}
    assert spec["config"]["hosts_per_slice"] == 4
    named = op.execute({"params": {**params, "gke": {**gke, "image": "conf/train:1"}}})
    assert named["gke"]["image"] == "conf/train:1"  # the conf wins
    local = op.execute(
        {
            "params": {
                **params,
                "backend": "local",
                "storage_root": "var/runs",
                "dataset": None,
                "devices_per_worker": None,
                "gke": {},
            }
        }
    )
    assert local["gke"] == {}  # only a gke run takes it


def _compose_cli() -> list[str] | None:
    """``docker compose`` (the v2 plugin), else ``docker-compose`` (v1, e.g. Debian's package); None: neither."""
    if shutil.which("docker") is not None:
        ok = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0
        if ok:
            return ["docker", "compose"]
    if shutil.which("docker-compose") is not None:
        ok = subprocess.run(["docker-compose", "version"], capture_output=True, timeout=60).returncode == 0
        if ok:
            return ["docker-compose"]
    return None


@pytest.mark.skipif(
    _compose_cli() is None, reason="neither `docker compose` (the v2 plugin) nor `docker-compose` (v1) is installed"
)
def test_docker_compose_validates_the_file_offline() -> None:
    cli = _compose_cli()
    assert cli is not None
    image = "us-east5-docker.pkg.dev/rtrain-prod/rtrain/train:abc1234"
    env = {**os.environ, **COMPOSE_ENV, "RTRAIN_TRAIN_IMAGE": image}
    subprocess.run([*cli, "-f", str(COMPOSE), "config", "--quiet"], env=env, check=True, timeout=60)
    # The resolved file: the image given once on the host reaches every Airflow container, with the project root.
    out = subprocess.run(
        [*cli, "-f", str(COMPOSE), "config"], env=env, check=True, capture_output=True, text=True, timeout=60
    )
    resolved = yaml.safe_load(out.stdout)["services"]
    for name in RUN_ROOT_READERS:
        assert resolved[name]["environment"]["RTRAIN_TRAIN_IMAGE"] == image, name
        assert resolved[name]["environment"]["RTRAIN_PROJECT_ROOT"] == "/opt/rtrain", name
    missing = {k: v for k, v in env.items() if k != "AIRFLOW_JWT_SECRET"}
    bad = subprocess.run(
        [*cli, "-f", str(COMPOSE), "config", "--quiet"], env=missing, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0 and "AIRFLOW_JWT_SECRET" in bad.stderr


def gke_conf(**keys: Any) -> dict[str, Any]:
    """The DAG conf's ``gke`` object for the fake cluster: a v6e 4x4 shape unless ``keys`` say otherwise."""
    base = {"project_id": PROJECT, "location": LOCATION, "cluster_name": CLUSTER}
    return {**base, "machine_type": "ct6e-standard-4t", "tpu_topology": "4x4", "image": "img", **keys}


def test_the_gke_backend_provisions_for_min_workers_and_reports_each_pool(
    hook: GKETPUHook, fake: FakeClusterManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    gke = gke_conf(node_pools=[f"slice-{i}" for i in range(4)])
    backend = GKEBackend(gke, ProviderCluster(gke))
    monkeypatch.setattr(backend.cluster, "gke_hook", lambda: hook)
    cfg = load_config("tiny", None, {"root": "gs://b/runs", "min_workers": 8, "max_workers": 16, "hosts_per_slice": 4})
    fake.fail_pools["slice-1"] = "ZONE_RESOURCE_POOL_EXHAUSTED"
    fake.slow_pools["slice-3"] = 1000
    result = backend.provision(cfg, {"gke": gke})
    assert result["need"] == 2, "8 hosts of 4-host slices"
    assert sorted(result["node_pools_up"]) == ["slice-0", "slice-2"] and result["node_pools_creating"] == ["slice-3"]
    assert list(result["node_pools_failed"]) == ["slice-1"]
    fake.fail_pools["slice-1"] = "ZONE_RESOURCE_POOL_EXHAUSTED"
    cfg_all = load_config(
        "tiny", None, {"root": "gs://b/runs", "min_workers": 16, "max_workers": 16, "hosts_per_slice": 4}
    )
    with pytest.raises(TPUNodePoolError, match="of the 4 node pools the job needs at least are up"):
        backend.gke["provision_timeout_s"] = 0.05
        backend.provision(cfg_all, {"gke": gke})


def test_queued_provisioning_needs_flex_start_and_a_kueue_queue() -> None:
    gke = {k: "x" for k in GKEBackend.REQUIRED} | {"node_pools": ["p"], "queued_provisioning": True}
    with pytest.raises(BackendError, match="needs gke.kueue_queue"):
        GKEBackend({**gke, "flex_start": True})
    with pytest.raises(BackendError, match="flex-start pools only"):
        GKEBackend({**gke, "kueue_queue": "q"})
    GKEBackend({**gke, "flex_start": True, "kueue_queue": "q"})


def test_the_gke_backend_makes_flex_start_pools_when_the_conf_asks(
    hook: GKETPUHook, fake: FakeClusterManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    gke = gke_conf(
        machine_type="ct5p-hightpu-4t",
        tpu_topology="2x2x2",
        node_pools=["slice-0", "slice-1"],
        flex_start=True,
        queued_provisioning=True,
        kueue_queue="tpu-v5p",
    )
    backend = GKEBackend(gke, ProviderCluster(gke))
    monkeypatch.setattr(backend.cluster, "gke_hook", lambda: hook)
    cfg = load_config("tiny", None, {"root": "gs://b/runs", "min_workers": 2, "max_workers": 4, "hosts_per_slice": 2})
    assert sorted(backend.provision(cfg, {"gke": gke})["node_pools_up"]) == ["slice-0", "slice-1"]
    pools = list(fake.pools.values())
    assert len(pools) == 2 and all(p.config.flex_start and p.queued_provisioning.enabled for p in pools)
    assert all(p.initial_node_count == 0 and p.autoscaling.total_max_node_count == 2 for p in pools)


def test_the_sensor_s_log_says_why_pods_wait_once_per_change(
    k8s: tuple[FakeKubernetes, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import structlog
    from rtrain_airflow.hooks.training import RTrainHook
    from rtrain_airflow.triggers.training import RTrainTrainingJobTrigger

    from training.events import write_status
    from training.storage import open_store

    api, url = k8s
    hook = jobset_hook(url)
    cfg = load_config(overrides={**CONFIG, "hosts_per_slice": 4})
    m = render(cfg, TPUSlice("ct6e-standard-4t", "4x4"), GKELaunch(image="img:1", namespace="training"), "j8")
    hook.create(m)
    api.pods = [pod(f"{m.name}-slice-0-0", m.name, IMAGE_PULL)]
    gke: dict[str, Any] = {"location": LOCATION, "cluster_name": CLUSTER, "machine_type": "ct6e-standard-4t"}
    gke |= {"tpu_topology": "4x4", "image": "img:1", "node_pools": ["slice-0"]}
    backend = GKEBackend(gke, ProviderCluster(gke))
    monkeypatch.setattr(backend.cluster, "jobsets", lambda: hook)
    monkeypatch.setattr(RTrainHook, "backend", lambda self, *a, **k: backend)
    run = str(tmp_path / "run")
    store = open_store(run)
    write_status(store, state="pending", job="j8")
    h: dict[str, Any] = {"backend": "gke", "run_uri": run, "job": "j8", "jobset": m.name, "namespace": "training"}
    h |= {"launched_at": time.time(), "events_after": None, "attached": False}

    def later() -> None:
        time.sleep(0.6)
        other_message = copy.deepcopy(IMAGE_PULL)
        other_message["containerStatuses"][0]["state"]["waiting"]["message"] = "ErrImagePull again"
        api.pods = [pod(f"{m.name}-slice-0-0", m.name, other_message)]  # the same reason: not told again
        time.sleep(0.6)
        api.pods = [pod(f"{m.name}-slice-0-0", m.name, RUNNING)]
        time.sleep(0.6)
        write_status(store, state="finished", job="j8", step=10)

    t = threading.Thread(target=later)
    t.start()
    trigger = RTrainTrainingJobTrigger(run, h, poll_interval=0.1, progress_every_s=0)
    with structlog.testing.capture_logs() as logs:
        event = asyncio.run(asyncio.wait_for(anext(aiter(trigger.run())), 30)).payload
    t.join()
    assert event["status"] == "success", event
    lines = [str(r["event"]) for r in logs if str(r["event"]).startswith("[rtrain] ")]
    waits = [line for line in lines if "pod" in line]
    assert waits == [
        '[rtrain] pods waiting: 1 pod ImagePullBackOff (Back-off pulling image "img:1"): the nodes cannot pull the '
        "image: check gke.image, and the node pool's scopes and service account (Artifact Registry reader, "
        "docs/gke.md section 2)",
        "[rtrain] no pod waits any more",
    ], lines
    # The same, on the run's record: the Training view's timeline tells it.
    from rtrain_airflow.runview import chart_data

    from training.events import EventLog, describe

    told = [e for e in EventLog(store).read() if e["type"] == "pods_waiting"]
    assert [e["reason"].split(" (")[0] for e in told] == ["1 pod ImagePullBackOff", ""]
    assert describe(told[1]) == "no pod waits any more" and describe(told[0]).startswith("pods waiting: 1 pod")
    timeline = [
        row for row in chart_data(EventLog(store).read(), {}, None)["timeline"] if row["type"] == "pods_waiting"
    ]
    assert [row["text"] for row in timeline] == [describe(e) for e in told]
