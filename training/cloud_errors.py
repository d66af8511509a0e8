"""One line for an error a Google Cloud or Kubernetes client raised: what went wrong, and what to do about it.

Every ``rtrain`` command that reaches Google Cloud (a ``gs://`` run root, the GKE API, a cluster)
ends such an error with :func:`cloud_error`'s line instead of a traceback (``--debug`` keeps it).
The kinds are those a first run meets: no credentials, credentials refused or expired, no project,
no bucket, permission denied, a quota or rate limit, and no answer at all.  The client libraries are
imported only to tell the kinds apart, once an error has been raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Kind(Enum):
    """What a person must do about a cloud error: fix the setup, look for a missing thing, or wait."""

    SETUP = "setup"  # credentials, project, permissions: nothing changes until a person acts
    MISSING = "missing"  # a bucket (or another named thing) that does not exist
    LATER = "later"  # a quota, a rate limit, no answer: may pass


@dataclass(frozen=True)
class CloudError:
    """A cloud error said in one line, and what kind of error it is."""

    line: str
    kind: Kind


ADC_HELP = "gcloud auth application-default login, or GOOGLE_APPLICATION_CREDENTIALS=<a key file>"
QUOTA_HELP = "wait and try again, or ask for more quota (IAM & Admin > Quotas)"
MAX_DETAIL = 300


def one_line(text: str, limit: int = MAX_DETAIL) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def cloud_error(e: BaseException) -> CloudError | None:
    """The one line for ``e``, or for the first error of its chain that a cloud client raised; None if none did.

    An error raised ``from None`` ends the chain: its own message was written to be the line.
    """
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        found = _google(err) or _kubernetes(err) or _transport(err)
        if found is not None:
            return found
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return None


def _google(e: BaseException) -> CloudError | None:
    try:
        from google.api_core import exceptions as api
        from google.auth import exceptions as auth
    except ImportError:  # pragma: no cover - the google clients are dependencies
        return None
    if isinstance(e, auth.DefaultCredentialsError):
        return CloudError(f"no Google credentials ({ADC_HELP}): {one_line(str(e))}", Kind.SETUP)
    if isinstance(e, auth.RefreshError):
        return CloudError(
            f"the Google credentials were refused when refreshed (expired or revoked: {ADC_HELP}): {one_line(str(e))}",
            Kind.SETUP,
        )
    if isinstance(e, auth.TransportError):
        return CloudError(
            f"Google's token service did not answer (no network, a proxy?): {one_line(str(e))}", Kind.LATER
        )
    if isinstance(e, OSError) and "Project was not passed" in str(e):  # google-cloud-core's ClientWithProject
        return CloudError(
            "no Google Cloud project: give the credentials one (gcloud config set project PROJECT, "
            "or GOOGLE_CLOUD_PROJECT)",
            Kind.SETUP,
        )
    if isinstance(e, api.RetryError):
        cause = e.cause
        response = getattr(cause, "response", None)  # a media transfer's InvalidResponse: the answer, unparsed
        if isinstance(cause, BaseException) and hasattr(response, "status_code"):
            cause = api.from_http_response(response)
        inner = _google(cause) if isinstance(cause, BaseException) else None
        inner = inner or (_transport(cause) if isinstance(cause, BaseException) else None)
        what = inner.line if inner is not None else one_line(str(cause))
        return CloudError(f"Google Cloud kept failing until the client gave up retrying: {what}", Kind.LATER)
    if isinstance(e, api.GoogleAPICallError):
        return _call_error(e, api)
    return None


def _reasons(e: Any) -> set[str]:
    """The machine-readable reasons of an API error: its ``errors[].reason`` (JSON APIs, parsed or from the body)
    and ErrorInfo's reason."""
    errors = list(e.errors or []) or _body_errors(getattr(e, "response", None))
    out = {str(x.get("reason")) for x in errors if isinstance(x, dict) and x.get("reason")}
    if getattr(e, "reason", None):
        out.add(str(e.reason))
    return out


def _body_errors(response: Any) -> list[Any]:
    """The ``error.errors`` of a JSON error body the client left unparsed (a media download's, for one)."""
    try:
        body = response.json()
    except (AttributeError, ValueError):
        return []
    errors = (body.get("error") or {}).get("errors") if isinstance(body, dict) else None
    return errors if isinstance(errors, list) else []


def _call_error(e: Any, api: Any) -> CloudError:
    """An API's refusal, by its status: 401, 403 (a quota or billing reason told apart), 404, 429, and the rest."""
    detail = one_line(e.message or str(e))
    reasons = {r.lower() for r in _reasons(e)}
    quota = any("quota" in r or "ratelimit" in r or "limitexceeded" in r for r in reasons)
    if isinstance(e, api.TooManyRequests | api.ResourceExhausted) or quota:
        return CloudError(f"over a Google Cloud quota or rate limit ({e.code}; {QUOTA_HELP}): {detail}", Kind.LATER)
    if isinstance(e, api.Unauthorized | api.Unauthenticated):
        return CloudError(f"the Google credentials were refused (401; {ADC_HELP}): {detail}", Kind.SETUP)
    if isinstance(e, api.Forbidden | api.PermissionDenied):
        billing = any("billing" in r or "accountdisabled" in r or "userproject" in r for r in reasons)
        what = "the project cannot be billed" if billing else "permission denied"
        return CloudError(f"{what} (403; the account needs the roles of docs/gke.md section 2): {detail}", Kind.SETUP)
    if isinstance(e, api.NotFound):
        return CloudError(f"not found (404): {detail}", Kind.MISSING)
    return CloudError(f"Google Cloud refused the call ({e.code}): {detail}", Kind.LATER)


def _kubernetes(e: BaseException) -> CloudError | None:
    try:
        from kubernetes.client.exceptions import ApiException
    except ImportError:  # pragma: no cover - kubernetes is a dependency
        return None
    if not isinstance(e, ApiException):
        return None
    import json

    detail = e.reason or ""
    try:
        detail = json.loads(e.body or "{}").get("message") or detail
    except (ValueError, AttributeError):
        pass
    status = int(e.status or 0)
    kind = {401: Kind.SETUP, 403: Kind.SETUP, 404: Kind.MISSING}.get(status, Kind.LATER)
    help_ = {401: f"; {ADC_HELP}", 403: "; the RBAC of docs/gke.md section 5", 429: "; wait and try again"}
    return CloudError(
        f"the Kubernetes API refused the call ({status}{help_.get(status, '')}): {one_line(detail)}", kind
    )


def _transport(e: BaseException) -> CloudError | None:
    """No answer at all: a connection refused or reset, a name that does not resolve, a timeout."""
    try:
        import requests
        import urllib3.exceptions
    except ImportError:  # pragma: no cover - both come with the google clients
        return None
    if isinstance(e, requests.ConnectionError | requests.Timeout | urllib3.exceptions.HTTPError):
        return CloudError(f"no answer from the cloud (no network, a proxy?): {one_line(str(e))}", Kind.LATER)
    return None
