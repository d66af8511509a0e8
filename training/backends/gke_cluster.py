"""The GKE backend's cluster calls with Google credentials: node pools through the GKE API, JobSets through Kubernetes.

:class:`CloudCluster` is the one :class:`~training.backends.gke.GKECluster`: ``rtrain train`` makes it
with Application Default Credentials, and the Airflow hook hands it the credentials of Airflow's
Google connection.  Before anything is created, :meth:`CloudCluster.check` finds the credentials, the
project and the cluster, and says in one line which is missing.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from types import TracebackType
from typing import Any

import google.auth
import requests
from google.api_core.exceptions import GoogleAPICallError, NotFound, PermissionDenied, RetryError
from google.auth import exceptions as auth_errors
from google.auth.credentials import Credentials
from google.auth.transport.requests import Request
from google.cloud import container_v1
from kubernetes import client as k8s

from training.backends.base import BackendError, Log, PoolsUp, first_line
from training.backends.gke_jobsets import KubeJobSets
from training.backends.gke_pools import Backoff, NodePools, TPUNodePoolSpec, see_to
from training.gke import GKEConfigError, GKESettings, check_spot_grace
from training.gke.registry import image_found

SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
ADC_HELP = "gcloud auth application-default login, or GOOGLE_APPLICATION_CREDENTIALS=<a key file>"


class CloudCluster:
    """One run's GKE cluster, for its ``gke`` settings, with the given credentials or else ADC.

    ``credentials`` / ``project``: what Airflow's Google connection holds (None: Application Default
    Credentials, whose project is used when ``gke.project_id`` is left out).  ``cluster_manager`` and
    ``api_client``: the clients to use instead of the ones made from the credentials (a test's
    in-process servers).  The cluster is looked up once; :meth:`close` (or ``with``) closes the
    clients made here.
    """

    def __init__(
        self,
        gke: GKESettings,
        credentials: Credentials | None = None,
        project: str | None = None,
        log: Log | None = None,
        *,
        cluster_manager: container_v1.ClusterManagerClient | None = None,
        api_client: k8s.ApiClient | None = None,
        poll_s: float = 15.0,
        backoff: Backoff = Backoff(),
    ) -> None:
        self.gke = gke
        self.log = log
        self._credentials = credentials
        self._project = project
        self._cluster_manager = cluster_manager
        self._api_client = api_client
        self._pools: NodePools | None = None
        self._found: container_v1.Cluster | None = None  # the cluster as check() found it
        self._made: list[Any] = []  # the clients made here (not those given): closed by close()
        self.poll_s = poll_s
        self.backoff = backoff

    def __enter__(self) -> CloudCluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the clients made here; the cluster may be used again (they are made anew)."""
        for client in self._made:
            if isinstance(client, k8s.ApiClient):
                client.close()
                client.rest_client.pool_manager.clear()  # its connections to the control plane
                self._api_client = None
            else:
                client.transport.close()
                self._pools = None
        self._made = []

    # --- what is needed, found once -------------------------------------------------------------

    def find_credentials(self) -> tuple[Credentials, str | None]:
        """Application Default Credentials and their project (none: one line saying how to get them)."""
        try:
            creds, project = google.auth.default(scopes=list(SCOPES))
        except auth_errors.DefaultCredentialsError as e:
            raise BackendError(f"gke: no Google credentials ({ADC_HELP}): {first_line(e)}") from None
        return creds, project

    def credentials(self) -> Credentials:
        """The credentials given, else those :meth:`find_credentials` finds (once)."""
        if self._credentials is None:
            self._credentials, project = self.find_credentials()
            self._project = self._project or project
        return self._credentials

    @property
    def project(self) -> str:
        """``gke.project_id``, else the credentials' project (none: one line naming the key)."""
        if self.gke.get("project_id"):
            return str(self.gke["project_id"])
        self.credentials()
        if not self._project:
            raise BackendError(
                "gke.project_id: no Google Cloud project: set it, or give the credentials one "
                "(gcloud config set project PROJECT, or GOOGLE_CLOUD_PROJECT)"
            )
        return self._project

    def node_pools(self) -> NodePools:
        """The cluster's node pools through a ``ClusterManagerClient`` made with the credentials."""
        if self._pools is None:
            client = self._cluster_manager
            if client is None:
                client = container_v1.ClusterManagerClient(credentials=self.credentials())
                self._made.append(client)
            self._pools = NodePools(
                client,
                self.project,
                self.gke["location"],
                self.gke["cluster_name"],
                self.log,
                poll_s=self.poll_s,
                backoff=self.backoff,
            )
        return self._pools

    def check(self) -> container_v1.Cluster:
        """The cluster, found (once) with the credentials and the project; else one line naming what is missing."""
        if self._found is not None:
            return self._found
        pools = self.node_pools()
        where = f"project {pools.project}, location {pools.location}"
        try:
            self._found = pools.get_cluster()
            return self._found
        except NotFound:
            raise BackendError(f"gke.cluster_name: no cluster {pools.cluster!r} in {where}") from None
        except PermissionDenied as e:
            raise BackendError(
                f"gke: the credentials may not read cluster {pools.cluster!r} in {where}: {first_line(e)}"
            ) from None
        except (GoogleAPICallError, RetryError, auth_errors.GoogleAuthError) as e:
            raise BackendError(
                f"gke: the GKE API did not answer for cluster {pools.cluster!r} in {where}: {first_line(e)}"
            ) from None

    # --- the GKECluster calls -------------------------------------------------------------------

    def pool_specs(self) -> list[TPUNodePoolSpec]:
        """One pool per slice of the settings' TPU shape."""
        return [
            TPUNodePoolSpec(
                name=pool,
                machine_type=self.gke["machine_type"],
                tpu_topology=self.gke["tpu_topology"],
                spot=bool(self.gke.get("spot", False)),
                node_locations=tuple(self.gke.get("node_locations", ())),
                service_account=self.gke.get("node_service_account"),
                flex_start=bool(self.gke.get("flex_start", False)),
                queued_provisioning=bool(self.gke.get("queued_provisioning", False)),
                spot_shutdown_grace_s=self.gke.get("spot_shutdown_grace_s") if self.gke.get("spot") else None,
            )
            for pool in self.gke["node_pools"]
        ]

    def create_node_pools(self, need: int, timeout_s: float) -> PoolsUp:
        try:  # a Spot grace the cluster's pools cannot have: refused before any pool is made (no retry helps)
            check_spot_grace(self.gke, self.check().current_master_version)
        except GKEConfigError as e:
            raise BackendError(str(e)) from None
        return self.node_pools().create_all(self.pool_specs(), need, timeout_s)

    def see_to_node_pools(self) -> PoolsUp:
        return see_to(self.node_pools(), self.pool_specs())

    def delete_node_pools(self) -> list[str]:
        return self.node_pools().delete_all(list(self.gke["node_pools"]))

    def jobsets(self) -> KubeJobSets:
        return KubeJobSets(self.api_client())

    def find_image(self, image: str) -> bool | None:
        """Does the image's registry have it (a manifest ``HEAD``; Google's registries with the credentials' token)?
        None: the registry could not say."""

        def head(url: str, headers: dict[str, str]) -> int | None:
            try:
                return requests.head(url, headers=headers, timeout=15, allow_redirects=True).status_code
            except requests.RequestException:
                return None

        def token() -> str:
            creds = self.credentials()
            if not creds.valid:
                creds.refresh(Request())
            return str(creds.token or "")

        return image_found(image, head, token)

    def api_client(self) -> k8s.ApiClient:
        """A Kubernetes client for the cluster's control plane, authenticated with the credentials' token."""
        if self._api_client is None:
            cluster = self.check()
            ca = cluster.master_auth.cluster_ca_certificate
            self._api_client = k8s.ApiClient(
                kube_configuration(cluster, self.credentials(), ca_file(ca) if ca else None)
            )
            self._made.append(self._api_client)
        return self._api_client


