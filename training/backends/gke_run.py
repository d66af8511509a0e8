"""A ``backend: gke`` run from a workstation: ``rtrain train --gke FILE`` with Application Default Credentials.

The same steps as the Airflow DAG's, in one process: check the settings and find the cluster
(before anything is billed), create the node pools, launch the JobSet, follow the job, and at the
end (or on Ctrl-C, after the job has committed its step) delete the JobSet and the node pools.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import yaml
from google.api_core.exceptions import GoogleAPICallError, RetryError
from kubernetes.client.exceptions import ApiException

from training import api
from training.api import Config, JobLook, RunStatus
from training.backends.base import BackendError, GKEHandle, Timeouts
from training.backends.gke import GKEBackend
from training.backends.gke_cluster import CloudCluster, first_line
from training.backends.gke_jobsets import JobSetError
from training.backends.gke_pools import TPUNodePoolError
from training.backends.spec import GKESpec, JobSpec
from training.backends.watch import Unreadable, watch
from training.gke import GKEConfigError, GKESettings, TPUSlice, check_config

log = logging.getLogger("rtrain.gke")
GIVE_UP_S = 900.0  # rtrain train stops following a job it could not look at for this long (it leaves it running)


class OutOfTouch(BackendError):
    """No look at a followed job succeeded for a long time: it may still run, with its node pools."""


def load_settings(path: str) -> GKESettings:
    """The ``gke`` settings of a YAML or JSON file (the DAG's ``gke`` object); the image may come from the environment."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise BackendError(f"--gke: cannot read {path}: {' '.join(str(e).split())}") from None
    if isinstance(raw, dict) and isinstance(raw.get("gke"), dict):
        raw = raw["gke"]  # a whole DAG conf: its gke object
    if not isinstance(raw, dict):
        raise BackendError(f"--gke: {path} must hold a mapping of gke keys (docs/gke.md), not {type(raw).__name__}")
    if not raw.get("image") and os.environ.get("RTRAIN_TRAIN_IMAGE"):
        raw["image"] = os.environ["RTRAIN_TRAIN_IMAGE"]
    return cast(GKESettings, raw)


def hosts_per_slice(gke: Mapping[str, Any]) -> int | None:
    """The hosts of one slice of the settings' TPU shape (None when the shape is not given)."""
    if not gke.get("machine_type") or not gke.get("tpu_topology"):
        return None
    try:
        return TPUSlice(str(gke["machine_type"]), str(gke["tpu_topology"])).hosts
    except GKEConfigError as e:
        raise BackendError(f"gke: {e}") from None


class GKERun:
    """One ``backend: gke`` run driven from here: its backend over a :class:`CloudCluster`."""

    def __init__(self, cfg: Config, gke: GKESettings, cluster: CloudCluster | None = None) -> None:
        self.cfg = cfg
        self.gke = gke
        self.cluster = cluster or CloudCluster(gke, log=log)
        self.backend = GKEBackend(gke, self.cluster, log, by="rtrain")  # refuses missing keys, naming them
        self.job = JobSpec(cfg, GKESpec(gke))

    def check(self) -> None:
        """Everything that can be known before a node pool is made: the config against the shape, then the cluster."""
        try:
            check_config(self.cfg, TPUSlice(self.gke["machine_type"], self.gke["tpu_topology"]))
        except GKEConfigError as e:
            raise BackendError(str(e)) from None
        self.cluster.check()

    def start(self, say: Callable[[str], None]) -> GKEHandle:
        """Create the node pools (done when enough for ``min_workers`` are up) and launch the job's JobSet.

        A cloud call that fails for good is ``training.api.LaunchError``, in one line.
        """
        try:
            return self._start(say)
        except (TPUNodePoolError, JobSetError, GoogleAPICallError, RetryError, ApiException) as e:
            raise api.LaunchError(f"gke: {first_line(e)}") from None

    def _start(self, say: Callable[[str], None]) -> GKEHandle:
        up = self.backend.provision(self.job)
        failed = "; ".join(f"{k}: {v}" for k, v in up.get("node_pools_failed", {}).items())
        say(
            f"node pools up: {', '.join(up.get('node_pools_up', [])) or 'none'}"
            + (
                f"; still being created: {', '.join(up['node_pools_creating'])}"
                if up.get("node_pools_creating")
                else ""
            )
            + (
                f"; refused for now, sent again while the job runs: {', '.join(up['node_pools_retrying'])}"
                if up.get("node_pools_retrying")
                else ""
            )
            + (f"; failed: {failed}" if failed else "")
        )
        handle = self.backend.launch(self.job, attempt=1)
        say(f"job {handle['job']}: JobSet {handle['namespace']}/{handle['jobset']}")
        return handle

    def follow(
        self,
        handle: GKEHandle,
        say: Callable[[str], None],
        on_status: Callable[[RunStatus], None],
        poll_s: float = 10.0,
        start_timeout_s: float = 900.0,
        give_up_s: float = GIVE_UP_S,
    ) -> JobLook:
        """Look at the job every ``poll_s`` until it ends; why pods wait is said once per change.

        A look that fails (the Kubernetes API's 5xx, a reset connection, a token refresh, the run
        root's storage) is said and the job looked at again at the next poll: the job runs on
        without us.  After ``give_up_s`` of nothing but failed looks: :class:`OutOfTouch`.
        """
        told = ""
        limits = Timeouts(start_timeout_s=start_timeout_s)
        for look in watch(self.backend, handle, limits, events_after=handle["events_after"], poll_s=poll_s):
            if isinstance(look, Unreadable):  # the job is not known to have ended: look again
                out_for = time.monotonic() - look.since
                if out_for >= give_up_s:
                    raise OutOfTouch(
                        f"no look at job {handle.get('job')} succeeded for {out_for:.0f}s ({first_line(look.error)})"
                    )
                say(f"looking at the job failed ({first_line(look.error)}); looking again in {poll_s:.0f}s")
                continue
            if look.status:
                on_status(look.status)
            if look.waiting != told:
                say(f"pods waiting: {look.waiting}" if look.waiting else "no pod waits any more")
                told = look.waiting
            if look.final:
                return look.job_look()
        raise AssertionError("the watch ends with a final look")  # pragma: no cover

    def drive(
        self,
        say: Callable[[str], None],
        on_status: Callable[[RunStatus], None],
        detach: bool = False,
        poll_s: float = 10.0,
        give_up_s: float = GIVE_UP_S,
    ) -> JobLook | None:
        """Start the job, follow it to its end, then delete its JobSet and node pools; the last look.

        Given back only on a final state, a failed start or Ctrl-C (after the job committed its
        step).  None, with all of it left up: ``detach``, or :class:`OutOfTouch` (said in one line).
        """
        handles: list[GKEHandle] = []
        keep = False
        try:
            handles.append(self.start(say))
            if detach:
                keep = True
                say(detached_line(self.cfg.run_uri, self.gke))
                return None
            return self.follow(handles[-1], say, on_status, poll_s=poll_s, give_up_s=give_up_s)
        except OutOfTouch as e:
            keep = True
            say(
                f"{e}: the job and its node pools are left up; follow it with `rtrain status {self.cfg.run_uri}`; "
                f"once it has ended, delete its node pools: {delete_pools_command(self.gke)}"
            )
            return None
        except KeyboardInterrupt:
            say("interrupted: the job stops at its next step boundary and commits it")
            self.stop("rtrain train was interrupted")
            return {"state": "stopped", "reason": "interrupted", "status": api.status(self.cfg.run_uri) or {}}
        finally:
            if not keep:
                say(self.release(handles))
            self.cluster.close()

    def stop(self, reason: str, wait_s: float = 120.0) -> None:
        """Ask the job to stop at a step boundary and wait (up to ``wait_s``) until it has."""
        api.stop_job(self.cfg.run_uri, reason)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            st = api.status(self.cfg.run_uri) or {}
            if st.get("state") in api.FINAL_STATES:
                return
            time.sleep(2.0)

    def release(self, handles: list[GKEHandle]) -> str:
        """Delete the JobSets and the node pools; what was deleted (or how to delete what could not be), in one line."""
        try:
            out = self.backend.release(self.job, [dict(h) for h in handles])
        except (TPUNodePoolError, GoogleAPICallError, RetryError, ApiException, BackendError) as e:
            return f"could not delete the node pools ({first_line(e)}): {delete_pools_command(self.gke)}"
        return (
            f"deleted JobSets {', '.join(out.get('jobsets_deleted', [])) or 'none'}; "
            f"node pools {', '.join(out.get('node_pools_deleted', [])) or 'none'}"
        )


def detached_line(run_uri: str, gke: Mapping[str, Any]) -> str:
    """What ``rtrain train --gke --detach`` says once the job is launched: how to follow, stop and clean up."""
    return (
        f"follow it with `rtrain status {run_uri}`; stop it with `rtrain stop {run_uri}`; "
        f"once it has ended, delete its node pools: {delete_pools_command(gke)}; "
        "while detached, the slices' leader pods repair the JobSet (their service account needs docs/gke.md's "
        "rtrain-repairs Role)"
    )


def delete_pools_command(gke: Mapping[str, Any]) -> str:
    """The gcloud command that deletes the run's node pools (for a detached run, once it has ended)."""
    project = f" --project={gke['project_id']}" if gke.get("project_id") else ""
    return "; ".join(
        f"gcloud container node-pools delete {pool} --cluster={gke['cluster_name']} --location={gke['location']}"
        f"{project} --quiet"
        for pool in gke.get("node_pools", [])
    )
