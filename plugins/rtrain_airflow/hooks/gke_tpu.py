"""The GKE backend's cluster from Airflow: the engine's calls, with the credentials of Airflow's Google connection.

The engine owns GKE (``training.backends.gke_cluster``: node pools through
``google-cloud-container``, JobSets through the Kubernetes client); Airflow only
hands it the credentials and project of the connection ``gke.gcp_conn_id``.
"""

from __future__ import annotations

from google.auth.credentials import Credentials

from training.backends import BackendError, Log
from training.backends.base import first_line
from training.backends.gke_cluster import CloudCluster
from training.gke import GKESettings

DEFAULT_CONN_ID = "google_cloud_default"


class ProviderCluster(CloudCluster):
    """The run's GKE cluster with the credentials of Airflow's Google connection (``gke.gcp_conn_id``)."""

    def __init__(self, gke: GKESettings, log: Log | None = None) -> None:
        super().__init__(gke, log=log)

    def find_credentials(self) -> tuple[Credentials, str | None]:
        from airflow.providers.google.common.hooks.base_google import GoogleBaseHook

        conn_id = self.gke.get("gcp_conn_id", DEFAULT_CONN_ID)
        try:
            creds, project = GoogleBaseHook(gcp_conn_id=conn_id).get_credentials_and_project_id()
        except Exception as e:  # noqa: BLE001 - a connection missing or unusable, said in one line
            raise BackendError(
                f"gke.gcp_conn_id: Airflow's connection {conn_id!r} gave no credentials: {first_line(e)}"
            ) from None
        return creds, project or None
