"""The Job and JobSet controllers of the emulated cluster: each slice's Indexed Job making its pods again, as
Kubernetes and JobSet v0.12.0 do (what :class:`training.gke.pod_emulator.EmulatedJobSet` runs each tick).

What each index of a slice's Job does with a pod's end follows the Job's ``podFailurePolicy`` and
``backoffLimitPerIndex``; when it makes the next pod follows the Job controller's per-index backoff;
a deleted child Job is made again by the JobSet controller, with none of its old pods or backoffs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from training.gke.names import FAILURE_COUNT_ANNOTATION, IGNORED_COUNT_ANNOTATION, K8sObject
from training.gke.pod_specs import Node, Pod, admit, job_container, rule_action
from training.gke.reaper import failure_backoff

# A pod create the API refused (a webhook) is retried by the Job's rate-limited requeue, 1 s doubling to 60 s
# (kubernetes pkg/controller/job/job_controller.go: DefaultJobApiBackOff, MaxJobApiBackOff).  A failed pod's
# wait is POD_FAILURE_BACKOFF_S's (training.gke.names), by training.gke.reaper.failure_backoff.
API_BACKOFF_S = (1.0, 60.0)


@dataclass
class Index:
    """One completion index of one slice's Job: its pods so far, and its failures (counted, ignored)."""

    pods: list[Pod] = field(default_factory=list)
    failures: int = 0  # counted against backoffLimitPerIndex
    ignored: int = 0  # ignored by the podFailurePolicy (a DisruptionTarget): no budget, but backoff all the same
    done: bool = False  # succeeded
    failed: bool = False  # out of retries (backoffLimitPerIndex) or FailIndex: not made again
    create_at: float | None = 0.0  # when the Job controller makes its next pod (None: it has one)
    refused: int = 0  # creates refused in a row (the API backoff's exponent)
    accounted: str = ""  # the last pod whose end the Job controller has acted on


