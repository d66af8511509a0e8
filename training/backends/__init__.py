"""Where a run's jobs run, chosen by name: the local slice (the default), the shared pool, GKE.

The Airflow hook and the CLI both choose here; each backend answers the verbs of
:class:`~training.backends.base.Backend`.
"""

from __future__ import annotations

from typing import cast

from training.backends.base import ALIVE, Backend, BackendError, Log, PoolsUp, Provisioned, Released
from training.backends.gke import GKEBackend, GKECluster, JobSets
from training.backends.local import LocalSliceBackend
from training.backends.pool import SharedPoolBackend
from training.gke import GKESettings

__all__ = [
    "ALIVE",
    "NAMES",
    "Backend",
    "BackendError",
    "GKEBackend",
    "GKECluster",
    "JobSets",
    "LocalSliceBackend",
    "Log",
    "PoolsUp",
    "Provisioned",
    "Released",
    "SharedPoolBackend",
    "backend",
]

NAMES = ("local", "gke")


def backend(
    name: str,
    *,
    gke: GKESettings | None = None,
    priority: str | None = None,
    cluster: GKECluster | None = None,
    log: Log | None = None,
    by: str = "Airflow",
) -> Backend:
    """The backend called ``name``; ``priority`` puts a local run in its root's shared pool (on GKE: Kueue's).

    ``cluster``: the GKE calls (node pools, JobSets) for the ``gke`` backend; by default a
    :class:`~training.backends.gke_cluster.CloudCluster` with Application Default Credentials.  ``by``: who provisions
    and tears down, in the run's records.
    """
    if name == "local":
        return SharedPoolBackend(priority, log, by) if priority else LocalSliceBackend(log, by)
    if name == "gke":
        settings = gke or cast(GKESettings, {})  # an empty one is refused, by key
        if cluster is None:
            from training.backends.gke_cluster import CloudCluster

            cluster = CloudCluster(settings, log=log)  # Application Default Credentials
        return GKEBackend(settings, cluster, log, priority, by)
    raise BackendError(f"backend: one of {', '.join(NAMES)}, not {name!r}")
