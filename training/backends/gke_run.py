"""A ``backend: gke`` run from a workstation: ``rtrain train --gke FILE`` with Application Default Credentials.

The same steps as the Airflow DAG's, in one process, by ``rtrain train``'s one driver
(:mod:`training.backends.drive`): check the settings and find the cluster (before anything is billed),
create the node pools, launch the JobSet, follow the job, and at the end (on Ctrl-C, once the job has
committed its step) delete the JobSet and the node pools.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import yaml
from google.api_core.exceptions import GoogleAPICallError, RetryError
from kubernetes.client.exceptions import ApiException

from training import api
from training.api import Config, JobLook, RunStatus
from training.backends.base import BackendError, GKEHandle, JobHandle, Provisioned, Released, Timeouts, first_line
from training.backends.drive import GIVE_UP_S, Drive, OutOfTouch, Say
from training.backends.gke import GKEBackend
from training.backends.gke_cluster import CloudCluster
from training.backends.gke_jobsets import JobSetError
from training.backends.gke_pools import TPUNodePoolError
from training.backends.spec import GKESpec, JobSpec
from training.gke import GKEConfigError, GKESettings, TPUSlice, check_config

log = logging.getLogger("rtrain.gke")


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
    """One ``backend: gke`` run driven from here: its backend over a :class:`CloudCluster`, by the one driver."""

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

    def driver(
        self,
        say: Callable[[str], None],
        on_status: Callable[[RunStatus], None] = lambda st: None,
        poll_s: float = 10.0,
        start_timeout_s: float = 900.0,
        give_up_s: float = GIVE_UP_S,
    ) -> Drive:
        """The driver of this run, saying its lines through ``say`` and its status through ``on_status``."""
        return Drive(
            self.backend,
            self.job,
            GKELines(self.cfg.run_uri, self.gke),
            Say(say, on_status),
            Timeouts(start_timeout_s=start_timeout_s),
            poll_s=poll_s,
            give_up_s=give_up_s,
            release_errors=CLOUD_ERRORS,
        )

    def start(self, say: Callable[[str], None]) -> GKEHandle:
        """Create the node pools (done when enough for ``min_workers`` are up) and launch the job's JobSet.

        A cloud call that fails for good is ``training.api.LaunchError``, in one line.
        """
        try:
            return cast(GKEHandle, self.driver(say).start())
        except (TPUNodePoolError, JobSetError, GoogleAPICallError, RetryError, ApiException) as e:
            raise api.LaunchError(f"gke: {first_line(e)}") from None

    def follow(
        self,
        handle: GKEHandle,
        say: Callable[[str], None],
        on_status: Callable[[RunStatus], None],
        poll_s: float = 10.0,
        start_timeout_s: float = 900.0,
        give_up_s: float = GIVE_UP_S,
    ) -> JobLook:
        """Look at the job every ``poll_s`` until it ends; why pods wait is said once per change (:meth:`Drive.follow`)."""
        return self.driver(say, on_status, poll_s, start_timeout_s, give_up_s).follow(handle)

    def drive(
        self,
        say: Callable[[str], None],
        on_status: Callable[[RunStatus], None],
        detach: bool = False,
        poll_s: float = 10.0,
        give_up_s: float = GIVE_UP_S,
    ) -> JobLook | None:
        """Start the job, follow it to its end, then delete its JobSet and node pools; the last look (:meth:`Drive.run`).

        A cloud call that fails for good while starting is ``training.api.LaunchError``, in one line.
        """
        try:
            return self.driver(say, on_status, poll_s, give_up_s=give_up_s).run(detach)
        except (TPUNodePoolError, JobSetError, GoogleAPICallError, RetryError, ApiException) as e:
            raise api.LaunchError(f"gke: {first_line(e)}") from None
        finally:
            self.cluster.close()

    def release(self, handles: list[GKEHandle]) -> str:
        """Delete the JobSets and the node pools; what was deleted (or how to delete what could not be), in one line."""
        drive = self.driver(lambda line: None)
        drive.handles = list(handles)
        return drive.release()


CLOUD_ERRORS = (TPUNodePoolError, GoogleAPICallError, RetryError, ApiException, BackendError)


class GKELines:
    """What ``rtrain train --gke`` says of its steps: the node pools, the JobSet, and how to clean up by hand."""

    def __init__(self, run_uri: str, gke: GKESettings) -> None:
        self.run_uri, self.gke = run_uri, gke

    def provisioned(self, up: Provisioned) -> str:
        failed = "; ".join(f"{k}: {v}" for k, v in up.get("node_pools_failed", {}).items())
        creating, retrying = up.get("node_pools_creating"), up.get("node_pools_retrying")
        return (
            f"node pools up: {', '.join(up.get('node_pools_up', [])) or 'none'}"
            + (f"; still being created: {', '.join(creating)}" if creating else "")
            + (f"; refused for now, sent again while the job runs: {', '.join(retrying)}" if retrying else "")
            + (f"; failed: {failed}" if failed else "")
        )

    def launched(self, handle: JobHandle) -> str:
        h = cast(GKEHandle, handle)
        return f"job {h['job']}: JobSet {h['namespace']}/{h['jobset']}"

    def detached(self, handle: JobHandle) -> str:
        return detached_line(self.run_uri, self.gke)

    def out_of_touch(self, error: OutOfTouch) -> str:
        return (
            f"{error}: the job and its node pools are left up; follow it with `rtrain status {self.run_uri}`; "
            f"once it has ended, delete its node pools: {delete_pools_command(self.gke)}"
        )

    def released(self, out: Released) -> str:
        return (
            f"deleted JobSets {', '.join(out.get('jobsets_deleted', [])) or 'none'}; "
            f"node pools {', '.join(out.get('node_pools_deleted', [])) or 'none'}"
        )

    def release_failed(self, error: Exception) -> str:
        return f"could not delete the node pools ({first_line(error)}): {delete_pools_command(self.gke)}"


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
