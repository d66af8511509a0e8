"""What the GKE backend refuses before a node pool bills: an image its registry does not have, a run a live job
holds, a run root that takes no write, data that is not prepared, a batch the slices cannot split.

Each refusal is one line (a ``BackendError``, which ``provision_capacity`` fails without a retry) and the
fake GKE API is asked for no pool.  The registry is a local server that answers the Docker Registry HTTP
API's manifest ``HEAD`` as Artifact Registry does (200, or 404 with ``MANIFEST_UNKNOWN``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from google.cloud import container_v1
from test_gke_tpu import cloud, gke_conf

from training.api import load_config
from training.backends import BackendError, GKEBackend, GKESpec, JobSpec
from training.checkpoint.lock import RunLock
from training.gke.registry import MANIFEST_TYPES, image_found, parse_image
from training.storage import open_store


class Registry:
    """The images a registry holds (``path:tag``) and the manifest requests it was sent (path, headers)."""

    def __init__(self, images: set[str]) -> None:
        self.images = images
        self.asked: list[tuple[str, dict[str, str]]] = []
        self.host = ""


@pytest.fixture
def registry() -> Iterator[Registry]:
    reg = Registry({"rtrain/train:v1"})

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
            reg.asked.append((self.path, dict(self.headers)))
            path = self.path.removeprefix("/v2/")
            name, _, ref = path.partition("/manifests/")
            found = f"{name}:{ref}" in reg.images
            body = b"" if found else json.dumps({"errors": [{"code": "MANIFEST_UNKNOWN"}]}).encode()
            self.send_response(200 if found else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    reg.host = f"127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield reg
    finally:
        server.shutdown()
        server.server_close()


Pools = tuple[Any, container_v1.ClusterManagerClient]


def _provision(pools: Pools, root: str, dataset: str, image: str, **config: Any) -> dict[str, Any]:
    fake, client = pools
    gke = gke_conf(node_pools=["slice-0", "slice-1"], image=image)
    cfg = load_config(
        "tiny",
        None,
        {"root": root, "backend": "gke", "devices_per_worker": 4, "hosts_per_slice": 4, "dataset": dataset}
        | {"min_workers": 4, "max_workers": 8, "global_batch": 64}
        | config,
    )
    return dict(GKEBackend(gke, cloud(gke, client)).provision(JobSpec(cfg, GKESpec(gke))))


def test_an_image_its_registry_does_not_have_is_refused_before_any_pool(
    pools: Pools, gcs_root: str, gs_data: str, registry: Registry
) -> None:
    fake, _ = pools
    with pytest.raises(BackendError, match=f"^gke.image: {registry.host}/rtrain/train:v2 is not in its registry"):
        _provision(pools, gcs_root, gs_data, f"{registry.host}/rtrain/train:v2")
    assert not fake.pools
    (path, headers), *_ = registry.asked
    assert path == "/v2/rtrain/train/manifests/v2" and headers["Accept"] == MANIFEST_TYPES
    assert "Authorization" not in headers  # a Google token goes to Google's registries only
    up = _provision(pools, gcs_root, gs_data, f"{registry.host}/rtrain/train:v1")
    assert sorted(up["node_pools_up"]) == ["slice-0", "slice-1"]


def test_google_registries_get_the_credentials_token_and_others_are_not_asked() -> None:
    asked: list[tuple[str, dict[str, str]]] = []

    def head(url: str, headers: dict[str, str]) -> int:
        asked.append((url, headers))
        return 404

    assert image_found("us-east5-docker.pkg.dev/p/rtrain/train:v3", head, lambda: "tok") is False
    assert asked == [
        (
            "https://us-east5-docker.pkg.dev/v2/p/rtrain/train/manifests/v3",
            {"Accept": MANIFEST_TYPES, "Authorization": "Bearer tok"},
        )
    ]
    assert image_found("ghcr.io/someone/train:v3", head, lambda: "tok") is None
    assert image_found("python:3.12", head, lambda: "tok") is None
    assert len(asked) == 1


@pytest.mark.parametrize(
    ("image", "host", "path", "reference"),
    [
        ("us-docker.pkg.dev/p/r/train:v1", "us-docker.pkg.dev", "p/r/train", "v1"),
        ("gcr.io/p/train", "gcr.io", "p/train", "latest"),
        ("localhost:5000/train@sha256:abc", "localhost:5000", "train", "sha256:abc"),
        ("python:3.12", "registry-1.docker.io", "library/python", "3.12"),
        ("someone/train:v2", "registry-1.docker.io", "someone/train", "v2"),
    ],
)
def test_image_references_split_as_a_registry_reads_them(image: str, host: str, path: str, reference: str) -> None:
    ref = parse_image(image)
    assert (ref.host, ref.path, ref.reference) == (host, path, reference)


def test_a_run_a_live_job_holds_is_refused_before_any_pool(pools: Pools, gcs_root: str, gs_data: str) -> None:
    fake, _ = pools
    cfg_root = f"{gcs_root}/runs"
    held = RunLock(open_store(f"{cfg_root}/tiny"), owner="agent h0 of job j1", lease_s=600.0, job="j1")
    held.acquire()
    try:
        with pytest.raises(BackendError, match=r"^refused before any node pool: run .* is locked by 'agent h0 of job"):
            _provision(pools, cfg_root, gs_data, "img", run_name="tiny")
    finally:
        held.release()
    assert not fake.pools
    assert _provision(pools, cfg_root, gs_data, "img", run_name="tiny")["node_pools_up"]  # released: it goes on


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"root": "gs://rtrain-no-such-bucket/runs"}, r"^root: the run root gs://rtrain-no-such-bucket/runs/.* does"),
        ({"dataset": "gs://rtrain-test/never-prepared"}, r"^dataset gs://rtrain-test/never-prepared is not prepared"),
        ({"global_batch": 20}, r"^global_batch=20 cannot be split"),
    ],
)
def test_what_the_launch_would_refuse_is_refused_before_any_pool(
    pools: Pools, gcs_root: str, gs_data: str, change: dict[str, str], match: str
) -> None:
    fake, _ = pools
    args = {"root": gcs_root, "dataset": gs_data} | change
    with pytest.raises(BackendError, match=match) as e:
        _provision(pools, str(args.pop("root")), str(args.pop("dataset")), "img", **args)
    assert "\n" not in str(e.value)
    assert not fake.pools
