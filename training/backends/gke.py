"""The GKE backend: TPU node pools and one JobSet per job, one host agent per pod.

The calls to the cluster (node pools through the GKE API, JobSets through
Kubernetes) are a :class:`GKECluster`: :class:`~training.backends.gke_cluster.CloudCluster`,
with Application Default Credentials (``rtrain train``) or the credentials of
Airflow's Google connection (the Airflow hook hands them over).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence, Set
from typing import Any, Protocol, cast

from training import api
from training.api import Config, JobLook
from training.backends.base import BackendError, GKEHandle, Log, PoolsUp, Provisioned, Released, Timeouts
from training.backends.gke_preflight import check_before_billing
from training.backends.prepare import Preparation
from training.backends.spec import JobSpec
from training.gke import (
    GKEConfigError,
    GKELaunch,
    GKESettings,
    TPUSlice,
    check_launch,
    fit_grace,
    settings_keys,
    settings_launch,
    suspended_since,
)


class JobSets(Protocol):
    """A job's JobSet in the cluster: start it, read its state and why its pods wait, delete it."""

    def start_job(self, cfg: Config, tpu: TPUSlice, launch: GKELaunch, by: str = "Airflow") -> GKEHandle: ...

    def state(self, name: str, namespace: str) -> str: ...

    def get(self, name: str, namespace: str) -> dict[str, Any] | None: ...

    def waiting(self, name: str, namespace: str) -> str: ...

    def delete(self, name: str, namespace: str) -> bool: ...


class GKECluster(Protocol):
    """The cluster calls of the GKE backend, for the ``gke`` settings it was made with."""

    def create_node_pools(self, need: int, timeout_s: float) -> PoolsUp:
        """Create every node pool at once; return once ``need`` are up (raise naming each pool's fate if not)."""
        ...

    def see_to_node_pools(self) -> PoolsUp:
        """One look, without waiting, at the pools still on their way: creates refused for now are sent again."""
        ...

    def delete_node_pools(self) -> list[str]:
        """Delete the run's node pools (waiting for each); the names deleted."""
        ...

    def jobsets(self) -> JobSets: ...

    def find_image(self, image: str) -> bool | None:
        """Does the image's registry have it?  None: it could not say."""
        ...

    def close(self) -> None:
        """Close the clients made for the cluster (and whatever files they needed)."""
        ...


