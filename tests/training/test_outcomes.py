"""How a worker's round ended and what a recovery cost, read from what the worker said (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.elastic.codes import WorkerExit
from training.elastic.host.outcomes import last_error, recovery_cost, worker_outcome
from training.elastic.rendezvous import Outcome


@pytest.mark.parametrize(
    ("seen", "code", "outcome", "reason"),
    [
        ({"finished": {}}, -6, Outcome.FINISHED, ""),  # said finished, then aborted with the coordinator
        ({"rescale_requested": {}}, 1, Outcome.RESCALE, ""),
        ({"guard": {"reason": "loss nan at step 7"}}, 3, Outcome.GUARD, "loss nan at step 7"),
        ({"notice": {"step": 12}}, 0, Outcome.NOTICE, "stopped at step 12 (preemption notice)"),
        ({"corrupt": {"reason": "step 10: crc"}}, int(WorkerExit.CORRUPT), Outcome.CORRUPT, "step 10: crc"),
        ({"error": {"peer_lost": 1}}, 1, Outcome.FAILED, "worker 0 on host h0 stopped: peer process 1 is gone"),
        ({}, -9, Outcome.FAILED, "worker 0 on host h0 killed by signal 9"),
        ({}, 2, Outcome.FAILED, "worker 0 on host h0 exit code 2"),
    ],
)
def test_what_the_worker_said_decides_its_outcome(seen: dict, code: int, outcome: Outcome, reason: str) -> None:
    assert worker_outcome(seen, code, 0, "h0") == (outcome, reason)


def test_last_error_is_the_workers_own_exception(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("step 1\nTraceback (most recent call last):\n  x\nValueError: bad shape\nshutting down\n")
    assert last_error(log) == "ValueError: bad shape"
    assert last_error(tmp_path / "missing.log") == ""


def test_a_recovery_costs_its_phases_and_counts_from_the_step_it_restored() -> None:
    recovery = {"fault_at": 100.0, "detected_at": 101.0, "step_s": 0.5, "steps_lost": 6, "resume_step": 20}
    seen = {
        "restore": {"time": 104.0, "seconds": 1.5, "step": 24, "tier": "local"},  # a save committed meanwhile
        "compiled": {"time": 106.0, "seconds": 1.0, "cache_hit": True},
    }
    cost = recovery_cost(recovery, seen, resumed_at=107.0)
    assert (cost.resume_step, cost.steps_lost, cost.tier, cost.compile_cached) == (24, 2, "local", True)
    lost = cost.lost_s
    assert (lost.detect, lost.relaunch, lost.restore, lost.compile) == (1.0, 1.5, 1.5, 1.0)
    assert (lost.first_step, lost.replay) == (0.5, 1.0)
    assert cost.lost_s.total == 6.5
    # Nothing reported beyond the leader's record: the leader's estimate stands, no phase is negative.
    bare = recovery_cost({"steps_lost": 3, "step_s": 1.0, "resume_step": 5}, {}, resumed_at=50.0)
    assert (bare.resume_step, bare.steps_lost, bare.lost_s.replay, bare.lost_s.detect) == (5, 3, 3.0, 0.0)