class JobControllers:
    """Each slice's Job (its indexes' pods made, accounted and made again) and the JobSet's reaction to its Jobs.

    ``delete_job(j)`` is the API's delete of slice ``j``'s child Job (background propagation): its pods are
    deleted, and once they are gone the JobSet controller makes the Job again
    (``pkg/controllers/jobset_controller.go``: ``constructJobsFromTemplate`` / ``shouldCreateJob`` make every
    replica whose Job does not exist), fresh: no failures, no backoff.
    """

    job_spec: K8sObject
    indexes: dict[tuple[int, int], Index]
    nodes: dict[str, Node]
    failure_backoff_s: tuple[float, float]
    refusals: list[str]
    failed_jobs: dict[int, str]
    state: str
    deleted: bool
    jobs_made: dict[int, int]  # slice -> how many times its Job was made (1 at the start)
    deleting_jobs: set[int]  # slices whose Job is being deleted

    def _pods(self) -> list[Pod]:
        raise NotImplementedError

    def _new_pod(self, j: int, i: int) -> Pod:
        raise NotImplementedError

    def _delete_pod(self, pod: Pod, disruption: str, grace_s: float | None) -> None:
        raise NotImplementedError

    def delete_job(self, slice_: int) -> None:
        """Delete slice ``slice_``'s child Job: its pods are deleted; the JobSet makes the Job again once they are gone."""
        self.deleting_jobs.add(slice_)
        for (j, _), idx in self.indexes.items():
            if j == slice_:
                for pod in idx.pods:
                    self._delete_pod(pod, "", None)

    def _jobset_controller(self, now: float) -> None:
        """Make again each deleted child Job whose pods are all gone (their containers ended, or never started)."""
        for j in sorted(self.deleting_jobs):
            mine = [p for (s, _), idx in self.indexes.items() if s == j for p in idx.pods]
            if any(p.proc is not None and p.exit_code is None for p in mine):
                continue
            for pod in mine:
                pod.removed = True
            for key in [k for k in self.indexes if k[0] == j]:
                self.indexes[key] = Index(create_at=now)
            self.jobs_made[j] = self.jobs_made.get(j, 1) + 1
            self.deleting_jobs.discard(j)

    def _job_controller(self, j: int, i: int, idx: Index, now: float) -> None:
        """The Job controller for one index: a pod's end accounted (done, made again, failed), the next one made."""
        if self.state or self.deleted or idx.done or idx.failed or j in self.deleting_jobs:
            return
        pod = idx.pods[-1] if idx.pods else None
        if pod is not None and pod.name != idx.accounted:
            if pod.exit_code is None and not (pod.proc is None and pod.deleting_since is not None):
                return  # pending, running or terminating: podReplacementPolicy Failed waits for its end
            idx.accounted = pod.name
            if not self._account(j, idx, pod, now):
                return
        if idx.create_at is not None and now >= idx.create_at:
            self._create(j, i, idx, now)

    def _account(self, j: int, idx: Index, pod: Pod, now: float) -> bool:
        """Act on a pod's end; True when the index gets another pod (``idx.create_at`` set)."""
        if pod.exit_code is None:  # deleted before it ran: made again
            idx.create_at = now
            return True
        if pod.phase == "Succeeded":
            idx.done = True
            self._job_ended(j)
            return False
        rules = (self.job_spec.get("podFailurePolicy") or {}).get("rules") or []
        action = rule_action(rules, pod.exit_code, bool(pod.disruption), job_container(self.job_spec)["name"])
        if action == "FailJob":
            self._fail_job(j, f"pod {pod.name} exited {pod.exit_code} (podFailurePolicy FailJob)")
            return False
        if action == "Ignore":
            idx.ignored += 1
        else:
            idx.failures += 1
        if action == "FailIndex" or idx.failures > int(self.job_spec.get("backoffLimitPerIndex", 0)):
            idx.failed = True  # not made again; the Job goes on with its other indexes
            self._job_ended(j)
            return False
        ended = pod.ended if pod.ended is not None else now
        idx.create_at = ended + failure_backoff(idx.failures + idx.ignored, *self.failure_backoff_s)
        return True

    def _create(self, j: int, i: int, idx: Index, now: float) -> None:
        """The Job controller's create, through JobSet's webhooks; a refused one is retried with the API backoff."""
        pod = self._new_pod(j, i)
        notes = pod.obj["metadata"]["annotations"]
        notes[FAILURE_COUNT_ANNOTATION], notes[IGNORED_COUNT_ANNOTATION] = str(idx.failures), str(idx.ignored)
        why = admit(pod, self._pods(), self.nodes)
        if why:
            self.refusals.append(f"{pod.name}: {why}")
            base, cap = API_BACKOFF_S
            idx.create_at = now + min(cap, base * 2**idx.refused)
            idx.refused += 1
            return
        idx.pods.append(pod)
        idx.create_at, idx.refused = None, 0

    def _job_ended(self, j: int) -> None:
        """A slice's Job ends once each of its indexes has: Complete when all succeeded, else Failed."""
        mine = [(i, x) for (s, i), x in sorted(self.indexes.items()) if s == j]
        if not all(x.done or x.failed for _, x in mine):
            return
        failed = [i for i, x in mine if x.failed]
        if failed:
            self._fail_job(
                j, f"indexes {failed} failed (backoffLimitPerIndex {self.job_spec.get('backoffLimitPerIndex')})"
            )
        else:
            self.state = "Completed"  # successPolicy Any over the slice Jobs
            self._end_all()

    def _fail_job(self, j: int, why: str) -> None:
        self.failed_jobs[j] = why
        self.state = "Failed"  # failurePolicy.maxRestarts 0: a failed Job fails the JobSet
        self._end_all()

    def _end_all(self) -> None:
        for pod in self._pods():
            self._delete_pod(pod, "", None)