class GKEBackend:
    """TPU node pools and one JobSet per job on GKE.

    ``gke`` carries the cluster and the slice shape: ``project_id``, ``location``,
    ``cluster_name``, ``machine_type``, ``tpu_topology``, ``image``, ``node_pools`` (one per
    slice), and optionally ``namespace``, ``spot``, ``node_locations``, ``service_account``,
    ``gcp_conn_id``.  The JobSet runs one host agent per pod; the agents recover from lost
    hosts among themselves (a lost pod is recreated and rejoins), and write the run's
    status to the gs:// run root, which ``poll`` follows.
    """

    name = "gke"
    REQUIRED = ("location", "cluster_name", "machine_type", "tpu_topology", "image", "node_pools")

    def __init__(
        self,
        gke: GKESettings,
        cluster: GKECluster | None = None,
        log: Log | None = None,
        priority: str | None = None,
        by: str = "Airflow",
    ) -> None:
        check_settings(gke, priority)
        self.gke = gke
        self.cluster = cluster
        self.log = log
        self.priority = priority
        self.by = by  # who launches, in the run's records

    def _cluster(self) -> GKECluster:
        if self.cluster is None:
            raise BackendError(
                "backend 'gke': no cluster client was given (training.backends.backend makes one with ADC)"
            )
        return self.cluster

    def provision(self, job: JobSpec) -> Provisioned:
        """Create every node pool at once; done when enough for ``min_workers`` are up (the rest join later).

        Before any pool, what the launch would refuse once they bill is refused (``gke_preflight``)."""
        cfg = job.config
        tpu = TPUSlice(self.gke["machine_type"], self.gke["tpu_topology"])
        for line in check_before_billing(cfg, tpu, self.gke["image"], self._cluster().find_image):
            if self.log is not None:
                self.log.warning("%s", line)
        hosts_per_pool = tpu.hosts if tpu.multi_host else 1
        need = -(-cfg.elastic.min_workers // hosts_per_pool)
        up = self._cluster().create_node_pools(need, float(self.gke.get("provision_timeout_s", 3600.0)))
        return {
            "backend": self.name,
            "need": need,
            "node_pools_up": up.ready,
            "node_pools_creating": up.creating,
            "node_pools_retrying": up.retrying,
            "node_pools_failed": up.failed,
        }

    def placement(self) -> GKELaunch:
        """Where and how the JobSet's pods run (image, namespace, node pools, Spot and its grace, Kueue)."""
        return settings_launch(self.gke, self.priority)

    def launch(self, job: JobSpec, attempt: int) -> GKEHandle:
        """Take the run for a job and create its JobSet."""
        cfg = job.config
        tpu = TPUSlice(self.gke["machine_type"], self.gke["tpu_topology"])
        handle = self._cluster().jobsets().start_job(cfg, tpu, self.placement(), by=f"{self.by} (try {attempt})")
        handle["gke"] = self.gke
        return handle

    def poll(self, handle: Mapping[str, Any], timeouts: Timeouts, now: float | None = None) -> JobLook:
        """One look at the job, its JobSet and why its pods wait; the node pools still on their way are seen to.

        A job that has not started fails after ``start_timeout_s``, but not while Kueue holds its
        JobSet, and only after ``gke.provision_timeout_s`` while its pods wait for nodes the cluster
        is still to make (flex-start pools are created empty; a stockout may clear).
        """
        look = api.job_state(handle, float("inf"))  # the start timeout is applied below, knowing why pods wait
        if look["state"] in api.FINAL_STATES:
            return look
        jobsets = self._cluster().jobsets()
        state = jobsets.state(handle["jobset"], handle["namespace"])
        if state in ("failed", "missing"):
            return {**look, "state": "failed", "reason": f"JobSet {handle['jobset']} is {state}"}
        if state == "suspended":
            return self._queued(handle, look, jobsets.get(handle["jobset"], handle["namespace"]), now)
        try:  # the pools still on their way when the job was launched (a create refused for now is sent again)
            self._cluster().see_to_node_pools()
        except Exception as e:  # noqa: BLE001 - the job runs on the pools it has; the next look tries again
            if self.log is not None:
                self.log.warning("Looking at the node pools on their way failed: %s", e)
        try:
            waiting = jobsets.waiting(handle["jobset"], handle["namespace"])
        except Exception as e:  # noqa: BLE001 - why pods wait is a diagnosis: a failed look is no failure of the job
            if self.log is not None:
                self.log.warning("Reading the pods of %s failed: %s", handle["jobset"], e)
            waiting = ""
        if look["state"] == "pending":
            limit = float(timeouts.get("start_timeout_s", 900.0))
            if "Unschedulable" in waiting:
                limit = max(limit, float(self.gke.get("provision_timeout_s", 3600.0)))
            age = (time.time() if now is None else now) - float(handle.get("launched_at", time.time()))
            if age > limit:
                why = f"job {handle.get('job')} did not start within {limit:.0f}s"
                return {**look, "state": "failed", "reason": why + (f"; pods waiting: {waiting}" if waiting else "")}
        return {**look, "waiting": waiting} if waiting else look

    def _queued(
        self, handle: Mapping[str, Any], look: JobLook, jobset: dict[str, Any] | None, now: float | None
    ) -> JobLook:
        """A JobSet Kueue holds: waiting, or failed for good once held past ``admission_timeout`` (its pools bill)."""
        queue = self.gke.get("kueue_queue")
        limit = admission_timeout(self.gke)
        since = suspended_since(jobset) or float(handle.get("launched_at", time.time()))
        held = (time.time() if now is None else now) - since
        if limit is None or held <= limit:
            return {**look, "waiting": f"the JobSet is suspended: waiting for Kueue to admit it (queue {queue})"}
        tpu = TPUSlice(self.gke["machine_type"], self.gke["tpu_topology"])
        why = (
            f"Kueue did not admit JobSet {handle['jobset']} within gke.admission_timeout_s={limit:.0f}s (queue "
            f"{queue}): the LocalQueue may not exist in namespace {handle['namespace']}, or its ClusterQueue's "
            f"nominal quota of google.com/tpu is short of {tpu.chips_per_host * tpu.hosts} chips a slice "
            f"(kubectl -n {handle['namespace']} get localqueue {queue}; kubectl get clusterqueue -o wide); "
            "its node pools are released"
        )
        return {**look, "state": "failed", "reason": why, "retry": False}

    def close(self) -> None:
        """Close the cluster's clients (a watch that made the backend is done with it)."""
        if self.cluster is not None:
            self.cluster.close()

    def stop(self, handle: Mapping[str, Any], reason: str) -> None:
        """Ask the job's leader to end the job at a step boundary (its pods then complete)."""
        api.stop_job(str(handle["run_uri"]), reason)

    def release(self, job: JobSpec, handles: Sequence[Mapping[str, Any]]) -> Released:
        """Delete the jobs' JobSets, then the node pools."""
        cluster = self._cluster()
        jobsets = cluster.jobsets()
        deleted = [
            str(h["jobset"])
            for h in handles
            if h.get("jobset") and jobsets.delete(h["jobset"], h.get("namespace", "default"))
        ]
        return {"backend": self.name, "jobsets_deleted": deleted, "node_pools_deleted": cluster.delete_node_pools()}


# How long a JobSet may wait for Kueue's admission while node pools made for it are up and billed.
ADMISSION_TIMEOUT_S = 1800.0


def admission_timeout(gke: GKESettings) -> float | None:
    """``gke.admission_timeout_s``; by default 30 minutes, and none under ``queued_provisioning`` (its pools hold
    no node until Kueue admits the JobSet: waiting bills nothing)."""
    if "admission_timeout_s" in gke:
        return float(gke["admission_timeout_s"])
    return None if gke.get("queued_provisioning") else ADMISSION_TIMEOUT_S


def check_settings(gke: GKESettings, priority: str | None) -> None:
    """Refuse ``gke`` settings that cannot work, naming the key."""
    missing = [k for k in GKEBackend.REQUIRED if not gke.get(k)]
    if missing:
        raise BackendError(f"gke: backend 'gke' needs {', '.join('gke.' + k for k in missing)}")
    if gke.get("queued_provisioning") and not gke.get("kueue_queue"):
        raise BackendError(
            "gke.queued_provisioning: a queued pool makes nodes only for a ProvisioningRequest, which Kueue's "
            "admission check makes for the JobSet: it needs gke.kueue_queue (docs/gke.md)"
        )
    wait = gke.get("admission_timeout_s")
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int | float) or wait <= 0):
        raise BackendError(f"gke.admission_timeout_s: seconds, more than 0, got {wait!r}")
    if wait is not None and not gke.get("kueue_queue"):
        raise BackendError(
            "gke.admission_timeout_s: only a JobSet Kueue admits waits for admission: set gke.kueue_queue"
        )
    if gke.get("queued_provisioning") and not gke.get("flex_start"):
        raise BackendError("gke.queued_provisioning: GKE queues the provisioning of flex-start pools only")
    if priority is not None and not gke.get("kueue_queue"):
        raise BackendError(
            f"priority {priority!r} on GKE is a Kueue priority: it needs gke.kueue_queue (the LocalQueue's name)"
        )


