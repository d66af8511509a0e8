"""Goodput from a run's events: the engine's own figure leaves out what a validation rollback gave up on purpose."""

from __future__ import annotations

import pytest

from training.checkpoint.goodput import goodput


def _run(rollback: bool) -> list[dict]:
    """One job: 20 steps of 1 s, (a validation rollback from step 20 to 10), the rest to step 30, then the end."""
    evs: list[dict] = [{"type": "launch", "time": 0.0, "job": "j1", "attempt": 1, "round": 1}]
    t = 0.0
    for step in range(1, 21):
        t += 1.0
        evs.append({"type": "progress", "time": t, "job": "j1", "attempt": 1, "step": step, "step_time": 1.0})
    start = 20
    if rollback:
        evs.append({"type": "rollback", "time": t, "job": "j1", "kind": "validation", "from_step": 20, "to_step": 10})
        start = 10
    for step in range(start + 1, 31):
        t += 1.0
        evs.append({"type": "progress", "time": t, "job": "j1", "attempt": 1, "step": step, "step_time": 1.0})
    evs.append({"type": "finished", "time": t + 2.0, "job": "j1", "step": 30})
    return evs


def test_a_rollback_on_purpose_lowers_goodput_but_not_the_engine_s() -> None:
    plain = goodput(_run(rollback=False), 30)
    rolled = goodput(_run(rollback=True), 30)
    assert plain["goodput"] == pytest.approx(30 / 32)
    assert plain["engine_goodput"] == pytest.approx(plain["goodput"])  # nothing given up on purpose
    assert rolled["badput_s"]["rollback_replay"] == pytest.approx(10.0)
    assert rolled["goodput"] == pytest.approx(30 / 42)
    assert rolled["engine_goodput"] == pytest.approx(30 / 32)


def test_a_round_s_first_step_is_badput_only_beyond_a_steady_step() -> None:
    # The round's step is ready 3 s after the launch and its first step done 2.5 s later: 1.5 s more than a step.
    evs: list[dict] = [
        {"type": "launch", "time": 0.0, "job": "j1", "attempt": 1, "round": 1},
        {"type": "worker_started", "time": 1.0, "job": "j1", "attempt": 1, "process_id": 0},
        {"type": "init", "time": 2.0, "job": "j1", "attempt": 1, "seconds": 1.0},
        {"type": "compiled", "time": 3.0, "job": "j1", "attempt": 1, "seconds": 1.0},
        {"type": "resumed", "time": 5.5, "job": "j1", "attempt": 1, "step": 1},
    ]
    t = 5.5
    for step in range(1, 11):
        evs.append({"type": "progress", "time": t, "job": "j1", "attempt": 1, "step": step, "step_time": 1.0})
        t += 1.0
    evs.append({"type": "finished", "time": t - 1.0, "job": "j1", "step": 10})
    g = goodput(evs, 10)
    assert g["badput_s"]["first_step"] == pytest.approx(1.5)
    assert g["badput_s"]["worker_start"] + g["badput_s"]["restore"] + g["badput_s"]["compile"] == pytest.approx(3.0)
    # Wall time is the productive steps plus the badput by cause: nothing counted twice, nothing left over.
    assert g["productive_s"] + sum(g["badput_s"].values()) == pytest.approx(g["wall_s"])
    assert g["badput_s"]["other"] == pytest.approx(0.0)
