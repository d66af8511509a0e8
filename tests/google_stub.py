"""A Google endpoint on 127.0.0.1 that refuses every API call one way, and an OAuth token endpoint.

The real client libraries talk to it over real HTTP: google-cloud-storage through
``API_ENDPOINT_OVERRIDE`` (with the caller's credentials, unlike ``STORAGE_EMULATOR_HOST``), and
google-auth's user credentials through their ``token_uri``.  Each refusal is the body Cloud Storage's
JSON API sends (https://cloud.google.com/storage/docs/json_api/v1/status-codes: ``error.code``,
``error.message`` and ``error.errors[].domain/reason/message``), so the clients raise what they would
raise against Google Cloud.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass(frozen=True)
class Refusal:
    """One way an API refuses every call: the HTTP status, the error's domain and reason, its message."""

    status: int
    domain: str
    reason: str
    message: str


# What Cloud Storage answers for each case (its status-codes page's reasons and messages).
REFUSALS = {
    "permission": Refusal(
        403,
        "global",
        "forbidden",
        "rtrain@rtrain-prod.iam.gserviceaccount.com does not have storage.objects.get access to the Google Cloud "
        "Storage object. Permission 'storage.objects.get' denied on resource (or it may not exist).",
    ),
    "no-bucket": Refusal(404, "global", "notFound", "The specified bucket does not exist."),
    "quota": Refusal(403, "usageLimits", "quotaExceeded", "Quota exceeded for quota metric 'Requests'."),
    "rate": Refusal(429, "usageLimits", "rateLimitExceeded", "The project exceeded the rate limit."),
}
# What the Kubernetes API answers a call RBAC does not allow (a metav1.Status, reason Forbidden).
KUBE_FORBIDDEN = (
    'pods is forbidden: User "rtrain-airflow@rtrain-prod.iam.gserviceaccount.com" cannot list resource "pods" '
    'in API group "" in the namespace "training"'
)
# What Google's OAuth token endpoint answers for a refresh token that was revoked (RFC 6749 section 5.2).
REVOKED = {"error": "invalid_grant", "error_description": "Token has been expired or revoked."}


class GoogleStub:
    """The endpoint's state: how it refuses API calls, whether the token endpoint grants, and what it was asked."""

    def __init__(self, refusal: Refusal | None = None, grant: bool = True) -> None:
        self.refusal = refusal
        self.grant = grant
        self.paths: list[str] = []
        self.url = ""

    def user_credentials(self, path: Path) -> Path:
        """A person's credentials (``gcloud auth application-default login``'s file, no project) holding an access
        token good for an hour, so no refresh is needed (google-auth sends a person's refresh to Google's own
        token endpoint, whatever the file names)."""
        expiry = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        info = {"type": "authorized_user", "client_id": "c", "client_secret": "s", "refresh_token": "r"}
        path.write_text(json.dumps({**info, "token": "t", "expiry": expiry}))
        return path

    def service_account(self, path: Path) -> Path:
        """A service account's key file (a fresh RSA key) whose tokens come from this endpoint's ``/token``."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()
        info = {
            "type": "service_account",
            "project_id": "rtrain-prod",
            "private_key_id": "k1",
            "private_key": pem,
            "client_email": "rtrain@rtrain-prod.iam.gserviceaccount.com",
            "client_id": "1",
            "token_uri": f"{self.url}/token",
        }
        path.write_text(json.dumps(info))
        return path


def _handler(stub: GoogleStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json; charset=UTF-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _any(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            stub.paths.append(f"{self.command} {self.path}")
            if self.path.startswith("/token"):
                if stub.grant:
                    self._answer(200, {"access_token": "t", "token_type": "Bearer", "expires_in": 3600})
                else:
                    self._answer(400, REVOKED)
                return
            r = stub.refusal
            if r is not None and self.path.startswith("/api/"):  # the Kubernetes API: a Status
                status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": r.status}
                self._answer(r.status, {**status, "reason": "Forbidden", "message": KUBE_FORBIDDEN})
                return
            if r is None:
                self._answer(500, {"error": {"code": 500, "message": "no refusal set"}})
                return
            error = {"domain": r.domain, "reason": r.reason, "message": r.message}
            self._answer(r.status, {"error": {"code": r.status, "message": r.message, "errors": [error]}})

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

    return Handler


@contextmanager
def google_stub(refusal: Refusal | None = None, grant: bool = True) -> Iterator[GoogleStub]:
    """The endpoint, served on a free port of 127.0.0.1 while the block runs."""
    stub = GoogleStub(refusal, grant)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(stub))
    stub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield stub
    finally:
        server.shutdown()
        server.server_close()