def _settings(conf: Mapping[str, Any] | None) -> dict[str, Any]:
    """The conf's gke settings, the training image named where the launcher runs when the conf leaves it out."""
    gke = dict(conf or {})
    if not gke.get("image") and os.environ.get("RTRAIN_TRAIN_IMAGE"):  # named once, in docker/compose.yaml
        gke["image"] = os.environ["RTRAIN_TRAIN_IMAGE"]
    return gke


def _config_keys(gke: Mapping[str, Any]) -> dict[str, Any]:
    """The config keys a TPU type decides (none while the settings name no type: the checks say so later)."""
    if not (gke.get("machine_type") and gke.get("tpu_topology")):
        return {}
    try:
        return {api.dotted(k): v for k, v in settings_keys(cast(GKESettings, gke)).items()}
    except GKEConfigError as e:
        raise BackendError(f"gke: {e}") from None


def _fit(cfg: Config, gke: Mapping[str, Any], priority: str | None, given: Set[str]) -> Config:
    """The settings checked, the stop-and-commit fitted to the pods' grace unless the conf set it, then all the
    JobSet's render would refuse, before any node pool bills."""
    settings = cast(GKESettings, gke)
    check_settings(settings, priority)
    try:
        cfg = cfg if "checkpoint.preemption_grace_s" in given else fit_grace(cfg, settings)
        check_launch(cfg, settings, priority)
    except GKEConfigError as e:
        raise BackendError(f"gke: {e}") from None
    return cfg


PREPARATION = Preparation(_settings, _config_keys, _fit)