def ca_file(certificate: str) -> str:
    """The file of a cluster's CA (base64, as the GKE API serves it): one per CA on this machine, shared, kept.

    Named by the CA's digest and written (atomically) only when missing, so however many watches and
    tasks talk to the cluster, the machine holds one file for it.
    """
    data = base64.b64decode(certificate)
    path = os.path.join(tempfile.gettempdir(), f"rtrain-gke-ca-{hashlib.sha256(data).hexdigest()[:16]}.crt")
    if not os.path.exists(path):
        with tempfile.NamedTemporaryFile("wb", dir=os.path.dirname(path), suffix=".part", delete=False) as f:
            f.write(data)
        os.replace(f.name, path)
    return path


def kube_configuration(cluster: container_v1.Cluster, creds: Credentials, ca_file: str | None) -> k8s.Configuration:
    """The Kubernetes client's configuration for a GKE cluster: its endpoint, its CA (``ca_file``), a refreshed token."""
    conf = k8s.Configuration()
    endpoint = cluster.endpoint or cluster.control_plane_endpoints_config.dns_endpoint_config.endpoint
    conf.host = f"https://{endpoint}"
    if ca_file is not None:
        conf.ssl_ca_cert = ca_file

    def token(c: Any) -> None:
        if not creds.valid:
            creds.refresh(Request())
        c.api_key["authorization"] = creds.token

    conf.api_key_prefix["authorization"] = "Bearer"
    conf.refresh_api_key_hook = token
    return conf
