"""A job's JobSet on the cluster through the Kubernetes Python client: create, look, why pods wait, delete.

The manifests come from ``training.gke.render``; the calls are the ``CustomObjectsApi``
(``jobset.x-k8s.io``) and the ``CoreV1Api`` (the headless Service, pods, nodes) of one
``kubernetes.client.ApiClient``, which :mod:`training.backends.gke_cluster` makes for the cluster.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from training import api
from training.api import Config
from training.backends.base import GKEHandle
from training.gke import (
    ACCELERATOR_LABEL,
    JOBSET_API_VERSION,
    JOBSET_GROUP,
    JOBSET_NAME_LABEL,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    NODEPOOL_LABEL,
    GKECapacity,
    GKELaunch,
    GKEManifests,
    K8sObject,
    Repairs,
    TPUSlice,
    check_config,
    child_job_name,
    describe_waiting,
    jobset_state,
    node_is_usable,
    pins_followers,
    plan_repairs,
    pods_waiting,
    render,
)


class JobSetError(RuntimeError):
    """A JobSet that could not be created or attached to."""


class KubeJobSets:
    """The JobSets of one cluster (``training.backends.gke.JobSets``) over a Kubernetes ``ApiClient``."""

    def __init__(self, api_client: k8s.ApiClient) -> None:
        self.api_client = api_client
        self.custom = k8s.CustomObjectsApi(api_client)
        self.core = k8s.CoreV1Api(api_client)
        self.batch = k8s.BatchV1Api(api_client)

    def create(self, manifests: GKEManifests) -> K8sObject:
        """Create the JobSet and its headless Service; a JobSet of the same name is re-attached to.

        The Service is owned by the JobSet (``ownerReferences``), so deleting the JobSet, by us or
        by anyone, takes the Service with it.  If the JobSet controller made its own Service of
        that name first, that one is used.
        """
        try:
            jobset = dict(
                self.custom.create_namespaced_custom_object(
                    JOBSET_GROUP, JOBSET_VERSION, manifests.namespace, JOBSET_PLURAL, manifests.jobset
                )
            )
        except ApiException as e:
            if e.status != 409:
                raise
            existing = self.get(manifests.name, manifests.namespace)
            if existing is None:  # deleted between the two calls
                raise JobSetError(f"JobSet {manifests.name} was deleted while we created it; launch again") from None
            jobset = existing
        service = copy.deepcopy(manifests.service)
        uid = (jobset.get("metadata") or {}).get("uid")
        if uid:
            service["metadata"]["ownerReferences"] = [
                {
                    "apiVersion": JOBSET_API_VERSION,
                    "kind": "JobSet",
                    "name": manifests.name,
                    "uid": uid,
                    "blockOwnerDeletion": True,
                }
            ]
        try:
            self.core.create_namespaced_service(namespace=manifests.namespace, body=service)
        except ApiException as e:
            if e.status != 409:
                raise
        return jobset

    def start_job(
        self, cfg: Config, tpu: TPUSlice, launch: GKELaunch, by: str = "Airflow", num_slices: int | None = None
    ) -> GKEHandle:
        """Start a job of the run on GKE: take the run for it (lock, config), then create its JobSet.

        Refused (``training.api.LaunchRefused``, nothing written) while another job holds the run.
        The JobSet runs one host agent per pod on up to ``num_slices`` slices (default: as many as
        ``max_workers`` allows; missing slices wait Pending).
        """
        check_config(cfg, tpu)
        api.check_fit(cfg)  # a model that cannot fit at the minimum topology is refused before any TPU is used
        after = api.newest_event_key(cfg.run_uri)
        job = api.begin_job(cfg, backend="gke", by=by)
        manifests = render(cfg, tpu, launch, job, num_slices)
        obj = self.create(manifests)
        return GKEHandle(
            backend="gke",
            run_uri=cfg.run_uri,
            job=job,
            attached=False,
            jobset=manifests.name,
            namespace=manifests.namespace,
            num_slices=manifests.num_slices,
            launched_at=time.time(),
            state=jobset_state(obj),
            events_after=after,
        )

    def get(self, name: str, namespace: str) -> K8sObject | None:
        try:
            return dict(
                self.custom.get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, name)
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def state(self, name: str, namespace: str) -> str:
        """``missing``, ``running``, ``suspended``, ``completed`` or ``failed``."""
        return jobset_state(self.get(name, namespace))

    def pods(self, name: str, namespace: str) -> list[Mapping[str, Any]]:
        """The JobSet's pods, as the API serves them (plain dictionaries)."""
        pods = self.core.list_namespaced_pod(namespace=namespace, label_selector=f"{JOBSET_NAME_LABEL}={name}")
        return [self.api_client.sanitize_for_serialization(p) for p in pods.items]

    def waiting(self, name: str, namespace: str) -> str:
        """Why the JobSet's pods that do not run wait (scheduling, the image, ...), in one line; "" when none does.

        Makes :meth:`repair`'s repairs on the way, from the same look at the pods.
        """
        pods = self.pods(name, namespace)
        self.repair(name, namespace, pods)
        return describe_waiting(pods_waiting(pods))

    def repair(self, name: str, namespace: str, pods: Sequence[Mapping[str, Any]] | None = None) -> Repairs:
        """Repair the JobSet's slices (``training.gke.reaper``); what was found to repair.

        Deletes each failed leader pod a newer pod replaces, which JobSet's webhook would count, and the child
        Job of each reclaimed slice whose Job holds its pods back, or whose follower is pinned to another node
        pool than its leader's: JobSet makes it again at once.  Each delete holds the uid it was seen with as a
        precondition, so that several repairers (the launcher's watch, the slices' own agents) never delete
        what another one has had made again since.
        """
        pods = self.pods(name, namespace) if pods is None else pods
        pools = self.node_pools() if pins_followers(pods, NODEPOOL_LABEL) else None
        todo = plan_repairs(pods, pools, time.time())
        for pod, uid in todo.leader_pods:
            self._gone(self.core.delete_namespaced_pod, pod, namespace, uid)
        for j, uid in todo.slice_jobs:
            self._gone(self.batch.delete_namespaced_job, child_job_name(name, j), namespace, uid, "Background")
        return todo

    def node_pools(self) -> dict[str, str]:
        """Each node's pool (its ``cloud.google.com/gke-nodepool`` label)."""
        nodes = self.core.list_node(label_selector=NODEPOOL_LABEL).items
        return {n.metadata.name: n.metadata.labels[NODEPOOL_LABEL] for n in nodes}

    @staticmethod
    def _gone(delete: Any, obj: str, namespace: str, uid: str, propagation: str | None = None) -> None:
        """Delete ``obj`` if it is still the one of ``uid``; one gone already, or made again since (another
        repairer's), is no matter: the next look goes on."""
        body = k8s.V1DeleteOptions(
            preconditions=k8s.V1Preconditions(uid=uid) if uid else None, propagation_policy=propagation
        )
        try:
            delete(obj, namespace, body=body)
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def delete(self, name: str, namespace: str) -> bool:
        """Delete the JobSet (its Jobs and pods with it) and its Service; False if neither existed."""
        deleted = False
        try:
            self.custom.delete_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, name, propagation_policy="Foreground"
            )
            deleted = True
        except ApiException as e:
            if e.status != 404:
                raise
        try:
            self.core.delete_namespaced_service(name=name, namespace=namespace)
            deleted = True
        except ApiException as e:
            if e.status != 404:
                raise
        return deleted

    def capacity(self, tpu: TPUSlice, node_pools: Sequence[str] | None = None) -> GKECapacity:
        """The capacity source over this cluster's nodes."""
        return GKECapacity.from_core_v1(self.core, tpu, node_pools)

    def list_nodes(self, node_pool_name: str | None = None, accelerator: str | None = None) -> list[Any]:
        """V1Node objects of a pool (or of a TPU accelerator type), ready or not."""
        selectors = []
        if node_pool_name:
            selectors.append(f"{NODEPOOL_LABEL}={node_pool_name}")
        if accelerator:
            selectors.append(f"{ACCELERATOR_LABEL}={accelerator}")
        return list(self.core.list_node(label_selector=",".join(selectors)).items)

    def list_ready_nodes(self, node_pool_name: str) -> list[Any]:
        """The pool's nodes that are Ready, schedulable and not about to go away."""
        return [n for n in self.list_nodes(node_pool_name) if node_is_usable(n)]
