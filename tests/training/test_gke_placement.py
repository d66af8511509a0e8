"""Placement as the scheduler and JobSet do it: free pools, exclusive topology, and the webhook pinning followers.

JobSet v0.12.0's pod webhook pins a follower, when it is made, to the pool of the one leader pod it finds,
a failed or terminating one too; the scheduler places a new leader on any free pool its affinities allow.
After two slices are reclaimed at once, a follower made again before its leader stays pinned to the old
pool while the leader lands on the other: the slice is split across pools and the other one is stuck.
The watch makes such a slice's Job again; the emulated cluster runs both.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from jobs import wait_for
from test_gke_pods import REPAIRERS, _toy_jobset, own_repairs

from training.gke.names import JOB_INDEX_LABEL, NODEPOOL_LABEL, child_job_name
from training.gke.pod_emulator import EmulatedJobSet
from training.gke.reaper import mispinned_slices

# The leader takes 1.5 s to stop on a notice (it commits the step), its follower stops at once: the follower's
# index is made again first.
PROGRAM = (
    'if [ "$RTRAIN_HOST_INDEX" = 0 ]; then trap "sleep 1.5; exit 6" TERM; else trap "exit 6" TERM; fi\n'
    "while true; do sleep 0.1; done\n"
)


def _pools(js: EmulatedJobSet, slice_: int) -> set[str]:
    return {js.nodes[p.node].pool for p in js.running(slice_)}


def test_a_follower_pinned_to_another_pool_than_its_leaders_is_found() -> None:
    def pod(slice_: int, index: int, node: str = "", pinned: str = "", phase: str = "Running") -> dict[str, object]:
        spec: dict[str, object] = {"nodeName": node} if node else {}
        if pinned:
            spec["nodeSelector"] = {NODEPOOL_LABEL: pinned}
        notes = {"alpha.jobset.sigs.k8s.io/exclusive-topology": NODEPOOL_LABEL}
        notes["batch.kubernetes.io/job-completion-index"] = str(index)
        meta = {"name": f"js-slice-{slice_}-{index}-x", "labels": {JOB_INDEX_LABEL: str(slice_)}, "annotations": notes}
        return {"metadata": meta, "spec": spec, "status": {"phase": phase}}

    pool_of = {"n-a0": "a", "n-a1": "a", "n-b0": "b", "n-b1": "b"}
    good = [pod(0, 0, "n-a0"), pod(0, 1, "n-a1", "a"), pod(1, 0, "n-b0"), pod(1, 1, "n-b1", "b")]
    assert mispinned_slices(good, pool_of) == []
    split = [pod(0, 0, "n-b0"), pod(0, 1, "n-a1", "a"), pod(1, 0, phase="Pending"), pod(1, 1, "n-b1", "b")]
    assert mispinned_slices(split, pool_of) == [0]  # slice 1's leader waits: nothing to compare yet
    failed_follower = [pod(0, 0, "n-b0"), pod(0, 1, "n-a1", "a", phase="Failed")]
    assert mispinned_slices(failed_follower, pool_of) == []


@pytest.mark.slow  # real pod processes through two reclaims (about 15 s)
@pytest.mark.parametrize("repairer", REPAIRERS)
def test_two_slices_reclaimed_at_once_come_back_whole_only_when_the_split_slice_is_made_again(
    tmp_path: Path, repairer: str
) -> None:
    """Made again by the launcher's watch, or, with none running, by the split slice's own leader pod."""
    m, env = _toy_jobset(tmp_path, PROGRAM)
    choice = {"pick": min}  # the scheduler's tie between free pools: the first placement one way, the next the other
    with EmulatedJobSet(
        m,
        tmp_path / "cluster",
        own_repairs(env) if repairer == "pods" else env,
        failure_backoff_s=(1.0, 60.0),
        repin=repairer == "watch",
        pick_pool=lambda pools: choice["pick"](pools),
        serve_api=repairer == "pods",
    ) as js:
        wait_for(lambda: len(js.running()) == 4, 20, "4 pods running")
        before = {j: _pools(js, j) for j in (0, 1)}
        assert before[0] != before[1] and all(len(p) == 1 for p in before.values())
        first = {j: js.indexes[(j, 0)].pods[-1].name for j in (0, 1)}
        js.preempt_slice(0, grace_s=3)
        js.preempt_slice(1, grace_s=3)
        # Each slice's follower is made again while its old leader still stops (pinned to its pool), then the leader.
        wait_for(
            lambda: (
                all(js.indexes[(j, 0)].pods[-1].name != first[j] for j in (0, 1))
                and all(js.indexes[(j, i)].pods[-1].phase == "Pending" for j in (0, 1) for i in (0, 1))
            ),
            20,
            "every index made again, waiting for nodes",
        )
        pinned = {j: js.indexes[(j, 1)].pods[-1].obj["spec"]["nodeSelector"][NODEPOOL_LABEL] for j in (0, 1)}
        assert pinned == {j: next(iter(before[j])) for j in (0, 1)}  # the old leaders' pools
        choice["pick"] = max
        js.return_slice(0)
        js.return_slice(1)
        if repairer == "none":
            wait_for(lambda: len(_pools(js, 0)) == 2, 20, "slice 0 split across both pools")
            time.sleep(3)
            assert len(_pools(js, 0)) == 2 and [p.index for p in js.running(1)] == [1]  # split; slice 1 stuck
            return
        wait_for(lambda: len(js.running()) == 4, 30, "both slices whole again")
        assert all(len(_pools(js, j)) == 1 for j in (0, 1)) and _pools(js, 0) != _pools(js, 1)
        assert js.jobs_made[0] == 2 and js.jobs_made[1] == 1  # the split slice's Job made again, once
        if js.api is not None:
            assert f"DELETE /apis/batch/v1/namespaces/default/jobs/{child_job_name(m.name, 0)}" in js.api.calls
