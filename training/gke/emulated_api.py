"""The emulated cluster's API server: the few calls a slice's own repairs make, over HTTP on 127.0.0.1.

What :class:`training.gke.pod_emulator.EmulatedJobSet` serves when asked (``serve_api``), so that the
pods' own processes reach their cluster as a pod reaches the real one: list the JobSet's pods, list
the nodes, delete a pod, delete a child Job.  A delete honours ``DeleteOptions.preconditions.uid``
(409 Conflict when the object is another one now), as the API server does.  Nothing else is served.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlparse

from training.gke.names import NODEPOOL_LABEL, K8sObject, child_job_name
from training.gke.pod_specs import Node, Pod, job_container

# (method, path pattern) -> what the cluster does; each returns (HTTP status, the response's body).
Route = Callable[[re.Match[str], Mapping[str, list[str]], K8sObject], tuple[int, K8sObject]]


class EmulatedCluster(Protocol):
    """What the API server asks of the emulated cluster (``EmulatedJobSet`` is one)."""

    def api_pods(self, namespace: str, selector: Mapping[str, str]) -> list[K8sObject]: ...

    def api_nodes(self) -> list[K8sObject]: ...

    def api_delete_pod(self, namespace: str, name: str, uid: str) -> int:
        """Delete a pod: 200, 404 (none) or 409 (another pod has the name now)."""
        ...

    def api_delete_job(self, namespace: str, name: str, uid: str) -> int:
        """Delete a child Job: 200, 404 (none) or 409 (the Job of that name is another one now)."""
        ...


class ClusterAPI:
    """The emulated cluster's side of the calls :class:`EmulatedAPI` serves (an :class:`EmulatedCluster`)."""

    jobset: K8sObject
    job_spec: K8sObject
    slices: int
    nodes: dict[str, Node]
    deleting_jobs: set[int]
    _lock: threading.RLock

    def _pods(self) -> list[Pod]:
        raise NotImplementedError

    def objects(self) -> list[K8sObject]:
        raise NotImplementedError

    def job_uid(self, j: int) -> str:
        raise NotImplementedError

    def delete_job(self, slice_: int) -> None:
        raise NotImplementedError

    def _delete_pod(self, pod: Pod, disruption: str, grace_s: float | None) -> None:
        raise NotImplementedError

    def api_pods(self, namespace: str, selector: Mapping[str, str]) -> list[K8sObject]:
        """The pods a list call with a label selector gets."""
        if namespace != self.jobset["metadata"]["namespace"]:
            return []
        image = job_container(self.job_spec)["image"]
        out = []
        for o in self.objects():
            have = o["metadata"].get("labels") or {}
            if all(k in have and v in ("", have[k]) for k, v in selector.items()):
                for cs in o["status"].get("containerStatuses") or []:  # what the kubelet reports beside the state
                    cs.update(image=image, imageID=f"{image}@sha256:0", ready="running" in cs["state"], restartCount=0)
                out.append(o)
        return out

    def api_nodes(self) -> list[K8sObject]:
        """The nodes that exist (a deleted one is gone), with their pool."""
        with self._lock:
            return [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": n.name, "labels": {NODEPOOL_LABEL: n.pool}},
                    "spec": {},
                    "status": {"conditions": [{"type": "Ready", "status": "True" if n.ready else "False"}]},
                }
                for n in self.nodes.values()
                if n.deleted_at is None
            ]

    def api_delete_pod(self, namespace: str, name: str, uid: str) -> int:
        """A pod's delete: a terminated one is gone at once (the Job has accounted it), a live or pending one is
        deleted as the API deletes it (a running one gets its grace)."""
        with self._lock:
            found = [p for p in self._pods() if p.name == name and not p.removed]
            if not found or namespace != self.jobset["metadata"]["namespace"]:
                return 404
            (pod,) = found
            if uid and uid != pod.obj["metadata"]["uid"]:
                return 409
            if pod.exit_code is not None:
                pod.removed = True
            else:
                self._delete_pod(pod, "", None)
            return 200

    def api_delete_job(self, namespace: str, name: str, uid: str) -> int:
        """A child Job's delete (background propagation): :meth:`delete_job`."""
        with self._lock:
            js = self.jobset["metadata"]["name"]
            found = [j for j in range(self.slices) if child_job_name(js, j) == name and j not in self.deleting_jobs]
            if not found or namespace != self.jobset["metadata"]["namespace"]:
                return 404
            if uid and uid != self.job_uid(found[0]):
                return 409
            self.delete_job(found[0])
            return 200


def status(code: int, message: str) -> K8sObject:
    """A ``Status`` object, as the API server answers a failed call."""
    reason = {403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed", 409: "Conflict"}.get(code, "Unknown")
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def selector_of(query: Mapping[str, list[str]]) -> dict[str, str]:
    """A ``labelSelector`` of equalities (``a=b,c=d``; a bare key matches any value) as a dict."""
    out = {}
    for term in ",".join(query.get("labelSelector") or []).split(","):
        if term:
            key, _, value = term.partition("=")
            out[key] = value
    return out


def _uid(body: K8sObject) -> str:
    return str(((body or {}).get("preconditions") or {}).get("uid") or "")


class EmulatedAPI:
    """An HTTP server on 127.0.0.1 answering the repairs' calls from ``cluster``; :attr:`url` is its address."""

    def __init__(self, cluster: EmulatedCluster) -> None:
        c = cluster
        self.routes: list[tuple[str, re.Pattern[str], Route]] = [
            (
                "GET",
                re.compile(r"/api/v1/namespaces/([^/]+)/pods"),
                lambda m, q, _b: (200, _list("PodList", c.api_pods(m[1], selector_of(q)))),
            ),
            ("GET", re.compile(r"/api/v1/nodes"), lambda _m, _q, _b: (200, _list("NodeList", c.api_nodes()))),
            (
                "DELETE",
                re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)"),
                lambda m, _q, b: _deleted(c.api_delete_pod(m[1], m[2], _uid(b)), "pods", m[2]),
            ),
            (
                "DELETE",
                re.compile(r"/apis/batch/v1/namespaces/([^/]+)/jobs/([^/]+)"),
                lambda m, _q, b: _deleted(c.api_delete_job(m[1], m[2], _uid(b)), "jobs.batch", m[2]),
            ),
        ]
        self.calls: list[str] = []  # "<METHOD> <path>" of each call, for a look at who did what
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="emulated-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> EmulatedAPI:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def answer(self, method: str, target: str, body: K8sObject) -> tuple[int, K8sObject]:
        """The answer to one call."""
        url = urlparse(target)
        self.calls.append(f"{method} {url.path}")
        for verb, pattern, route in self.routes:
            m = pattern.fullmatch(url.path)
            if m and verb == method:
                return route(m, parse_qs(url.query), body)
        return 405, status(405, f"{method} {url.path} is not served by the emulated cluster")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                code, payload = api.answer(self.command, self.path, json.loads(raw) if raw else {})
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_DELETE = _serve

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


def _list(kind: str, items: list[K8sObject]) -> K8sObject:
    return {"kind": kind, "apiVersion": "v1", "metadata": {}, "items": items}


def _deleted(code: int, resource: str, name: str) -> tuple[int, K8sObject]:
    if code == 200:
        return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}
    why = "not found" if code == 404 else "the object's uid is not the precondition's"
    return code, status(code, f'{resource} "{name}": {why}')
