"""``rtrain train --gke FILE`` from a workstation: against no reachable cluster it fails in one line naming what is missing.

Each case runs the real ``rtrain`` in an environment with no Google credentials of its own (an
empty HOME and gcloud config, no metadata server), so the real ``google.auth`` lookup decides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a real rtrain process each (about 1 s of CPU; more on a loaded machine)

REPO = Path(__file__).resolve().parents[2]
GKE = {
    "project_id": "rtrain-prod",
    "location": "us-west4",
    "cluster_name": "train",
    "machine_type": "ct5lp-hightpu-4t",
    "tpu_topology": "2x4",
    "node_pools": ["v5e-2x4-0", "v5e-2x4-1"],
    "node_locations": ["us-west4-a"],
    "image": "us-west4-docker.pkg.dev/rtrain-prod/rtrain/train:abc1234",
    "spot": True,
}
ARGS = ["--preset", "tiny", "root=gs://rtrain-prod-runs/runs", "elastic.min_workers=2", "elastic.max_workers=4"]
CONFIG_EXIT = 3


def rtrain_train(
    tmp_path: Path, gke: dict[str, object], env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "home").mkdir(exist_ok=True)
    (tmp_path / "gcloud").mkdir(exist_ok=True)
    settings = tmp_path / "gke.json"
    settings.write_text(json.dumps(gke))
    base = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "home"),
        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),  # an empty gcloud config: no account, no project
        "GCE_METADATA_HOST": "127.0.0.1:9",  # no metadata server answers here
        "GCE_METADATA_IP": "127.0.0.1:9",
    }
    return subprocess.run(
        [sys.executable, "-m", "training.cli", "train", "--gke", str(settings), *ARGS, *args],
        cwd=REPO,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=180,
    )


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == CONFIG_EXIT, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    return lines[0]


@pytest.mark.parametrize("key_file", [True, False])
def test_no_credentials_is_one_line_saying_how_to_get_them(tmp_path: Path, key_file: bool) -> None:
    env = {"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "missing.json")} if key_file else {}
    line = one_line(rtrain_train(tmp_path, GKE, env, "placement.devices_per_worker=4"))
    assert line.startswith("rtrain: error: gke: no Google credentials (gcloud auth application-default login")
    if key_file:
        assert line.endswith(f"File {tmp_path / 'missing.json'} was not found.")


def test_no_project_is_one_line_naming_the_key(tmp_path: Path) -> None:
    user = tmp_path / "user.json"  # credentials of a person, with no project of their own
    user.write_text(
        json.dumps({"type": "authorized_user", "client_id": "c", "client_secret": "s", "refresh_token": "r"})
    )
    gke = {k: v for k, v in GKE.items() if k != "project_id"}
    line = one_line(
        rtrain_train(tmp_path, gke, {"GOOGLE_APPLICATION_CREDENTIALS": str(user)}, "placement.devices_per_worker=4")
    )
    assert line.startswith("rtrain: error: gke.project_id: no Google Cloud project")


def test_a_config_the_shape_cannot_run_is_refused_before_credentials_are_looked_for(tmp_path: Path) -> None:
    line = one_line(rtrain_train(tmp_path, GKE, {}, "placement.devices_per_worker=2"))
    assert line.startswith("rtrain: error: ")
    assert line.endswith("devices_per_worker: ct5lp-hightpu-4t has 4 chips per host, but devices_per_worker=2")
    missing = {k: v for k, v in GKE.items() if k != "image"}
    line = one_line(rtrain_train(tmp_path, missing, {}, "placement.devices_per_worker=4"))
    assert line.startswith("rtrain: error: gke") and "gke.image" in line  # the key, named
