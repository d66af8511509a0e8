"""The service's ETA replayed on the events of real ``rtrain bench --only service`` runs (tests/training/data/eta).

Each recording holds a low-priority job's and an urgent job's own events and the queue as the bench's
ETA saw it, right after the urgent job took the pool (the low job queued in its job, given its hosts
back once the other ended).  The forecast is rebuilt from the events written by then, as
``rtrain queue`` builds it, and held against when the low job really finished.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from training.service.eta import (
    Eta,
    RunOutlook,
    forecast,
    resize_seconds,
    resume_seconds,
    start_seconds,
    starting_since,
    step_seconds_by_hosts,
)
from training.service.policy import Demand

RECORDINGS = sorted((Path(__file__).parent / "data" / "eta").glob("service-*.json"))


def _replay(doc: dict[str, Any]) -> Eta:
    """The low job's ETA from what had been written when the bench asked for it."""
    at = doc["predicted_at"]
    outlooks = []
    for r in doc["queue_at_prediction"]:
        evs = [e for e in doc["events"][r["run"]] if e["time"] <= at]
        begun = starting_since(evs)
        outlooks.append(
            RunOutlook(
                demand=Demand(r["run"], r["priority"], r["min_hosts"], r["max_hosts"], r["submitted_at"]),
                steps_left=max(r["steps"] - r["step"], 0),
                hosts=r["hosts"],
                step_s=step_seconds_by_hosts(evs),
                resize_s=resize_seconds(evs),
                start_s=start_seconds(evs),
                resume_s=resume_seconds(evs),
                starting_for=at - begun if begun is not None else None,
            )
        )
    return forecast(doc["pool"], outlooks)["svc-low"]


@pytest.fixture(params=RECORDINGS, ids=[p.stem for p in RECORDINGS])
def recording(request: pytest.FixtureRequest) -> dict[str, Any]:
    return dict(json.loads(Path(request.param).read_text()))


def test_there_are_recordings_to_replay() -> None:
    assert len(RECORDINGS) >= 2


def test_the_eta_of_a_job_queued_then_given_its_hosts_back_is_within_the_figure_s_target(
    recording: dict[str, Any],
) -> None:
    eta = _replay(recording)
    actual = recording["eta_actual_s"]
    assert eta.seconds is not None, eta.assumptions
    assert abs(eta.seconds - actual) / actual <= 0.15, (eta.seconds, actual, eta.assumptions)


def test_a_job_given_its_hosts_back_is_charged_a_round_that_loads_its_kept_step(recording: dict[str, Any]) -> None:
    """Its first round compiled its step; the round it comes back to on the same hosts loads the step kept."""
    low = recording["events"]["svc-low"]
    (start,) = start_seconds(e for e in low if e["time"] <= recording["predicted_at"])
    (resumed,) = resume_seconds(low)  # what coming back cost in the run, measured after the fact
    eta = _replay(recording)
    (note,) = [n for n in eta.assumptions if n.startswith("resumes on 4 host(s)")]
    charged = float(note.rsplit("costing ", 1)[1].rstrip("s"))
    assert charged == pytest.approx(start.round_s - start.compile_s, abs=0.05)
    # Within 40% of what it really cost, and nearer to it than a start's whole round (its compile included).
    assert 0.6 <= charged / resumed <= 1.4, (charged, resumed, start)
    assert start.compile_s > 0 and abs(charged - resumed) < abs(start.round_s - resumed), (start, resumed)
