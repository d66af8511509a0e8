"""The Job controller's per-index backoff as Kubernetes computes it, and a reclaimed slice that comes back promptly.

Every failure of an index, a Spot reclaim's ignored one too, doubles the wait before its next pod (10 s, at most
10 minutes), so a slice reclaimed again and again returns later and later.  The watch makes the slice's Job
again (JobSet makes a deleted child Job at once, with no backoff); the emulated cluster runs both.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from jobs import wait_for
from test_gke_pods import REPAIRERS, _policy_jobset, own_repairs

from training.gke.names import (
    COMPLETION_INDEX_ANNOTATION,
    EXCLUSIVE_TOPOLOGY_ANNOTATION,
    FAILURE_COUNT_ANNOTATION,
    IGNORED_COUNT_ANNOTATION,
    JOB_INDEX_LABEL,
)
from training.gke.pod_emulator import EmulatedJobSet
from training.gke.pod_specs import rfc3339
from training.gke.reaper import failure_backoff, held_back_slices


@pytest.mark.parametrize(
    ("failures", "wait"), [(0, 0), (1, 10), (2, 20), (3, 40), (4, 80), (6, 320), (7, 600), (12, 600)]
)
def test_the_backoff_doubles_from_10_s_to_at_most_10_minutes(failures: int, wait: float) -> None:
    assert failure_backoff(failures, 10.0, 600.0) == wait


def _pod(
    slice_: int,
    index: int,
    phase: str,
    *,
    counted: int = 0,
    ignored: int = 0,
    ended: float = 0.0,
    disrupted: bool = True,
) -> dict[str, Any]:
    """A JobSet pod as the API lists it, with the Job controller's failure counts before it."""
    status: dict[str, Any] = {"phase": phase, "conditions": []}
    if disrupted:
        status["conditions"].append({"type": "DisruptionTarget", "status": "True"})
    if phase == "Failed":
        terminated = {"exitCode": 6, "finishedAt": rfc3339(ended)}
        status["containerStatuses"] = [{"name": "agent", "state": {"terminated": terminated}}]
    return {
        "metadata": {
            "name": f"js-slice-{slice_}-{index}-{counted}{ignored}",
            "labels": {JOB_INDEX_LABEL: str(slice_)},
            "annotations": {
                EXCLUSIVE_TOPOLOGY_ANNOTATION: "cloud.google.com/gke-nodepool",
                COMPLETION_INDEX_ANNOTATION: str(index),
                FAILURE_COUNT_ANNOTATION: str(counted),
                IGNORED_COUNT_ANNOTATION: str(ignored),
            },
        },
        "status": status,
    }


def test_a_slice_reclaimed_whole_and_held_back_is_found_from_its_pods() -> None:
    now = 1_000_000.0
    # Slice 1, reclaimed for the 4th time 5 s ago: each index waits 80 s.  Slice 0 trains.
    pods = [_pod(0, 0, "Running"), _pod(0, 1, "Running")]
    pods += [_pod(1, i, "Failed", ignored=3, ended=now - 5) for i in (0, 1)]
    pods += [_pod(1, i, "Failed", ignored=2, ended=now - 100) for i in (0, 1)]  # older pods of the same indexes
    assert held_back_slices(pods, now) == [1]
    assert held_back_slices(pods, now + 80) == []  # the wait is over: the Job makes the pods itself
    assert held_back_slices(pods, now, prompt_s=100) == []
    # A first reclaim waits what a new Job would: nothing to gain.
    assert held_back_slices([_pod(1, i, "Failed", ended=now) for i in (0, 1)], now) == []
    # One index already made again: the slice is on its way back.
    assert held_back_slices([_pod(1, 0, "Failed", ignored=3, ended=now), _pod(1, 1, "Pending")], now) == []
    # A counted failure (a host error, not a node's shutdown) keeps its backoff and its budget.
    errors = [_pod(1, i, "Failed", counted=3, ended=now, disrupted=False) for i in (0, 1)]
    assert held_back_slices(errors, now) == []


BACKOFF = (1.0, 60.0)  # the Job's 10 s and 10 minutes, scaled down


def _reclaim_and_return(js: EmulatedJobSet, times: int) -> list[float]:
    """Reclaim slice 1 ``times`` times; each time its nodes return at once: how long its pods took to run again."""
    waits = []
    for _ in range(times):
        js.preempt_slice(1, grace_s=0.5)
        wait_for(lambda: len(js.running()) == 2, 20, "slice 1's pods gone")
        js.return_slice(1)
        t0 = time.monotonic()
        wait_for(lambda: len(js.running(1)) == 2, 60, "slice 1's pods running again")
        waits.append(time.monotonic() - t0)
    return waits


@pytest.mark.slow  # reclaims of real pod processes, with the backoffs waited out (about 30 s)
@pytest.mark.parametrize("repairer", REPAIRERS)
def test_a_slice_reclaimed_4_times_comes_back_promptly_only_when_its_job_is_made_again(
    tmp_path: Path, repairer: str
) -> None:
    """Made again by the launcher's watch, or, with none running, by the leader pod of the slice that is left."""
    m, env = _policy_jobset(tmp_path)
    with EmulatedJobSet(
        m,
        tmp_path / "cluster",
        own_repairs(env) if repairer == "pods" else env,
        failure_backoff_s=BACKOFF,
        recreate_held_back=repairer == "watch",
        serve_api=repairer == "pods",
    ) as js:
        wait_for(lambda: len(js.running()) == 4, 20, "4 pods running")
        waits = _reclaim_and_return(js, 4)
        if repairer == "none":  # the 4th reclaim is the index's 4th failure: 1 s * 2^3
            assert waits[3] >= 7.0 and waits[3] > waits[1] > 0, waits
            assert js.jobs_made[1] == 1 and [js.indexes[(1, i)].ignored for i in (0, 1)] == [4, 4]
        elif repairer == "watch":  # the 2nd and 4th reclaims wait more than a first: the Job is made again, fresh
            assert max(waits) < 4.0, waits
            assert js.jobs_made[1] == 3 and js.jobs_made[0] == 1
        else:  # the pods judge the backoff at its real scale (10 s doubling), so more reclaims are worth a new Job
            assert max(waits) < 4.0, waits
            assert js.jobs_made[1] >= 3 and js.jobs_made[0] == 1
        assert [js.indexes[(1, i)].failures for i in (0, 1)] == [0, 0]  # none counted against the budget
