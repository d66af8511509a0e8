"""``rtrain train``, the deferrable trigger and the polling sensor are adapters over one watch of a job.

One real job on the local slice (a worker crash and its recovery included) is followed live by the CLI,
then watched again by the engine's ``watch()``, the Airflow trigger and the sensor: each tells the same
events, in the order the run wrote them, and each ends on the same outcome.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
from rtrain_airflow.sensors.training import RTrainTrainingJobSensor
from rtrain_airflow.triggers.training import RELAYED, RTrainTrainingJobTrigger

from training import api
from training.backends import JobSpec, LocalSliceBackend
from training.backends.watch import Look, stale_after_s, timeouts, watch
from training.cli import Exit, main
from training.elastic.local.local_slice import SHOWN
from training.event_text import describe

# What both the CLI and the Airflow side tell of a run (each also tells a few kinds the other does not).
TOLD_BY_ALL = SHOWN & set(RELAYED)


def in_order(wanted: list[str], lines: list[str]) -> bool:
    """Does ``lines`` hold each of ``wanted``, in that order (other lines between them allowed)?"""
    it = iter(lines)
    return all(any(line == w for line in it) for w in wanted)


def rtrain_lines(logs: list[dict[str, Any]]) -> list[str]:
    return [str(r["event"]).removeprefix("[rtrain] ") for r in logs if str(r["event"]).startswith("[rtrain] ")]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A real job run to its end by ``rtrain train`` in the foreground: its run URI and what the CLI printed."""
    import contextlib
    import io

    from training import data

    root = tmp_path_factory.mktemp("one-watch")
    dataset = str(root / "dataset")
    data.prepare(None, dataset, 64, max_bytes=200_000)
    args = [f"root={root / 'runs'}", "run_name=w", f"dataset={dataset}", f"compilation_cache={root / 'jax'}"]
    args += ["steps=12", "min_workers=1", "max_workers=1", "checkpoint_every=5", "log_every=2"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["train", "--chaos", "crash:worker=0,step=7", *args])
    assert rc == Exit.OK, out.getvalue()[-3000:]
    return str(root / "runs" / "w"), out.getvalue()


@pytest.mark.slow
def test_the_cli_the_trigger_and_the_sensor_tell_one_job_s_events_alike(finished_run: tuple[str, str]) -> None:
    run_uri, printed = finished_run
    cfg = api.load_run_config(run_uri)
    job = str((api.status(run_uri) or {})["job"])
    handle: dict[str, Any] = {"backend": "local", "run_uri": run_uri, "job": job, "attached": False}
    handle |= {"launched_at": time.time(), "events_after": None}

    # The engine's watch of the job that is over: one look, every event of the run, success.
    looks = list(watch(LocalSliceBackend(), handle, timeouts(cfg.elastic), poll_s=0.1))  # type: ignore[arg-type]
    assert len(looks) == 1 and isinstance(looks[0], Look), looks
    final = looks[0]
    assert (final.state, final.outcome) == ("finished", "success")
    assert [e["_key"] for e in final.events] == [e["_key"] for e in api.events(run_uri)]
    told = [describe(e) for e in final.events if e["type"] in TOLD_BY_ALL]
    kinds = [e["type"] for e in final.events if e["type"] in TOLD_BY_ALL]
    assert kinds.count("launch") == 2 and {"chaos", "failure", "finished"} <= set(kinds), kinds  # crash, recovery

    # rtrain train followed it live: each event as it came, then the end.
    cli = [line.split("] ", 1)[1] for line in printed.splitlines() if line.startswith("[") and "] " in line]
    assert in_order(told, cli), (told, cli)
    assert "finished: step 12/12" in printed

    # The deferrable trigger, from the same handle.
    trigger = RTrainTrainingJobTrigger.for_job(cfg, handle, poll_interval=0.1, start_timeout_s=60, progress_every_s=0)
    assert trigger.stale_after_s == stale_after_s(cfg.elastic.hang_timeout_s)

    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    with structlog.testing.capture_logs() as logs:
        payload = asyncio.run(asyncio.wait_for(first(), 60))
    assert (payload["status"], payload["state"], payload["step"]) == ("success", "finished", 12)
    assert payload["events_after"] == final.cursor
    assert in_order(told, rtrain_lines(logs)), (told, rtrain_lines(logs))

    # The sensor, polling in a worker slot (no trigger): the same events, the same end.
    spec = {"config": cfg.model_dump(mode="json"), "run_uri": run_uri, "run_name": "w", "backend": "local"}
    spec |= {"dataset": {"source": "stdlib", "max_bytes": None}, "gke": {}}
    sensor = RTrainTrainingJobSensor(task_id="watch", spec=spec, handle=handle, deferrable=False, progress_every_s=0)
    with structlog.testing.capture_logs() as logs:
        poked = sensor.poke({})
    assert poked.is_done and poked.xcom_value["state"] == "finished" and poked.xcom_value["step"] == 12
    assert in_order(told, rtrain_lines(logs)), (told, rtrain_lines(logs))


def test_a_watch_of_a_job_never_started_fails_it_after_the_start_timeout(tmp_path: Path) -> None:
    """The one watch decides for every adapter: a launched job that never writes its status is failed."""
    from training.events import write_status
    from training.storage import open_store

    cfg = api.load_config("tiny", None, {"root": str(tmp_path), "run_name": "never"})
    write_status(open_store(cfg.run_uri), state="pending", job="an-earlier-job")
    handle = {"backend": "local", "run_uri": cfg.run_uri, "job": "j1", "attached": False}
    handle |= {"launched_at": time.time() - 120, "events_after": None}
    looks = list(watch(LocalSliceBackend(), handle, timeouts(cfg.elastic, start_timeout_s=60), poll_s=0.01))  # type: ignore[arg-type]
    assert [(look.state, look.outcome) for look in looks if isinstance(look, Look)] == [("failed", "failed")]
    assert "did not start" in looks[-1].reason  # type: ignore[union-attr]
    assert JobSpec.local(cfg).placement.kind == "local"
