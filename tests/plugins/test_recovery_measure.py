"""One measure of a recovery: ``rtrain report`` (and the demo's summary), the Training view and the Airflow task
give the same seconds, from one function, for a recovery that absorbed a second failure on its way."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from rtrain_airflow.runview import chart_data
from rtrain_airflow.triggers.training import RTrainTrainingJobTrigger

from training import api
from training.events import write_status


def _run(tmp_path: Path) -> tuple[str, float]:
    """A run whose host h1 is lost at step 15 and, while the job recovers, h2 too: one recovery, two failures.
    Its URI and the seconds from the first fault to training again."""
    import fake_runs
    from rtrain_airflow.hooks.training import RTrainHook

    uri = str(tmp_path / "twice")
    cfg = RTrainHook().build_config({"run_name": "twice", "root": str(tmp_path), "steps": 30, "checkpoint_every": 10})
    w = fake_runs._Writer(uri, time.time() - 600)
    w.store.put("config.json", cfg.to_json().encode())
    mesh = {"data": 4}
    w.emit("launch", attempt=1, round=1, workers=4, mesh=mesh, members=["h0", "h1", "h2", "h3"], resume="latest")
    w.emit("init", dt=1.0, step=0, mesh=mesh)
    w.steps(1, 15, 4)
    fault = w.t
    w.emit("failure", dt=1.2, attempt=1, reason="host h1 lost: no heartbeat", detect_s=1.2, fault_at=fault)
    w.emit("launch", dt=0.5, attempt=2, round=2, workers=3, mesh={"data": 3}, members=["h0", "h2", "h3"])
    second = w.t + 4.0
    w.emit("failure", dt=5.0, attempt=2, reason="host h2 lost: no heartbeat", detect_s=1.0, fault_at=second)
    w.emit("launch", dt=0.5, attempt=3, round=3, workers=2, mesh={"data": 2}, members=["h0", "h3"], resume="10")
    w.emit("restore", dt=3.0, step=10, mesh={"data": 2}, seconds=1.5)
    w.steps(11, 30, 2)  # with the round's "resumed" at step 11
    w.emit("finished", dt=0.5, step=30, failures=2, seconds=60.0)
    write_status(w.store, state="finished", step=30, steps_total=30, job="j1", workers=2, run_uri=uri)
    resumed = min(float(e["time"]) for e in api.events(uri, ("resumed",)) if float(e["time"]) > fault)
    return uri, round(resumed - fault, 3)


def _watch(uri: str) -> dict[str, Any]:
    handle = {
        "backend": "local",
        "run_uri": uri,
        "job": "j1",
        "attached": False,
        "controller_pid": os.getpid(),
        "launched_at": time.time(),
        "host": socket.gethostname(),
        "events_after": None,
    }

    async def first() -> dict[str, Any]:
        async for event in RTrainTrainingJobTrigger(uri, handle, poll_interval=0.05).run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), 30))


def test_the_report_the_training_view_and_the_airflow_task_measure_a_recovery_alike(tmp_path: Path) -> None:
    uri, took = _run(tmp_path)
    report = api.report(uri)
    assert report["failures"] == 2
    [rec] = report["recoveries"]
    assert rec["failures"] == 2 and rec["recovery_s"] == pytest.approx(took, abs=1e-3)
    assert "training again after" in api.format_report(report) and f"{took:.1f}s" in api.format_report(report)

    # The Training view: its marker and its goodput's "recovering" part.
    markers = chart_data(api.events(uri), {}, None)["markers"]
    [marker] = [m for m in markers if m["kind"] == "recovery"]
    assert marker["recovery_s"] == rec["recovery_s"] and marker["step"] == 11
    split = api.wall_split(report)
    assert split is not None and split["recovery_s"] == pytest.approx(rec["recovery_s"]), "one recovery, counted once"

    # The Airflow task (the watch's trigger, whose recoveries the demo's summary prints too).
    [seen] = _watch(uri)["recoveries"]
    assert seen["recovery_s"] == rec["recovery_s"] and seen["resumed_step"] == 11
