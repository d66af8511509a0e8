"""Whether a container image exists, asked of its registry's Docker Registry HTTP API (a manifest ``HEAD``).

Artifact Registry (``*-docker.pkg.dev``) and Container Registry (``gcr.io``) take a Google OAuth access
token as a bearer token.  A registry on ``localhost`` / ``127.0.0.1`` is asked without one, over plain
HTTP, as Docker speaks to a local registry.  Other registries each want a login of their own: their
images are left unchecked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# The manifest kinds a kubelet pulls: OCI index and manifest, Docker's list and v2 manifest.
MANIFEST_TYPES = ", ".join(
    (
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    )
)
GOOGLE_REGISTRIES = ("-docker.pkg.dev", "gcr.io")
LOCAL_HOSTS = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class ImageRef:
    """An image reference split as a registry reads it: host, repository path, and tag or digest."""

    host: str
    path: str
    reference: str

    @property
    def google(self) -> bool:
        """Is the registry Google's (a Google access token is its credential)?"""
        host = self.host.split(":")[0]
        return host.endswith(GOOGLE_REGISTRIES)

    @property
    def local(self) -> bool:
        """Is the registry on this machine (spoken to over plain HTTP)?"""
        return self.host.split(":")[0] in LOCAL_HOSTS

    def manifest_url(self) -> str:
        scheme = "http" if self.local else "https"
        return f"{scheme}://{self.host}/v2/{self.path}/manifests/{self.reference}"


def parse_image(image: str) -> ImageRef:
    """``host/path:tag`` or ``host/path@sha256:...``; a name without a registry host is Docker Hub's."""
    rest, digest = (image.split("@", 1) + [""])[:2]
    first, _, after = rest.partition("/")
    if after and ("." in first or ":" in first or first == "localhost"):
        host, path = first, after
    else:
        host, path = "registry-1.docker.io", rest if "/" in rest else f"library/{rest}"
    if digest:
        return ImageRef(host, path, digest)
    name, _, tag = path.rpartition(":") if ":" in path.rsplit("/", 1)[-1] else (path, "", "latest")
    return ImageRef(host, name, tag)


# An answer: the HTTP status of the manifest's HEAD (``None``: no answer at all).
Head = Callable[[str, dict[str, str]], int | None]


def image_found(image: str, head: Head, token: Callable[[], str] | None = None) -> bool | None:
    """True: the registry has the image; False: it says there is none (404); None: it could not say (a login
    it wants, a refusal, no answer).  ``token``: a Google access token, sent to Google's registries only."""
    ref = parse_image(image)
    if not ref.google and not ref.local:
        return None  # another registry wants its own login (Docker Hub: a token of its own): not asked
    headers = {"Accept": MANIFEST_TYPES}
    if ref.google and token is not None:
        headers["Authorization"] = f"Bearer {token()}"
    status = head(ref.manifest_url(), headers)
    if status is not None and 200 <= status < 300:
        return True
    return False if status == 404 else None
