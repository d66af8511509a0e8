"""A slice's own repairs of its JobSet (``rtrain repair-slices``): safe beside other repairers, quiet out of a cluster,
and plain about a service account that may not repair.

The repairs themselves, run by the pods with no watch, are in test_gke_pods, test_gke_placement and test_gke_backoff.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from jobs import wait_for
from kubernetes import client as k8s
from test_gke_pods import FAST_BACKOFF, _policy_jobset

from training.backends.gke_jobsets import KubeJobSets
from training.backends.gke_selfrepair import FORBIDDEN_EVERY_S, OwnJobSet, repair_once
from training.gke.emulated_api import EmulatedAPI, EmulatedCluster, status
from training.gke.names import child_job_name
from training.gke.pod_emulator import EmulatedJobSet
from training.gke.reaper import job_uid


def _client(url: str) -> KubeJobSets:
    conf = k8s.Configuration()
    conf.host = url
    return KubeJobSets(k8s.ApiClient(conf))


def test_a_job_delete_seen_under_an_old_uid_leaves_the_job_made_again_since(tmp_path: Path) -> None:
    """Two repairers judge a slice from one look; the first deletes its Job and JobSet makes it again: the second's
    delete, under the uid it saw, is refused (409) and the new Job lives.  Under the new uid it is deleted."""
    m, env = _policy_jobset(tmp_path)
    with EmulatedJobSet(
        m, tmp_path / "cluster", env, failure_backoff_s=FAST_BACKOFF, reaper=False, serve_api=True
    ) as js:
        assert js.api is not None
        jobsets = _client(js.api.url)
        wait_for(lambda: len(js.running()) == 4, 20, "4 pods running")
        seen = job_uid(jobsets.pods(m.name, m.namespace), 1)
        assert seen == js.job_uid(1)
        js.delete_job(1)  # the other repairer's delete
        wait_for(lambda: js.jobs_made[1] == 2 and len(js.running(1)) == 2, 20, "slice 1's Job made again")
        name = child_job_name(m.name, 1)
        jobsets._gone(jobsets.batch.delete_namespaced_job, name, m.namespace, seen, "Background")
        assert "DELETE" in " ".join(js.api.calls) and js.jobs_made[1] == 2 and len(js.running(1)) == 2
        assert 1 not in js.deleting_jobs
        fresh = job_uid(jobsets.pods(m.name, m.namespace), 1)
        assert fresh == js.job_uid(1) != seen
        jobsets._gone(jobsets.batch.delete_namespaced_job, name, m.namespace, fresh, "Background")
        wait_for(lambda: js.jobs_made[1] == 3, 20, "slice 1's Job deleted under its own uid, and made again")


def test_repair_slices_outside_a_cluster_says_so_in_one_line_and_exits_0() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "RTRAIN_"))}
    for extra in ({}, {"RTRAIN_SUBDOMAIN": "js", "RTRAIN_NAMESPACE": "training"}):
        got = subprocess.run(
            [str(Path(sys.executable).with_name("rtrain")), "repair-slices"],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert got.returncode == 0, got.stderr
        assert got.stderr.count("\n") == 1 and "no repairs from here" in got.stderr, got.stderr


class Forbidding(EmulatedAPI):
    """An API server that refuses every call, as one does to a service account without the Role."""

    def answer(self, method: str, target: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 403, status(403, f"{method} {target} is forbidden")


@pytest.fixture
def forbidding_server() -> Iterator[str]:
    server = Forbidding(cast(EmulatedCluster, None)).start()
    try:
        yield server.url
    finally:
        server.close()


def test_a_service_account_that_may_not_repair_is_told_which_role_to_grant_and_asked_less_often(
    forbidding_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="rtrain.repair"):
        wait = repair_once(_client(forbidding_server), OwnJobSet("js", "training"), 0.5)
    assert wait == FORBIDDEN_EVERY_S
    (said,) = [r.getMessage() for r in caplog.records]
    assert "HTTP 403" in said and "rtrain-repairs Role" in said and "docs/gke.md" in said and "\n" not in said


def test_repair_slices_ends_with_the_agent_it_was_started_beside(forbidding_server: str, tmp_path: Path) -> None:
    """Started in the background by the entrypoint, it goes when the process it was started beside goes, even where
    no container ends with it (a SIGKILLed agent, the pod emulator's process killed)."""
    rtrain = Path(sys.executable).with_name("rtrain")
    env = {**os.environ, "RTRAIN_SUBDOMAIN": "js", "RTRAIN_NAMESPACE": "training", "RTRAIN_KUBE_API": forbidding_server}
    pidfile = tmp_path / "pid"
    agent = subprocess.Popen(
        ["/bin/sh", "-c", f'"{rtrain}" repair-slices --every 0.2 & echo $! > {pidfile}; exec sleep 120'], env=env
    )
    try:
        pid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 30, "the repairs' pid"))
        cmdline = Path(f"/proc/{pid}/cmdline")
        wait_for(lambda: b"repair-slices js" in cmdline.read_bytes(), 60, "the repairs to start looking")
    finally:
        agent.kill()
        agent.wait()
    wait_for(lambda: _gone(pid), 10, "the repairs to end with it")


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
