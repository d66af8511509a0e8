"""The engine's GKE calls: TPU node pools through the real ``ClusterManagerClient`` over gRPC, retried when worth it.

The client talks to an in-process ClusterManager service on 127.0.0.1 (``cluster_manager.py``): the
requests are the real ``container_v1`` messages, the refusals real gRPC status codes that the client
turns into the real ``google.api_core`` exceptions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from cluster_manager import FakeClusterManager, PoolStatus, serve
from google.api_core.exceptions import FailedPrecondition, PermissionDenied, ResourceExhausted, ServiceUnavailable
from google.cloud import container_v1

from training.backends import BackendError
from training.backends.gke_cluster import CloudCluster
from training.backends.gke_pools import Backoff, NodePools, TPUNodePoolError, TPUNodePoolSpec
from training.gke import GKESettings

PROJECT, LOCATION, CLUSTER, ZONE = "rtrain-prod", "us-west4", "train", "us-west4-a"
CLUSTER_PATH = f"projects/{PROJECT}/locations/{LOCATION}/clusters/{CLUSTER}"
FAST = Backoff(base_s=0.02, max_s=0.08)
BUSY = "Cluster is running incompatible operation operation-1764966000000-abcd. Please wait and try again."
TOO_MANY = 'Too many operations: cluster "train" hits the concurrent operations quota 5, please try again later.'


@pytest.fixture
def fake() -> FakeClusterManager:
    return FakeClusterManager(clusters=(CLUSTER_PATH,))


@pytest.fixture
def client(fake: FakeClusterManager) -> Iterator[container_v1.ClusterManagerClient]:
    with serve(fake) as c:
        yield c


def pools(client: container_v1.ClusterManagerClient) -> NodePools:
    return NodePools(client, PROJECT, LOCATION, CLUSTER, logging.getLogger("test"), poll_s=0.01, backoff=FAST)


def specs(n: int, spot: bool = True) -> list[TPUNodePoolSpec]:
    return [
        TPUNodePoolSpec(f"slice-{i}", "ct5lp-hightpu-4t", "2x4", spot=spot, node_locations=(ZONE,)) for i in range(n)
    ]


def creates(fake: FakeClusterManager, pool: str) -> int:
    return sum(1 for m, name in fake.calls if m == "create" and name.endswith("/" + pool))


def test_the_client_sends_the_real_create_request_over_grpc(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    up = pools(client).create_all(specs(2), need=2, timeout_s=10)
    assert sorted(up.ready) == ["slice-0", "slice-1"] and up.failed == {}
    made = fake.pool(f"{CLUSTER_PATH}/nodePools/slice-0")
    assert made is not None and made.status == PoolStatus.RUNNING
    assert (made.config.machine_type, made.placement_policy.tpu_topology, made.initial_node_count) == (
        "ct5lp-hightpu-4t",
        "2x4",
        2,
    )
    assert made.config.spot and list(made.locations) == [ZONE]


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (FailedPrecondition(BUSY), "another operation is running on the cluster"),
        (ResourceExhausted(TOO_MANY), "concurrent-operations limit (429)"),
    ],
)
def test_a_busy_cluster_and_a_429_are_sent_again_with_backoff_and_the_pool_comes_up(
    fake: FakeClusterManager,
    client: container_v1.ClusterManagerClient,
    caplog: pytest.LogCaptureFixture,
    error: Exception,
    words: str,
) -> None:
    fake.refuse_next["slice-1"] = [error, error, error]
    caplog.set_level(logging.WARNING)
    up = pools(client).create_all(specs(2), need=2, timeout_s=10)
    assert sorted(up.ready) == ["slice-0", "slice-1"] and up.failed == {}
    assert creates(fake, "slice-1") == 4 and creates(fake, "slice-0") == 1
    said = caplog.text
    assert words in said and "quota for" not in said and "project's quota" not in said


def test_resends_wait_longer_each_time(fake: FakeClusterManager, client: container_v1.ClusterManagerClient) -> None:
    fake.refuse_next["slice-0"] = [FailedPrecondition(BUSY)] * 3
    t0 = time.monotonic()
    pools(client).create_all(specs(1), need=1, timeout_s=10)
    assert time.monotonic() - t0 >= 0.02 + 0.04 + 0.08  # the backoff's three waits, doubling up to its cap
    assert [FAST.delay(n) for n in (1, 2, 3, 4)] == [0.02, 0.04, 0.08, 0.08]


def test_a_cluster_busy_past_the_timeout_fails_saying_so_not_as_a_quota(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    fake.refuse_next["slice-0"] = [ResourceExhausted(TOO_MANY)] * 1000
    with pytest.raises(TPUNodePoolError) as e:
        pools(client).create_all(specs(1), need=1, timeout_s=0.5)
    msg = str(e.value)
    assert "0 of the 1 node pools" in msg and "concurrent-operations limit (429)" in msg
    assert "quota for" not in msg


def test_a_stockout_names_the_zone_and_the_shape_and_is_not_retried(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    fake.fail_pools["slice-1"] = "ZONE_RESOURCE_POOL_EXHAUSTED: The zone does not have enough resources."
    up = pools(client).create_all(specs(2), need=1, timeout_s=10)
    assert up.ready == ["slice-0"]
    why = up.failed["slice-1"]
    assert why.startswith(f"no ct5lp-hightpu-4t 2x4 capacity left in {ZONE} (a stockout)")
    assert creates(fake, "slice-1") == 1


def test_a_stockout_refused_by_the_call_is_final_too(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    fake.refuse_next["slice-0"] = [ResourceExhausted("GCE_STOCKOUT: no capacity for ct5lp-hightpu-4t")]
    with pytest.raises(TPUNodePoolError, match=f"no ct5lp-hightpu-4t 2x4 capacity left in {ZONE}"):
        pools(client).create_all(specs(1), need=1, timeout_s=5)
    assert creates(fake, "slice-0") == 1


def test_the_project_s_tpu_quota_is_named_as_such(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    fake.fail_pools["slice-0"] = "Insufficient quota to satisfy the request: 'TPUV5_LITEPOD_SPOT_CHIPS' exceeded."
    with pytest.raises(TPUNodePoolError, match="over the project's quota for ct5lp-hightpu-4t 2x4 in us-west4-a"):
        pools(client).create_all(specs(1), need=1, timeout_s=5)


def test_a_refusal_for_good_is_not_sent_again(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    fake.refuse_next["slice-0"] = [PermissionDenied("Required 'container.clusters.update' permission")]
    with pytest.raises(TPUNodePoolError, match="container.clusters.update"):
        pools(client).create_all(specs(1), need=1, timeout_s=5)
    assert creates(fake, "slice-0") == 1


def test_deletes_refused_for_now_are_sent_again(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    p = pools(client)
    p.create_all(specs(2), need=2, timeout_s=10)
    fake.refuse_deletes = [FailedPrecondition(BUSY), ResourceExhausted(TOO_MANY)]
    assert p.delete_all(["slice-0", "slice-1", "slice-9"], timeout_s=10) == ["slice-0", "slice-1", "slice-9"]
    assert fake.pools == {}


def settings(**keys: object) -> GKESettings:
    gke = {
        "project_id": PROJECT,
        "location": LOCATION,
        "cluster_name": CLUSTER,
        "machine_type": "ct5lp-hightpu-4t",
        "tpu_topology": "2x4",
        "image": "us-west4-docker.pkg.dev/rtrain-prod/rtrain/train:abc",
        "node_pools": ["slice-0", "slice-1"],
        "node_locations": [ZONE],
        "spot": True,
    }
    return GKESettings(**{**gke, **keys})  # type: ignore[typeddict-item]


def test_the_cloud_cluster_finds_its_cluster_or_says_in_one_line_which_is_missing(
    client: container_v1.ClusterManagerClient,
) -> None:
    from google.auth.credentials import AnonymousCredentials

    found = CloudCluster(settings(), AnonymousCredentials(), cluster_manager=client).check()
    assert found.name == CLUSTER
    with pytest.raises(BackendError) as e:
        CloudCluster(settings(cluster_name="nope"), AnonymousCredentials(), cluster_manager=client).check()
    assert str(e.value) == f"gke.cluster_name: no cluster 'nope' in project {PROJECT}, location {LOCATION}"
    no_project = settings()
    del no_project["project_id"]
    with pytest.raises(BackendError, match=r"^gke.project_id: no Google Cloud project"):
        CloudCluster(no_project, AnonymousCredentials(), cluster_manager=client).check()


def test_the_cloud_cluster_provisions_the_settings_pools_and_deletes_them(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    from google.auth.credentials import AnonymousCredentials

    cluster = CloudCluster(settings(), AnonymousCredentials(), cluster_manager=client, poll_s=0.01, backoff=FAST)
    fake.refuse_next["slice-0"] = [FailedPrecondition(BUSY)]
    up = cluster.create_node_pools(need=2, timeout_s=10)
    assert sorted(up.ready) == ["slice-0", "slice-1"]
    assert cluster.delete_node_pools() == ["slice-0", "slice-1"] and fake.pools == {}
    # A Spot grace the settings ask for (the cluster's version allowing it) reaches the pools' kubelet.
    fake.version = "1.35.0-gke.1171000"
    longer = CloudCluster(
        settings(spot_shutdown_grace_s=120), AnonymousCredentials(), cluster_manager=client, poll_s=0.01, backoff=FAST
    )
    longer.create_node_pools(need=2, timeout_s=10)
    made = fake.pool(f"{CLUSTER_PATH}/nodePools/slice-1")
    assert made.config.kubelet_config.shutdown_grace_period_seconds == 120


def test_an_existing_pool_of_the_same_shape_is_success_and_of_another_an_error(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    p = pools(client)
    p.create_all(specs(1), need=1, timeout_s=10)
    fake.calls.clear()
    assert p.create_all(specs(1), need=1, timeout_s=10).ready == ["slice-0"]
    assert [m for m, _ in fake.calls] == ["create", "get", "get"]  # AlreadyExists: the pool is looked at
    with pytest.raises(TPUNodePoolError, match="spot=True, not False"):
        p.create_all(specs(1, spot=False), need=1, timeout_s=10)


def test_a_pool_an_earlier_try_left_in_error_is_deleted_and_made_again(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    fake.fail_pools["slice-1"] = "ZONE_RESOURCE_POOL_EXHAUSTED"
    p = pools(client)
    assert p.create_all(specs(2), need=1, timeout_s=10).ready == ["slice-0"]
    assert fake.pool(f"{CLUSTER_PATH}/nodePools/slice-1").status == PoolStatus.ERROR  # what a stockout leaves
    fake.fail_pools.clear()  # the capacity came back
    fake.calls.clear()
    up = p.create_all(specs(2), need=2, timeout_s=10)
    assert sorted(up.ready) == ["slice-0", "slice-1"] and [m for m, _ in fake.calls].count("delete") == 1


def test_enough_pools_up_is_done_and_too_few_fails_naming_each_pool_s_fate(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    fake.slow_pools["slice-2"] = 10**6
    up = pools(client).create_all(specs(3), need=2, timeout_s=10)
    assert sorted(up.ready) == ["slice-0", "slice-1"] and up.creating == ["slice-2"]
    fake.pools.clear()
    fake.fail_pools["slice-1"] = "ZONE_RESOURCE_POOL_EXHAUSTED"
    with pytest.raises(TPUNodePoolError) as e:
        pools(client).create_all(specs(3), need=3, timeout_s=0.3)
    msg = str(e.value)
    assert msg.startswith("1 of the 3 node pools the job needs at least are up (slice-0)")
    assert (
        "slice-1: no ct5lp-hightpu-4t 2x4 capacity left in us-west4-a" in msg and "slice-2: still being created" in msg
    )


def test_an_unavailable_service_is_asked_again(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    fake.refuse_next["slice-0"] = [ServiceUnavailable("The service is currently unavailable.")]
    assert pools(client).create_all(specs(1), need=1, timeout_s=10).ready == ["slice-0"]


def test_the_cloud_cluster_looks_its_cluster_up_once_and_close_gives_back_its_clients_and_one_ca_file_serves_all(
    fake: FakeClusterManager, client: container_v1.ClusterManagerClient
) -> None:
    import base64
    import glob
    import os
    import tempfile
    import uuid

    from google.auth.credentials import AnonymousCredentials

    pem = f"-----BEGIN CERTIFICATE-----\nMIIB{uuid.uuid4().hex}\n-----END CERTIFICATE-----\n".encode()
    fake.ca_certificate = base64.b64encode(pem).decode()
    with CloudCluster(settings(), AnonymousCredentials(), cluster_manager=client) as cluster:
        api = cluster.api_client()
        for _ in range(3):  # the trigger's looks: the same client, no new lookup, no new CA file
            assert cluster.jobsets().api_client is api
            cluster.check()
        ca = api.configuration.ssl_ca_cert
        assert ca is not None and open(ca, "rb").read() == pem
        assert [m for m, _ in fake.calls].count("get_cluster") == 1
        api.rest_client.pool_manager.connection_from_host("127.0.0.1", 443, "https")  # a connection it holds
        assert len(api.rest_client.pool_manager.pools) == 1
    assert len(api.rest_client.pool_manager.pools) == 0
    for _ in range(3):  # a watch or task each (a new cluster object): the same CA file, no new one
        with CloudCluster(settings(), AnonymousCredentials(), cluster_manager=client) as again:
            assert again.api_client().configuration.ssl_ca_cert == ca
    assert os.path.exists(ca) and [
        p for p in glob.glob(os.path.join(tempfile.gettempdir(), "rtrain-gke-ca-*")) if open(p, "rb").read() == pem
    ] == [ca]
    assert (
        client.get_cluster(request=container_v1.GetClusterRequest(name=CLUSTER_PATH)).name == CLUSTER
    )  # not closed: given
    os.unlink(ca)  # this test's own CA
