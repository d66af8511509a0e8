"""The failed leader pods a JobSet under exclusive placement must lose before its followers can be made again.

JobSet's pod webhooks (v0.12.0, ``pkg/webhooks/pod_webhook.go``: ``leaderPodForFollower``) admit a
follower pod (completion index > 0) of a slice's Job only when listing the pods named like the
slice's leader (``<jobset>-slice-<j>-0-*``) finds exactly one without a deletion timestamp.  A failed
pod keeps its object until pod garbage collection removes it: for a pod on a node that stays (a live
node, or a Spot VM stopped and made again under its name) only once the cluster holds more terminated
pods than GKE's threshold (1,000 under 100 nodes, else 5,000); some 40 s after its node is deleted for
a pod of a deleted node.  So once a slice's leader pod has failed and the Job has
made another, a follower made again is refused ("expected 1 leader pod ... but got 2") until the
failed one is gone, and a slice that lost its leader on a live node never grows back.

The fix: whoever watches the JobSet deletes each failed leader pod that the Job has replaced.  Safe
for the Job: it still accounts a deleted pod (its tracking finalizer keeps the object until it has),
and ``podReplacementPolicy: Failed`` makes the replacement only once the old pod has failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from training.gke.names import (
    COMPLETION_INDEX_ANNOTATION,
    EXCLUSIVE_TOPOLOGY_ANNOTATION,
    FAILURE_COUNT_ANNOTATION,
    IGNORED_COUNT_ANNOTATION,
    JOB_INDEX_LABEL,
    POD_FAILURE_BACKOFF_S,
)


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


# --- slices whose Job is better made again --------------------------------------------------------------


def failure_backoff(failures: int, base_s: float, cap_s: float) -> float:
    """The Job controller's wait before an index's next pod after its ``failures``-th failure: base doubling,
    at most cap (kubernetes ``pkg/controller/job/backoff_utils.go``: ``getRemainingTimeForFailuresCount``)."""
    if failures <= 0:
        return 0.0
    wait = base_s
    for _ in range(1, failures):
        wait *= 2
        if wait >= cap_s:
            return cap_s
    return min(wait, cap_s)


def held_back_slices(
    pods: Sequence[Mapping[str, Any]],
    now: float,
    backoff_s: tuple[float, float] = POD_FAILURE_BACKOFF_S,
    prompt_s: float | None = None,
) -> list[int]:
    """The slices a Spot reclaim took whole whose Job holds their next pods back longer than ``prompt_s``.

    The Job controller's per-index backoff counts every failure of an index, a reclaim's too, so a slice
    reclaimed for the n-th time waits 10 s * 2^(n-1) (at most 10 minutes) before its pods are made again,
    whenever its nodes return.  A slice qualifies when none of its pods is pending or running and each
    index's newest pod failed with a ``DisruptionTarget`` (a node's shutdown); its wait is read from the
    pods as the Job controller reads it (the failure-count annotations, the container's end).  Deleting
    its child Job makes the JobSet make a fresh one at once (``jobset_controller.go``: ``shouldCreateJob``),
    with no backoff: nothing of the slice runs, so nothing is lost.  ``prompt_s``: a wait not worth a
    new Job (default: the first backoff, what a first reclaim waits anyway).
    """
    prompt = backoff_s[0] if prompt_s is None else prompt_s
    by_slice: dict[str, dict[str, list[Mapping[str, Any]]]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp") or EXCLUSIVE_TOPOLOGY_ANNOTATION not in (meta.get("annotations") or {}):
            continue
        slice_ = str((meta.get("labels") or {}).get(JOB_INDEX_LABEL))
        index = str((meta.get("annotations") or {}).get(COMPLETION_INDEX_ANNOTATION))
        by_slice.setdefault(slice_, {}).setdefault(index, []).append(pod)
    out = []
    for slice_, indexes in by_slice.items():
        newest = [max(same, key=_failures_before) for same in indexes.values()]
        if not all(_failed(p) and _disrupted(p) for p in newest):
            continue
        waits = [failure_backoff(_failures_before(p) + 1, *backoff_s) - (now - _ended_at(p, now)) for p in newest]
        if max(waits) > prompt and slice_.isdigit():
            out.append(int(slice_))
    return sorted(out)


def _failures_before(pod: Mapping[str, Any]) -> int:
    """The index's failures (counted and ignored) before this pod, from the Job controller's annotations."""
    notes = (pod.get("metadata") or {}).get("annotations") or {}
    return sum(int(notes.get(k) or 0) for k in (FAILURE_COUNT_ANNOTATION, IGNORED_COUNT_ANNOTATION))


def _disrupted(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in conditions)


def _ended_at(pod: Mapping[str, Any], default: float) -> float:
    """When the pod's container ended (its ``finishedAt``), as the Job controller times a failure."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        finished = ((cs.get("state") or {}).get("terminated") or {}).get("finishedAt")
        if finished:
            return datetime.fromisoformat(str(finished).replace("Z", "+00:00")).timestamp()
    return default


def mispinned_slices(pods: Sequence[Mapping[str, Any]], pool_of: Mapping[str, str]) -> list[int]:
    """The slices whose running or pending follower is pinned to another node pool than their leader runs on.

    JobSet's pod webhook (v0.12.0, ``pkg/webhooks/pod_webhook.go``: ``setNodeSelector``) pins a follower at
    its creation to the pool of the one leader pod it finds, failed or not; the scheduler places a new
    leader on any free pool its exclusive-topology affinities allow.  A follower made while only the old
    failed leader existed stays pinned to the old pool, and v0.12.0 never moves it: the slice is split
    across two pools, or stuck.  ``pool_of``: each node's pool (its ``cloud.google.com/gke-nodepool``
    label).  Such a slice's Job is made again (its child Job deleted): the new Job's followers can only
    follow the new Job's leader (``podsOwnedBySameJob``).
    """
    leaders: dict[str, str] = {}
    pinned: dict[str, set[str]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        notes = meta.get("annotations") or {}
        topology = notes.get(EXCLUSIVE_TOPOLOGY_ANNOTATION)
        if not topology or meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") not in ACTIVE:
            continue
        slice_ = str((meta.get("labels") or {}).get(JOB_INDEX_LABEL))
        spec = pod.get("spec") or {}
        if notes.get(COMPLETION_INDEX_ANNOTATION) == "0":
            if spec.get("nodeName") in pool_of:
                leaders[slice_] = pool_of[spec["nodeName"]]
        elif (spec.get("nodeSelector") or {}).get(topology):
            pinned.setdefault(slice_, set()).add(spec["nodeSelector"][topology])
    return sorted(int(s) for s, pool in leaders.items() if s.isdigit() and any(p != pool for p in pinned.get(s, ())))


ACTIVE = ("Pending", "Running")


# --- one look's repairs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Repairs:
    """What one look at a JobSet's pods repairs: failed leader pods to delete, slices whose Job to make again.

    Each is named with the uid it was seen with: deleting under that uid as a precondition
    (``DeleteOptions.preconditions``) leaves alone a pod or Job that another repairer (the launcher's
    watch, another slice's agents) has had made again since.
    """

    leader_pods: list[tuple[str, str]] = field(default_factory=list)  # (pod name, pod uid)
    slice_jobs: list[tuple[int, str]] = field(default_factory=list)  # (slice, its child Job's uid; "" unknown)

    def __bool__(self) -> bool:
        return bool(self.leader_pods or self.slice_jobs)


def plan_repairs(pods: Sequence[Mapping[str, Any]], pool_of: Mapping[str, str] | None, now: float) -> Repairs:
    """The repairs one JobSet's pods need: :func:`replaced_leaders`, :func:`held_back_slices` and, given each
    node's pool (``pool_of``; None where no follower is pinned to a pool), :func:`mispinned_slices`."""
    by_name = {str((p.get("metadata") or {}).get("name")): p for p in pods}
    leaders = [(name, _uid(by_name[name])) for name in replaced_leaders(pods)]
    remake = set(held_back_slices(pods, now))
    if pool_of is not None:
        remake |= set(mispinned_slices(pods, pool_of))
    return Repairs(leaders, [(j, job_uid(pods, j)) for j in sorted(remake)])


def pins_followers(pods: Sequence[Mapping[str, Any]], pool_label: str) -> bool:
    """Is any pod pinned to a node pool (JobSet's webhook pins followers so): the nodes' pools then matter."""
    return any(((p.get("spec") or {}).get("nodeSelector") or {}).get(pool_label) for p in pods)


def job_uid(pods: Sequence[Mapping[str, Any]], slice_: int) -> str:
    """The uid of slice ``slice_``'s child Job as its newest pod names it (its owner reference); "" if none does."""
    owned = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if str((meta.get("labels") or {}).get(JOB_INDEX_LABEL)) != str(slice_):
            continue
        for ref in meta.get("ownerReferences") or []:
            if ref.get("kind") == "Job" and ref.get("uid"):
                owned.append((str(meta.get("creationTimestamp") or ""), str(ref["uid"])))
    return max(owned)[1] if owned else ""


def _uid(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")
