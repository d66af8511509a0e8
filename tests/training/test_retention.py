"""Retention rules, as tables of expected kept steps (Orbax's way of testing preservation policies)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from training.checkpoint.prune import retention_policy
from training.checkpoint.retention import (
    AnyOf,
    ExpireQuarantined,
    KeepBestN,
    KeepEveryNSteps,
    KeepLastN,
    Policy,
    StepInfo,
    decide,
    protected_steps,
)
from training.sections import CheckpointSection

NOW = 10_000.0


def S(step: int, state: str = "committed", loss: float | None = None, since: float | None = None) -> StepInfo:
    return StepInfo(step, state, None if loss is None else {"loss": loss}, since)


def committed(*steps: int) -> list[StepInfo]:
    return [S(s) for s in steps]


@pytest.mark.parametrize(
    "policy, steps, kept",
    [
        # KeepLastN
        (KeepLastN(2), committed(1, 2, 3, 4, 5), {4, 5}),
        (KeepLastN(0), committed(1, 2, 3), set()),
        (KeepLastN(10), committed(1, 2, 3), {1, 2, 3}),
        (KeepLastN(4), committed(1, 2, 3), {1, 2, 3}),
        (KeepLastN(3), committed(1, 2, 3), {1, 2, 3}),
        (KeepLastN(2), [S(1), S(2), S(3), S(4, "quarantined"), S(5, "rejected")], {2, 3}),
        (KeepLastN(2), [S(1), S(2, "validated", 0.1), S(3, "promoted", 0.2), S(4, "pruned")], {2, 3}),
        (KeepLastN(1), [], set()),
        # KeepBestN
        (KeepBestN(2, "loss"), [S(1, "validated", 0.5), S(2, "validated", 0.3), S(3, "validated", 0.4), S(4)], {2, 3}),
        (KeepBestN(2, "loss", "max"), [S(1, "validated", 0.5), S(2, "validated", 0.3), S(3, "validated", 0.4)], {1, 3}),
        (KeepBestN(1, "loss"), [S(1, "validated", 0.3), S(2, "validated", 0.3), S(3, "validated", 0.5)], {2}),
        (KeepBestN(2, "loss"), [S(1, "validated", math.nan), S(2, "validated", 0.9), S(3, "rejected", 0.1)], {2}),
        (KeepBestN(1, "loss"), [S(1, "promoted", 0.1), S(2, "validated", 0.2)], {1}),
        (KeepBestN(1, "accuracy"), [S(1, "validated", 0.1), S(2, "validated", 0.2)], set()),
        (KeepBestN(0, "loss"), [S(1, "validated", 0.1)], set()),
        # KeepEveryNSteps
        (KeepEveryNSteps(100), [S(100), S(150), S(200), S(250), S(300, "rejected")], {100, 200}),
        (KeepEveryNSteps(1), [S(1), S(2), S(3, "quarantined")], {1, 2}),
        (KeepEveryNSteps(1000), committed(100, 200), set()),
        # ExpireQuarantined
        (
            ExpireQuarantined(3600),
            [S(1, "quarantined", since=9000), S(2, "quarantined", since=1000), S(3), S(4, "quarantined")],
            {1, 4},
        ),
        (ExpireQuarantined(0), [S(1, "quarantined", since=NOW)], set()),
        (ExpireQuarantined(3600), [S(1, "rejected", since=9999)], set()),
        # Compositions
        (KeepLastN(1) | KeepEveryNSteps(2), committed(1, 2, 3, 4, 5), {2, 4, 5}),
        (
            AnyOf(KeepLastN(1), KeepBestN(1, "loss")),
            [S(1, "validated", 0.1), S(2, "validated", 0.5), S(3)],
            {1, 3},
        ),
        (
            AnyOf(KeepLastN(1), KeepBestN(1, "loss"), ExpireQuarantined(60)),
            [S(1, "validated", 0.1), S(2, "quarantined", since=NOW - 10), S(3, "quarantined", since=0), S(4)],
            {1, 2, 4},
        ),
        (AnyOf(), committed(1, 2), set()),
        (AnyOf(KeepLastN(1), AnyOf(KeepEveryNSteps(3))), committed(1, 2, 3, 4), {3, 4}),
    ],
    ids=str,
)
def test_policy_keeps_exactly(policy: Policy, steps: list[StepInfo], kept: set[int]) -> None:
    assert policy.keep(steps, NOW) == kept
    assert set(policy.explain(steps, NOW)) == kept


@pytest.mark.parametrize(
    "steps, pointer, pinned, protected",
    [
        (
            [S(1, "validated", 0.1), S(2), S(3, "rejected")],
            None,
            (),
            {1: ["newest validated"], 2: ["newest committed"]},
        ),
        (committed(1, 2, 3), 1, (), {1: ["resume pointer"], 3: ["newest committed"]}),
        (committed(1, 2, 3), 9, (2, 7), {2: ["pinned"], 3: ["newest committed"]}),
        (
            [S(1, "promoted", 0.1), S(2, "validated", 0.2), S(3, "quarantined")],
            2,
            (),
            {1: ["promoted"], 2: ["newest committed", "newest validated", "resume pointer"]},
        ),
        ([S(1, "rejected"), S(2, "pruned")], None, (), {}),
        ([], 3, (3,), {}),
    ],
)
def test_protected_steps(
    steps: list[StepInfo], pointer: int | None, pinned: tuple[int, ...], protected: dict[int, list[str]]
) -> None:
    assert protected_steps(steps, pointer, pinned) == protected


# A run where every protection applies: 6 newest usable, 4 newest validated,
# 2 the resume pointer, 1 promoted, 3 pinned; 5 is rejected, 7 quarantined long ago.
PROTECTED_RUN = [
    S(1, "promoted", 0.9),
    S(2, "validated", 0.8),
    S(3),
    S(4, "validated", 0.7),
    S(5, "rejected"),
    S(6),
    S(7, "quarantined", since=0),
]


@pytest.mark.parametrize(
    "policy",
    [
        KeepLastN(0),
        KeepLastN(1),
        KeepBestN(0, "loss"),
        KeepBestN(1, "loss", "max"),
        KeepEveryNSteps(1000),
        ExpireQuarantined(0),
        AnyOf(),
        AnyOf(KeepLastN(0), KeepBestN(0, "loss"), KeepEveryNSteps(1000), ExpireQuarantined(1)),
    ],
    ids=str,
)
def test_protected_set_wins_over_every_policy(policy: Policy) -> None:
    kept, deleted = decide(policy, PROTECTED_RUN, NOW, pointer=2, pinned=[3])
    assert {1, 2, 3, 4, 6} <= set(kept)
    assert set(deleted) == {1, 2, 3, 4, 5, 6, 7} - set(kept)
    assert 5 in deleted and 7 in deleted


def test_decide_gives_every_reason() -> None:
    steps = [S(10, "validated", 0.1), S(20), S(30), S(40)]
    kept, deleted = decide(KeepBestN(1, "loss") | KeepLastN(2), steps, NOW, pointer=None, pinned=[20])
    assert kept == {
        10: ["newest validated", "keep_best(1, loss, min)"],
        20: ["pinned"],
        30: ["keep_last(2)"],
        40: ["newest committed", "keep_last(2)"],
    }
    assert deleted == []


@pytest.mark.parametrize(
    "keys, expected",
    [
        (
            {"keep_last": 3, "keep_best": 2, "best_metric": "loss", "keep_every": 1000, "quarantine_ttl_s": 86400.0},
            AnyOf(KeepLastN(3), KeepBestN(2, "loss"), KeepEveryNSteps(1000), ExpireQuarantined(86400.0)),
        ),
        ({"keep_last": 3, "keep_best": 0, "keep_every": 0, "quarantine_ttl_s": 0.0}, AnyOf(KeepLastN(3))),
        ({"keep_last": 0, "keep_best": 0, "keep_every": 0, "quarantine_ttl_s": 0.0}, AnyOf()),
    ],
)
def test_retention_policy_of_the_checkpoint_section(keys: dict, expected: Policy) -> None:
    assert retention_policy(CheckpointSection.model_validate(keys)) == expected


def test_retention_policy_best_mode() -> None:
    keys = {"keep_last": 0, "keep_best": 1, "best_metric": "accuracy", "keep_every": 0, "quarantine_ttl_s": 0}
    section = CheckpointSection.model_validate(keys)
    assert retention_policy(section, best_mode="max") == AnyOf(KeepBestN(1, "accuracy", "max"))


@pytest.mark.parametrize("bad", [lambda: KeepLastN(-1), lambda: KeepEveryNSteps(0), lambda: KeepBestN(1, "loss", "up")])
def test_invalid_rules_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        bad()


def test_planning_imports_no_ml_library() -> None:
    # The Airflow side imports these to plan and report; DAG parsing must stay cheap.
    code = (
        "import sys, training.checkpoint.retention, training.checkpoint.ledger, training.checkpoint.prune, training.api;"
        "bad = [m for m in ('jax', 'orbax', 'flax') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
