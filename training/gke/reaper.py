"""The failed leader pods a JobSet under exclusive placement must lose before its followers can be made again.

JobSet's pod webhooks (v0.12.0, ``pkg/webhooks/pod_webhook.go``: ``leaderPodForFollower``) admit a
follower pod (completion index > 0) of a slice's Job only when listing the pods named like the
slice's leader (``<jobset>-slice-<j>-0-*``) finds exactly one without a deletion timestamp.  A failed
pod keeps its object until pod garbage collection removes it: at once never for a pod that failed
on a live node (``--terminated-pod-gc-threshold``, 12500 pods by default), some 40 s after its node
is deleted for a pod of a deleted node.  So once a slice's leader pod has failed and the Job has
made another, a follower made again is refused ("expected 1 leader pod ... but got 2") until the
failed one is gone, and a slice that lost its leader on a live node never grows back.

The fix: whoever watches the JobSet deletes each failed leader pod that the Job has replaced.  Safe
for the Job: it still accounts a deleted pod (its tracking finalizer keeps the object until it has),
and ``podReplacementPolicy: Failed`` makes the replacement only once the old pod has failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from training.gke.names import COMPLETION_INDEX_ANNOTATION, EXCLUSIVE_TOPOLOGY_ANNOTATION, JOB_INDEX_LABEL


def replaced_leaders(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """The names of the failed leader pods (index 0) that a newer pod of their slice's Job replaces.

    ``pods`` are one JobSet's pods as the API lists them (``kubectl get pods -o json``'s items).  A
    failed leader that nothing replaces yet (its Job out of retries, or the JobSet ending) is kept,
    with its log; a pod already being deleted is left alone.
    """
    leaders: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        if EXCLUSIVE_TOPOLOGY_ANNOTATION not in annotations or annotations.get(COMPLETION_INDEX_ANNOTATION) != "0":
            continue
        leaders.setdefault(str((meta.get("labels") or {}).get(JOB_INDEX_LABEL)), []).append(pod)
    stale = []
    for same in leaders.values():
        for pod in same:
            if not _failed(pod) or (pod.get("metadata") or {}).get("deletionTimestamp"):
                continue
            if any(other is not pod and not _failed(other) for other in same):
                stale.append(str(pod["metadata"]["name"]))
    return sorted(stale)


def _failed(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") == "Failed"
