"""The fault kinds' registry: each kind one class, its keys checked, and its hooks called by the side that fires it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from training.config import ConfigError, load_config
from training.elastic.chaos import JobChaos, WorkerChaos
from training.events import EventLog
from training.faults import (
    HOST_ACTIONS,
    KINDS,
    STORAGE_ACTIONS,
    WORKER_SIDE,
    ChaosError,
    Fault,
    FaultKind,
    WorkerSide,
    fault_kind,
    kinds_where,
    parse_chaos,
    spec_pattern,
)
from training.storage import open_store


class Halve(FaultKind):
    """``step=S``: from step S the update is halved (a kind registered by this test)."""

    name = "halve_for_test"
    required = frozenset({"step"})

    def lr_scale(self, fault: Fault, on: WorkerSide, step: int, scale: float) -> float:
        on.fire(fault, step)
        return scale / 2


@pytest.fixture
def halve() -> Iterator[type[Halve]]:
    fault_kind(Halve)
    try:
        yield Halve
    finally:
        del KINDS[Halve.name]


def test_every_built_in_kind_is_registered_with_its_keys_and_side() -> None:
    assert {"preempt", "crash", "capacity", "nan", "storage_outage", "damage_local"} <= set(KINDS)
    for name, kind in KINDS.items():
        assert kind.name == name and kind.__doc__ and kind.required, name
    assert WORKER_SIDE == set(KINDS) - {"capacity"} == kinds_where(worker_side=True)
    assert HOST_ACTIONS == {"preempt", "kill_agent", "freeze"} and STORAGE_ACTIONS == {
        "storage_outage",
        "storage_latency",
    }
    assert all(name in spec_pattern() for name in KINDS)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("explode:step=1", "unknown action 'explode'"),
        ("crash:step=1", "missing worker"),
        ("nan:step=1,worker=0", "unknown key"),
        ("capacity:to=2", "capacity needs step=S or after_s=T"),
        ("lr_spike:step=x,factor=2", "step must be a number"),
    ],
)
def test_a_bad_spec_is_refused_saying_why(spec: str, message: str) -> None:
    with pytest.raises(ChaosError, match=message):
        parse_chaos(spec)


def test_a_kind_s_config_rule_is_checked_when_the_config_is_resolved() -> None:
    with pytest.raises(ConfigError, match="damage_local needs the local tier"):
        load_config("tiny", None, ['elastic.chaos=["damage_local:worker=0,step=3"]'])
    cfg = load_config(
        "tiny", None, ['elastic.chaos=["damage_local:worker=0,step=3"]', "checkpoint.local_checkpoint_every=2"]
    )
    assert cfg.elastic.chaos == ["damage_local:worker=0,step=3"]


def test_a_new_kind_is_one_class_the_grammar_the_worker_and_the_leader_take(halve: type[Halve], tmp_path: Any) -> None:
    spec = "halve_for_test:step=4"
    assert parse_chaos(spec).kind is KINDS["halve_for_test"] and "halve_for_test" in spec_pattern()
    assert load_config("tiny", None, {"elastic.chaos": [spec]}).elastic.chaos == [spec]
    sent: list[dict[str, Any]] = []
    worker = WorkerChaos([spec, "lr_spike:step=2,factor=3"], rank=0, send=lambda _t, **kw: sent.append(kw))
    scales = [worker.learning_rate_scale(step) for step in range(1, 6)]
    assert scales == [1.0, 3.0, 3.0, 1.5, 3.0], "the spike holds from step 2 on; the new kind halves step 4 only"
    assert [m["action"] for m in sent] == ["lr_spike", "halve_for_test"]
    events = EventLog(open_store(str(tmp_path)), source="test")
    leader = JobChaos([spec, "capacity:to=1,step=9"], events, events.emit, None)
    assert leader.round_faults() == [spec], "a worker-side kind travels with the round; capacity stays with the leader"
