"""Every ``rtrain`` command against Google Cloud that refuses it ends in one line, with the real client libraries.

Each case runs the real ``rtrain`` in an environment with no Google credentials of its own (an empty
HOME and gcloud config, no metadata server), so the real ``google.auth`` lookup decides; the refusals
come from :mod:`tests.google_stub`, a local endpoint that answers as Cloud Storage's JSON API does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.api_core.exceptions import RetryError
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage  # type: ignore[attr-defined,unused-ignore]
from google.cloud.storage.retry import DEFAULT_RETRY
from kubernetes import client as k8s

from tests.google_stub import KUBE_FORBIDDEN, REFUSALS, google_stub
from training.cloud_errors import Kind, cloud_error

REPO = Path(__file__).resolve().parents[2]
ROOT = "gs://rtrain-none/runs"
RUN = f"{ROOT}/r1"
EXIT = {"config": 3, "not_found": 4, "error": 6}


def rtrain(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "home").mkdir(exist_ok=True)
    (tmp_path / "gcloud").mkdir(exist_ok=True)
    base = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "home"),
        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),  # an empty gcloud config: no account, no project
        "GCE_METADATA_HOST": "127.0.0.1:9",  # no metadata server answers here
        "GCE_METADATA_IP": "127.0.0.1:9",
    }
    return subprocess.run(
        [sys.executable, "-m", "training.cli", *args],
        cwd=REPO,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=180,
    )


def one_line(out: subprocess.CompletedProcess[str], code: int) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code and len(lines) == 1, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    return lines[0]


def verbs(tmp_path: Path) -> dict[str, list[str]]:
    """Every rtrain command that reads or writes a gs:// run root, with its arguments."""
    text = tmp_path / "text.txt"
    text.write_text("a few words to tokenize\n" * 64)
    return {
        "status": ["status", RUN],
        "events": ["events", RUN],
        "stop": ["stop", RUN],
        "capacity": ["capacity", RUN, "2"],
        "validate": ["validate", RUN],
        "rollback": ["rollback", RUN],
        "prune": ["prune", RUN],
        "report": ["report", RUN],
        "export": ["export", RUN, "--format", "orbax", "--output", str(tmp_path / "export")],
        "queue": ["queue", "--root", ROOT],
        "priority": ["priority", "r1", "high", "--root", ROOT],
        "cancel": ["cancel", "r1", "--root", ROOT],
        "prepare": ["prepare", "--source", str(text), "--output", "gs://rtrain-none/data/tiny"],
        "agent": ["agent", RUN, "--job", "j1", "--host", "h0"],
    }


# One command of each part (a run's records, the pool, a dataset, a host's agent) in `make test`; the rest,
# which reach the same store the same way, in `make test-all`.
VERBS = [
    "status",
    "queue",
    "prepare",
    "agent",
    *(
        pytest.param(verb, marks=pytest.mark.extended)
        for verb in (
            "events",
            "stop",
            "capacity",
            "validate",
            "rollback",
            "prune",
            "report",
            "export",
            "priority",
            "cancel",
        )
    ),
]


@pytest.mark.slow  # a real rtrain process each (about 1 s of CPU)
@pytest.mark.parametrize("verb", VERBS)
def test_every_command_without_credentials_is_one_line_saying_how_to_get_them(tmp_path: Path, verb: str) -> None:
    line = one_line(rtrain(tmp_path, {}, *verbs(tmp_path)[verb]), EXIT["config"])
    assert line.startswith("rtrain: error: no Google credentials (gcloud auth application-default login"), line


@pytest.mark.slow
def test_debug_keeps_the_traceback(tmp_path: Path) -> None:
    out = rtrain(tmp_path, {}, "--debug", "status", RUN)
    assert out.returncode == EXIT["config"]
    assert "Traceback" in out.stderr and "DefaultCredentialsError" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("rtrain: error: no Google credentials")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("refusal", "code", "start"),
    [
        ("permission", "config", "rtrain: error: permission denied (403; the account needs the roles of docs/gke.md"),
        ("no-bucket", "not_found", "rtrain: error: no bucket gs://rtrain-none: run "),
        ("quota", "error", "rtrain: error: over a Google Cloud quota or rate limit (403; wait and try again"),
    ],
)
@pytest.mark.parametrize("verb", ["status", "events", "stop"])
def test_a_refusal_of_the_bucket_is_one_line_naming_it(
    tmp_path: Path, verb: str, refusal: str, code: str, start: str
) -> None:
    with google_stub(REFUSALS[refusal]) as stub:
        # A person's credentials with no project: gs:// objects need none, so the call reaches the bucket.
        env = {"GOOGLE_APPLICATION_CREDENTIALS": str(stub.user_credentials(tmp_path / "user.json"))}
        out = rtrain(tmp_path, {**env, "API_ENDPOINT_OVERRIDE": stub.url}, *verbs(tmp_path)[verb])
        assert any("/storage/v1/b/rtrain-none" in p for p in stub.paths), stub.paths
    line = one_line(out, EXIT[code])
    assert line.startswith(start), line
    if refusal != "no-bucket":
        assert REFUSALS[refusal].message[:40] in line


@pytest.mark.slow
def test_credentials_refused_at_refresh_are_one_line(tmp_path: Path) -> None:
    with google_stub(REFUSALS["permission"], grant=False) as stub:
        env = {"GOOGLE_APPLICATION_CREDENTIALS": str(stub.service_account(tmp_path / "key.json"))}
        out = rtrain(tmp_path, {**env, "API_ENDPOINT_OVERRIDE": stub.url}, "status", RUN)
    line = one_line(out, EXIT["config"])
    assert line.startswith("rtrain: error: the Google credentials were refused when refreshed"), line
    assert "Token has been expired or revoked" in line


def test_a_rate_limit_the_client_retried_to_its_deadline_is_one_quota_line() -> None:
    with google_stub(REFUSALS["rate"]) as stub:
        client = storage.Client(
            project="p", credentials=AnonymousCredentials(), client_options={"api_endpoint": stub.url}
        )
        with pytest.raises(RetryError) as caught:
            client.bucket("b").blob("k").download_as_bytes(retry=DEFAULT_RETRY.with_timeout(1.5))
        assert len(stub.paths) > 1  # retried: a 429 is worth retrying
    found = cloud_error(caught.value)
    assert found is not None and found.kind is Kind.LATER
    assert "over a Google Cloud quota or rate limit (429" in found.line and "\n" not in found.line


def test_a_kubernetes_refusal_is_one_line_naming_the_rbac() -> None:
    with google_stub(REFUSALS["permission"]) as stub:
        api = k8s.CoreV1Api(k8s.ApiClient(k8s.Configuration(host=stub.url)))
        with pytest.raises(k8s.ApiException) as caught:
            api.list_namespaced_pod("training")
    found = cloud_error(caught.value)
    assert found is not None and found.kind is Kind.SETUP
    assert found.line.startswith("the Kubernetes API refused the call (403; the RBAC of docs/gke.md section 5)")
    assert found.line.endswith(KUBE_FORBIDDEN)


def test_an_error_raised_from_none_keeps_its_own_line() -> None:
    from google.auth.exceptions import DefaultCredentialsError

    try:
        try:
            raise DefaultCredentialsError("nothing here")
        except DefaultCredentialsError:
            raise ValueError("gke: no Google credentials, said by the caller") from None
    except ValueError as e:
        assert cloud_error(e) is None
