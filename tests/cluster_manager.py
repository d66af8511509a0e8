"""An in-process GKE ClusterManager: the real ``google.container.v1.ClusterManager`` gRPC service on 127.0.0.1.

The engine's ``ClusterManagerClient`` talks to it over a real gRPC channel, so the requests are the
real ``container_v1`` messages on the wire and the errors are the real status codes, which the client
turns into the real ``google.api_core`` exceptions (FAILED_PRECONDITION -> FailedPrecondition, a 429's
RESOURCE_EXHAUSTED -> ResourceExhausted).  Behind it, an in-memory cluster's node pools: an operation
is RUNNING for ``polls`` looks, then DONE and in effect.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
from google.api_core.exceptions import AlreadyExists, GoogleAPICallError, NotFound
from google.auth.credentials import AnonymousCredentials
from google.cloud import container_v1
from google.cloud.container_v1.services.cluster_manager.transports import ClusterManagerGrpcTransport

Status = container_v1.Operation.Status
PoolStatus = container_v1.NodePool.Status
SERVICE = "google.container.v1.ClusterManager"


class FakeClusterManager:
    """An in-memory cluster's node pools behind the ClusterManager methods the engine calls.

    ``refuse_next[pool]``: exceptions its next create calls raise, one per call (nothing is made);
    ``refuse_deletes``: exceptions the next delete calls raise; ``fail_pools[pool]``: the error its
    create operation ends with (the pool is left in ERROR); ``slow_pools[pool]``: looks its create operation runs for.
    """

    CLUSTER_RE = re.compile(r"^projects/([^/]+)/locations/([^/]+)/clusters/([^/]+)$")
    POOL_RE = re.compile(r"^(projects/[^/]+/locations/[^/]+/clusters/[^/]+)/nodePools/([a-z][-a-z0-9]*)$")
    OP_RE = re.compile(r"^projects/([^/]+)/locations/([^/]+)/operations/(operation-\d+)$")

    def __init__(self, clusters: tuple[str, ...] = (), polls: int = 2, version: str = "1.33.5-gke.1308000") -> None:
        self.clusters = set(clusters)
        self.version = version  # the control plane's GKE version
        self.ca_certificate = ""  # the control plane's CA, base64 (as the GKE API serves it)
        self.polls = polls
        self.pools: dict[str, container_v1.NodePool] = {}
        self.ops: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []  # (method, resource name), in order
        self.refuse_next: dict[str, list[GoogleAPICallError]] = {}
        self.refuse_deletes: list[GoogleAPICallError] = []
        self.fail_pools: dict[str, str] = {}
        self.slow_pools: dict[str, int] = {}  # pool name -> looks its create operation runs for
        self.lock = threading.Lock()
        self._ids = itertools.count(1)

    def _start(self, type_: container_v1.Operation.Type, path: str, effect: Callable[[], Any], error: str = "") -> Any:
        project, location = path.split("/")[1], path.split("/")[3]
        name = f"operation-{next(self._ids)}"
        self.ops[name] = {"where": (project, location), "type": type_, "target": path, "effect": effect, "error": error}
        self.ops[name]["looks"] = 0
        return container_v1.Operation(name=name, operation_type=type_, status=Status.PENDING, target_link=path)

    def _pool(self, name: str) -> container_v1.NodePool:
        if not self.POOL_RE.match(name):
            raise ValueError(f"bad node pool name {name}")
        if name not in self.pools:
            raise NotFound(f'Node pool "{name}" not found.')
        return self.pools[name]

    def get_cluster(self, request: container_v1.GetClusterRequest) -> container_v1.Cluster:
        self.calls.append(("get_cluster", request.name))
        if request.name not in self.clusters:
            raise NotFound(f'Not found: "{request.name}".')
        name = request.name.rsplit("/", 1)[-1]
        return container_v1.Cluster(
            name=name,
            endpoint="127.0.0.1",
            status=2,
            current_master_version=self.version,
            master_auth=container_v1.MasterAuth(cluster_ca_certificate=self.ca_certificate),
        )

    def create_node_pool(self, request: container_v1.CreateNodePoolRequest) -> container_v1.Operation:
        assert self.CLUSTER_RE.match(request.parent), request.parent
        name = request.node_pool.name
        path = f"{request.parent}/nodePools/{name}"
        self.calls.append(("create", path))
        if self.refuse_next.get(name):
            raise self.refuse_next[name].pop(0)
        if path in self.pools:
            raise AlreadyExists(f"Already exists: {path}.")
        pool = container_v1.NodePool(request.node_pool)
        pool.status = PoolStatus.PROVISIONING
        self.pools[path] = pool
        error = self.fail_pools.get(name, "")

        def effect() -> None:
            if error:
                pool.status, pool.status_message = PoolStatus.ERROR, error
            else:
                pool.status = PoolStatus.RUNNING

        op = self._start(container_v1.Operation.Type.CREATE_NODE_POOL, path, effect, error)
        self.ops[op.name]["need"] = self.slow_pools.get(name, self.polls)
        return op

    def get_node_pool(self, request: container_v1.GetNodePoolRequest) -> container_v1.NodePool:
        self.calls.append(("get", request.name))
        return container_v1.NodePool(self._pool(request.name))

    def delete_node_pool(self, request: container_v1.DeleteNodePoolRequest) -> container_v1.Operation:
        self.calls.append(("delete", request.name))
        if self.refuse_deletes:
            raise self.refuse_deletes.pop(0)
        pool = self._pool(request.name)
        pool.status = PoolStatus.STOPPING
        return self._start(
            container_v1.Operation.Type.DELETE_NODE_POOL, request.name, lambda: self.pools.pop(request.name)
        )

    def get_operation(self, request: container_v1.GetOperationRequest) -> container_v1.Operation:
        m = self.OP_RE.match(request.name)
        if not m:
            raise ValueError(f"bad operation name {request.name}")
        op = self.ops.get(m.group(3))
        if op is None or op["where"] != (m.group(1), m.group(2)):
            raise NotFound(f"Operation {request.name} not found.")
        op["looks"] += 1
        done = op["looks"] >= op.get("need", self.polls)
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
            out.error = {"code": 8, "message": op["error"]}
        return out

    def pool(self, path: str) -> container_v1.NodePool | None:
        return self.pools.get(path)


METHODS: dict[str, tuple[str, Any, Any]] = {
    "GetCluster": ("get_cluster", container_v1.GetClusterRequest, container_v1.Cluster),
    "CreateNodePool": ("create_node_pool", container_v1.CreateNodePoolRequest, container_v1.Operation),
    "GetNodePool": ("get_node_pool", container_v1.GetNodePoolRequest, container_v1.NodePool),
    "DeleteNodePool": ("delete_node_pool", container_v1.DeleteNodePoolRequest, container_v1.Operation),
    "GetOperation": ("get_operation", container_v1.GetOperationRequest, container_v1.Operation),
}


def _handler(fake: FakeClusterManager, method: str) -> Callable[[Any, grpc.ServicerContext], Any]:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        with fake.lock:
            try:
                return getattr(fake, method)(request)
            except GoogleAPICallError as e:
                assert e.grpc_status_code is not None
                context.abort(e.grpc_status_code, e.message)

    return handle


@contextmanager
def serve(fake: FakeClusterManager) -> Iterator[container_v1.ClusterManagerClient]:
    """The fake behind a real gRPC server on 127.0.0.1, and a real ``ClusterManagerClient`` connected to it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _handler(fake, method), request_deserializer=req.deserialize, response_serializer=resp.serialize
        )
        for name, (method, req, resp) in METHODS.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        transport = ClusterManagerGrpcTransport(channel=channel, credentials=AnonymousCredentials())
        yield container_v1.ClusterManagerClient(transport=transport)
    finally:
        channel.close()
        server.stop(grace=None)
