"""The node pool requests the engine builds: real ``google.cloud.container_v1`` messages, field by field and as JSON.

Checked for each TPU machine type and topology, Spot, flex-start, reservations, networks and placement.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.cloud import container_v1

from training.backends.gke_pools import PoolRequests, TPUNodePoolSpec
from training.gke import GKEConfigError, TPUSlice

PROJECT, LOCATION, CLUSTER = "rtrain-prod", "us-east5", "train"
# Building a request calls nothing: no client is made.
POOLS = PoolRequests(PROJECT, LOCATION, CLUSTER)


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
    machine_type: str, topology: str, nodes: int, placement_topology: str
) -> None:
    spec = TPUNodePoolSpec(name="slice-0", machine_type=machine_type, tpu_topology=topology)
    req = POOLS.create_request(spec)
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


def test_create_request_for_spot_networks_zones_and_placement() -> None:
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
    pool = POOLS.create_request(spec).node_pool
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
def test_single_host_pools_get_compact_placement_when_asked(policy: str | None, wire_policy: dict[str, str]) -> None:
    spec = TPUNodePoolSpec(
        name="singles",
        machine_type="ct6e-standard-4t",
        tpu_topology="2x2",
        num_slices=4,
        compact_placement=True,
        placement_policy=policy,
    )
    wire = sent(POOLS.create_request(spec))
    assert wire["nodePool"]["placementPolicy"] == {"type": "COMPACT", **wire_policy}  # and no tpuTopology
    plain = TPUNodePoolSpec(name="singles", machine_type="ct6e-standard-4t", tpu_topology="2x2")
    assert "placementPolicy" not in sent(POOLS.create_request(plain))["nodePool"]


def test_multi_host_pools_send_their_topology_and_nothing_else_as_placement() -> None:
    spec = TPUNodePoolSpec(name="slice-0", machine_type="ct5p-hightpu-4t", tpu_topology="2x2x4", compact_placement=True)
    wire = sent(POOLS.create_request(spec))
    assert wire["nodePool"]["placementPolicy"] == {"tpuTopology": "2x2x4"}


def test_node_auto_upgrade_is_what_the_spec_says() -> None:
    """An upgrade recreates a slice mid-run: off where GKE allows it (no release channel), else an exclusion."""
    base = {"name": "slice-0", "machine_type": "ct6e-standard-4t", "tpu_topology": "4x4"}
    default = POOLS.create_request(TPUNodePoolSpec(**base)).node_pool
    # GKE refuses auto_upgrade=false on a release-channel cluster (docs/gke.md §4's); there the maintenance
    # exclusion of §4 keeps upgrades off the training pools.
    assert default.management.auto_upgrade is True and default.management.auto_repair is True
    off = POOLS.create_request(TPUNodePoolSpec(**base, auto_upgrade=False))
    assert off.node_pool.management.auto_upgrade is False and off.node_pool.management.auto_repair is True
    assert sent(off)["nodePool"]["management"] == {"autoRepair": True}  # autoUpgrade: false (the default)
    docs = (Path(__file__).resolve().parents[2] / "docs" / "gke.md").read_text()
    assert "--add-maintenance-exclusion-scope=no_minor_or_node_upgrades" in docs


def test_spot_pools_can_give_the_pods_more_shutdown_grace() -> None:
    base = {"name": "slice-0", "machine_type": "ct6e-standard-4t", "tpu_topology": "4x4", "spot": True}
    assert TPUNodePoolSpec(**base).pod_grace_s == 15  # GKE's default: 30 s, 15 of them for system pods
    default = sent(POOLS.create_request(TPUNodePoolSpec(**base)))
    assert "kubeletConfig" not in default["nodePool"]["config"]
    spec = TPUNodePoolSpec(**base, spot_shutdown_grace_s=120)
    assert spec.pod_grace_s == 105
    wire = sent(POOLS.create_request(spec))
    assert wire["nodePool"]["config"]["kubeletConfig"] == {
        "shutdownGracePeriodSeconds": 120,
        "shutdownGracePeriodCriticalPodsSeconds": 15,
    }


@pytest.mark.parametrize("queued", [False, True])
def test_flex_start_pools_are_created_empty_and_scale_to_their_slice(queued: bool) -> None:
    spec = TPUNodePoolSpec(
        name="slice-flex",
        machine_type="ct5p-hightpu-4t",
        tpu_topology="2x2x4",
        flex_start=True,
        queued_provisioning=queued,
    )
    pool = sent(POOLS.create_request(spec))["nodePool"]
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
    plain = sent(POOLS.create_request(TPUNodePoolSpec(name="s", machine_type="ct5p-hightpu-4t", tpu_topology="2x2x4")))
    assert "autoscaling" not in plain["nodePool"] and "flexStart" not in plain["nodePool"]["config"]


def test_create_request_for_a_reservation() -> None:
    spec = TPUNodePoolSpec(
        name="slice-r",
        machine_type="ct5p-hightpu-4t",
        tpu_topology="2x2x2",
        reservation="projects/shared-capacity/reservations/v5p-res",
    )
    affinity = POOLS.create_request(spec).node_pool.config.reservation_affinity
    assert affinity.consume_reservation_type == container_v1.ReservationAffinity.Type.SPECIFIC_RESERVATION
    assert affinity.key == "compute.googleapis.com/reservation-name"
    assert list(affinity.values) == ["projects/shared-capacity/reservations/v5p-res"]


def test_single_host_pools_hold_num_slices_nodes() -> None:
    spec = TPUNodePoolSpec(name="singles", machine_type="ct6e-standard-4t", tpu_topology="2x2", num_slices=6)
    assert POOLS.create_request(spec).node_pool.initial_node_count == 6


def test_resize_and_delete_requests_name_the_pool() -> None:
    path = f"projects/{PROJECT}/locations/{LOCATION}/clusters/{CLUSTER}/nodePools/slice-0"
    resize = POOLS.resize_request("slice-0", 0)
    assert isinstance(resize, container_v1.SetNodePoolSizeRequest) and resize.name == path and resize.node_count == 0
    delete = POOLS.delete_request("slice-0")
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
