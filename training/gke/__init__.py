"""Google Kubernetes Engine without a cluster: the JobSet of a job, TPU shapes, capacity from nodes.

The names here are the GKE surface the Airflow side and the backends use; ``pod_emulator``
runs a rendered JobSet's pods as local processes (tests and trials).
"""

from training.gke.cluster_state import (
    GKECapacity,
    describe_waiting,
    jobset_state,
    node_is_usable,
    pods_waiting,
    suspended_since,
)
from training.gke.launch import (
    GKELaunch,
    GKESettings,
    check_config,
    check_launch,
    check_spot_grace,
    fit_grace,
    settings_keys,
    settings_launch,
    settings_preemption_grace_s,
    spot_pod_grace_s,
    spot_shutdown_grace_s,
)
from training.gke.manifests import GKEManifests, render, workload_priority_classes
from training.gke.names import (
    ACCELERATOR_LABEL,
    JOBSET_API_VERSION,
    JOBSET_GROUP,
    JOBSET_NAME_LABEL,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    NODEPOOL_LABEL,
    GKEConfigError,
    K8sObject,
    child_job_name,
)
from training.gke.reaper import Repairs, pins_followers, plan_repairs
from training.gke.tpu import TPUSlice

__all__ = [
    "ACCELERATOR_LABEL",
    "JOBSET_API_VERSION",
    "JOBSET_GROUP",
    "JOBSET_NAME_LABEL",
    "JOBSET_PLURAL",
    "JOBSET_VERSION",
    "NODEPOOL_LABEL",
    "GKECapacity",
    "GKEConfigError",
    "GKELaunch",
    "GKEManifests",
    "GKESettings",
    "K8sObject",
    "Repairs",
    "TPUSlice",
    "check_config",
    "check_launch",
    "check_spot_grace",
    "child_job_name",
    "describe_waiting",
    "fit_grace",
    "jobset_state",
    "node_is_usable",
    "pins_followers",
    "plan_repairs",
    "pods_waiting",
    "suspended_since",
    "render",
    "settings_launch",
    "settings_keys",
    "settings_preemption_grace_s",
    "spot_pod_grace_s",
    "spot_shutdown_grace_s",
    "workload_priority_classes",
]
