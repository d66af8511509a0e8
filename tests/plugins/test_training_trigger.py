"""The watching trigger: exact serialization, and its verdicts on real run roots (status.json + events)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk._shared.module_loading import import_string
from airflow.sdk.serde import deserialize, serialize
from rtrain_airflow.triggers.training import CLASSPATH, RTrainTrainingJobTrigger

from training.events import EventLog, write_status
from training.storage import open_store


def run_trigger(trigger: RTrainTrainingJobTrigger, timeout: float = 20) -> dict[str, Any]:
    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), timeout))


@pytest.fixture
def run(tmp_path: Path) -> tuple[str, Any, EventLog]:
    uri = str(tmp_path / "runs" / "r1")
    store = open_store(uri)
    return uri, store, EventLog(store, source="agent")


def handle(uri: str, job: str = "j1", launched_at: float | None = None) -> dict[str, Any]:
    return {
        "backend": "local",
        "run_uri": uri,
        "job": job,
        "attached": False,
        "controller_pid": os.getpid(),
        "launched_at": time.time() if launched_at is None else launched_at,
        "host": socket.gethostname(),
        "events_after": None,
    }


def old_status(store: Any, age_s: float, **fields: Any) -> None:
    """A status document last written ``age_s`` ago (by a job that has stopped writing)."""
    import json

    store.put("status.json", json.dumps({**fields, "updated_at": time.time() - age_s}).encode())


def test_serialize_round_trips_exactly() -> None:
    h = {
        "backend": "local",
        "run_uri": "/r/x",
        "job": "j1",
        "attached": False,
        "controller_pid": 12,
        "launched_at": 1.5,
        "host": "h",
        "events_after": None,
    }
    trigger = RTrainTrainingJobTrigger(
        run_uri="/r/x",
        handle=h,
        poll_interval=2.0,
        start_timeout_s=60.0,
        stale_after_s=360.0,
        events_after="events/0001-agent-ab.json",
    )
    classpath, kwargs = trigger.serialize()
    assert classpath == CLASSPATH == "rtrain_airflow.triggers.training.RTrainTrainingJobTrigger"
    assert kwargs == {
        "run_uri": "/r/x",
        "handle": h,
        "poll_interval": 2.0,
        "start_timeout_s": 60.0,
        "stale_after_s": 360.0,
        "events_after": "events/0001-agent-ab.json",
    }
    # Through Airflow's own encoding of trigger kwargs (what the triggerer stores), and back.
    again = import_string(classpath)(**deserialize(serialize(kwargs)))
    assert again.serialize() == (classpath, kwargs)


def test_finished_job_succeeds_and_reports_recoveries(run: tuple[str, Any, EventLog]) -> None:
    uri, store, log = run
    t0 = time.time()
    log.emit("launch", attempt=0, workers=2, mesh={"data": 2})
    log.emit("failure", attempt=0, reason="worker 1 killed by signal 9", fault_at=t0, detect_s=0.05)
    log.emit("launch", attempt=1, workers=2, mesh={"data": 2})
    time.sleep(0.05)
    log.emit("resumed", step=10)
    log.emit("finished", step=20)
    write_status(store, state="finished", step=20, latest_committed=20, failures=1, job="j1")
    event = run_trigger(RTrainTrainingJobTrigger(uri, handle(uri), poll_interval=0.05))
    assert event["status"] == "success" and event["step"] == 20 and event["failures"] == 1
    [rec] = event["recoveries"]
    assert rec["cause"] == "worker 1 killed by signal 9" and rec["resumed_step"] == 10
    assert 0.04 < rec["recovery_s"] < 5
    assert event["events_after"] and event["events_after"].startswith("events/")


def test_failed_job_fails_with_the_agents_reason(run: tuple[str, Any, EventLog]) -> None:
    uri, store, _ = run
    write_status(store, state="failed", reason="failure budget spent: 4 failures > max_failures=3", step=17, job="j1")
    event = run_trigger(RTrainTrainingJobTrigger(uri, handle(uri), poll_interval=0.05))
    assert event["status"] == "failed" and "failure budget spent" in event["message"]


def test_a_job_whose_hosts_are_all_gone_fails_the_wait_and_its_status_says_so(run: tuple[str, Any, EventLog]) -> None:
    from training import api

    uri, store, _ = run
    # Its last status says running, but no agent holds the run's lease any more (every host was killed).
    old_status(store, 60, state="running", step=12, job="j1")
    event = run_trigger(RTrainTrainingJobTrigger(uri, handle(uri), poll_interval=0.05))
    assert event["status"] == "failed" and "job j1 is gone" in event["message"]
    st = api.status(uri)
    assert st["state"] == "failed" and "job j1 is gone" in st["reason"]  # status never says running for it again


def test_a_job_that_never_starts_fails_after_start_timeout_s(run: tuple[str, Any, EventLog]) -> None:
    uri, store, _ = run
    # A status left by an earlier job is not this job's.
    write_status(store, state="failed", reason="an old failure", job="j0")
    trigger = RTrainTrainingJobTrigger(uri, handle(uri, "j1"), poll_interval=0.05, start_timeout_s=0.3)
    event = run_trigger(trigger)
    assert event["status"] == "failed" and "job j1 did not start" in event["message"]
    assert "an old failure" not in event["message"]


def test_a_silent_job_is_failed_after_stale_after_s(run: tuple[str, Any, EventLog]) -> None:
    from training.checkpoint.lock import RunLock

    uri, store, _ = run
    lock = RunLock(store, "a leader that stopped writing its status", lease_s=60, job="j1")
    lock.acquire()
    old_status(store, 1.0, state="running", step=3, job="j1")
    event = run_trigger(RTrainTrainingJobTrigger(uri, handle(uri), poll_interval=0.05, stale_after_s=0.5))
    assert event["status"] == "failed" and "no status update" in event["message"]


def test_live_job_keeps_the_trigger_waiting(run: tuple[str, Any, EventLog]) -> None:
    uri, store, _ = run
    write_status(store, state="recovering", step=5, job="j1")
    with pytest.raises(TimeoutError):
        run_trigger(RTrainTrainingJobTrigger(uri, handle(uri), poll_interval=0.05), timeout=0.5)
