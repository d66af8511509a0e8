"""The watching trigger: exact serialization, and its verdicts on real run roots (status.json + events)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk._shared.module_loading import import_string
from airflow.sdk.serde import deserialize, serialize
from rtrain_airflow.triggers.training import CLASSPATH, PROGRESS_EVERY_S, RTrainTrainingJobTrigger

from training.event_text import describe
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
        progress_every_s=30,
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
        "progress_every_s": 30.0,
    }
    # Through Airflow's own encoding of trigger kwargs (what the triggerer stores), and back.
    again = import_string(classpath)(**deserialize(serialize(kwargs)))
    assert again.serialize() == (classpath, kwargs)
    # A trigger stored before progress_every_s existed comes back with the default cadence.
    older = {k: v for k, v in kwargs.items() if k != "progress_every_s"}
    assert import_string(classpath)(**older).serialize()[1] == {**older, "progress_every_s": PROGRESS_EVERY_S}


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


def test_a_failure_that_landed_after_a_later_stamped_event_is_still_counted(run: tuple[str, Any, EventLog]) -> None:
    """An event is named by its stamp before it is stored: one stored late sorts before events already read."""
    import json

    uri, store, log = run
    log.emit("launch", attempt=0, workers=2, mesh={"data": 2})
    write_status(store, state="running", step=3, job="j1")
    t_fault = time.time()
    late_key = f"events/{int(t_fault * 1e9):020d}-slow-host-x.json"
    log.emit("progress", step=3, attempt=0, step_time=0.1, loss=2.0)  # stamped after the failure, stored first

    def later() -> None:
        time.sleep(0.5)  # the trigger has read the progress event by now
        failure = {"type": "failure", "time": t_fault, "source": "slow-host", "attempt": 0, "reason": "host h1 lost"}
        store.create(late_key, json.dumps(failure).encode())
        time.sleep(0.5)
        log.emit("launch", attempt=1, workers=1, mesh={"data": 1})
        log.emit("resumed", step=3)
        write_status(store, state="finished", step=10, latest_committed=10, failures=1, job="j1")

    t = threading.Thread(target=later)
    t.start()
    event = run_trigger(RTrainTrainingJobTrigger(uri, handle(uri), poll_interval=0.1))
    t.join()
    [rec] = event["recoveries"]
    assert rec["cause"] == "host h1 lost" and rec["resumed_step"] == 3


def test_a_new_job_s_watch_never_reads_the_events_of_the_job_before_it(run: tuple[str, Any, EventLog]) -> None:
    from training.api import newest_event_key

    uri, store, log = run
    log.emit("launch", attempt=0, workers=2, mesh={"data": 2})
    log.emit("failure", attempt=0, reason="the old job's failure")
    log.emit("failed", reason="the old job ended")
    after = newest_event_key(uri)
    write_status(store, state="running", step=3, job="j2")

    def later() -> None:
        time.sleep(0.5)  # a few looks find nothing new
        log.emit("launch", attempt=1, workers=2, mesh={"data": 2})
        log.emit("resumed", step=3)
        time.sleep(0.5)
        write_status(store, state="finished", step=10, latest_committed=10, failures=0, job="j2")

    t = threading.Thread(target=later)
    t.start()
    h = {**handle(uri, job="j2"), "events_after": after}
    event = run_trigger(RTrainTrainingJobTrigger(uri, h, poll_interval=0.1, events_after=after))
    t.join()
    assert event["status"] == "success" and event["recoveries"] == []


def test_failed_job_fails_with_the_agents_reason(run: tuple[str, Any, EventLog]) -> None:
    uri, store, _ = run
    write_status(store, state="failed", reason="failure budget spent: 4 failures > max_failures=3", step=17, job="j1")
    event = run_trigger(RTrainTrainingJobTrigger(uri, handle(uri), poll_interval=0.05))
    assert event["status"] == "failed" and "failure budget spent" in event["message"]


@pytest.mark.parametrize("state", ["stopped", "cancelled"])
def test_a_job_a_person_stopped_ends_the_wait_stopped_not_failed(run: tuple[str, Any, EventLog], state: str) -> None:
    uri, store, events = run
    write_status(store, state=state, reason="stopped with rtrain stop", step=12, latest_committed=10, job="j1")
    events.emit(state, reason="stopped with rtrain stop", step=12)
    trigger = RTrainTrainingJobTrigger(uri, handle(uri), poll_interval=0.05)
    event, lines = watch(trigger)
    assert (event["status"], event["state"], event["message"]) == ("stopped", state, "stopped with rtrain stop")
    assert (event["step"], event["latest_committed"]) == (12, 10)
    told = "the job was stopped" if state == "stopped" else "the run was cancelled before it started"
    assert any(line.startswith(f"[rtrain] {told}: stopped with rtrain stop") for _, line in lines), lines


def test_a_job_whose_hosts_are_all_gone_fails_the_wait_and_its_status_says_so(run: tuple[str, Any, EventLog]) -> None:
    from training import api

    uri, store, _ = run
    # Its last status says running, but no agent holds the run's lease any more (every host was killed).
    old_status(store, 60, state="running", step=12, job="j1")
    written = store.get("status.json")
    assert api.status(uri)["state"] == "running" and store.get("status.json") == written  # a read writes nothing
    assert not api.events(uri, ("failed",))
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


# --- what the task log says: one sentence per event, and a progress line at a fixed cadence ----------------

PROGRESS_LINE = re.compile(
    r"^\[rtrain\] step (?P<step>\d+)/(?P<total>\d+) \((?P<pct>\d+)%\), loss \d+\.\d{4}, (?P<tps>\d+) tok/s"
    r"(?:, ETA (?P<eta>(?:\d+h)?(?:\d+m)?[\d.]+s|\d+h\d\dm))?, (?P<workers>\d+) workers?, mesh (?P<mesh>.+)$"
)


def eta_seconds(text: str) -> float:
    """``1m30s`` / ``12.3s`` / ``1h05m`` -> seconds."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:([\d.]+)s)?", text)
    assert m, text
    h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mi * 60 + s


def watch(trigger: RTrainTrainingJobTrigger, timeout: float = 60) -> tuple[dict[str, Any], list[tuple[float, str]]]:
    """Run the trigger to its event; (its event, the ``[rtrain]`` lines it logged with their times)."""
    import structlog

    # As Airflow's task logs do: a line that brings its own time keeps it, the others are stamped when logged.
    with structlog.testing.capture_logs(processors=[structlog.processors.MaybeTimeStamper(fmt=None)]) as logs:
        event = run_trigger(trigger, timeout)
    lines = [(_seconds(r["timestamp"]), str(r["event"])) for r in logs if str(r["event"]).startswith("[rtrain] ")]
    return event, lines


def _seconds(stamp: float | str) -> float:
    """A log line's time: a Unix time, or an ISO 8601 one."""
    if isinstance(stamp, float | int):
        return float(stamp)
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_airflow_s_task_log_keeps_the_time_a_line_brings() -> None:
    """Airflow's own processors (a task log's JSON lines) keep a line's timestamp, as the trigger's lines bring it."""
    import io
    import json

    import structlog
    from airflow.sdk.log import logging_processors
    from rtrain_airflow.triggers.training import written_at

    out = io.BytesIO()
    log = structlog.wrap_logger(structlog.BytesLogger(out), processors=list(logging_processors(json_output=True)))
    log.info("[rtrain] %s", "checkpoint 10 committed", **written_at({"type": "checkpoint", "time": 1.7e9 + 0.25}))
    log.info("[rtrain] %s", "a line of the trigger's own")
    told, own = (json.loads(line) for line in out.getvalue().splitlines())
    assert told["event"] == "[rtrain] checkpoint 10 committed"
    assert _seconds(told["timestamp"]) == pytest.approx(1.7e9 + 0.25, abs=1e-3)
    assert abs(_seconds(own["timestamp"]) - time.time()) < 60


def test_each_line_telling_an_event_carries_the_time_the_event_was_written(tmp_path: Path) -> None:
    """A look reads ten minutes of a run's events at once: each sentence is dated by its event, not by the look;
    the trigger's own lines (the progress line) by when it wrote them."""
    import fake_runs

    uri = fake_runs.write_run(tmp_path, "dated", t0=time.time() - 600)
    written: dict[str, list[float]] = {}
    for ev in EventLog(open_store(uri)).read():
        written.setdefault(describe(ev), []).append(float(ev["time"]))
    looked = time.time()
    _, lines = watch(RTrainTrainingJobTrigger(uri, handle(uri, "j2"), poll_interval=0.05))
    told = [(t, line.removeprefix("[rtrain] ")) for t, line in lines]
    dated = [(t, text) for t, text in told if text in written]
    assert len(dated) >= 10, told
    for t, text in dated:
        assert any(abs(t - w) < 1e-3 for w in written[text]), (text, t, written[text])
    assert all(t < looked - 60 for t, _ in dated), "dated by the events, ten minutes before the look"
    recovered = [t for t, text in told if text.startswith("recovered from ")]
    assert len(recovered) == 1 and recovered[0] < looked - 60, "dated by the resumed event it tells"
    progress = [t for t, text in told if text.startswith("step ")]
    assert progress and all(t >= looked for t in progress), "the trigger's own line: when it was written"


def test_a_finished_run_is_told_in_sentences_with_one_progress_line(tmp_path: Path) -> None:
    """The events of a whole run (written with the engine's own event records) in one look: every relayed event
    is a sentence, the recovery is measured, and the progress line sits where the newest step was."""
    import fake_runs

    uri = fake_runs.write_run(tmp_path, "told")
    event, lines = watch(RTrainTrainingJobTrigger(uri, handle(uri, "j2"), poll_interval=0.05))
    assert event["status"] == "success"
    text = [line.removeprefix("[rtrain] ") for _, line in lines]
    assert text[:6] == [
        "host h0 leads job j1",
        "round 0: 4 hosts, mesh data4, from the newest committed checkpoint (if any)",
        "initialised a new model on mesh data4",
        "compiled the train step in 2.00s",
        "training started: step 1 done, 0.40s into the round",
        "checkpoint 10 committed",
    ]
    assert "chaos: preempt worker 1 at step 15 (preempt:worker=1,step=15)" in text
    assert "failure: host h1 lost: no heartbeat (detected in 1.20s)" in text
    recovered = [t for t in text if t.startswith("recovered from ")]
    assert len(recovered) == 1 and re.fullmatch(
        r"recovered from host h1 lost: no heartbeat: training again at step 11, \d+\.\ds after the fault", recovered[0]
    )
    assert not any(t.startswith("training resumed: step 11") for t in text)  # the recovery line says it
    assert "training resumed: step 21 done, 0.40s into the round" in text  # job 2, no failure: a plain resume
    # One progress line (one look, a 10 s cadence), for the newest step, in the events' order.
    progress = [t for t in text if t.startswith("step ")]
    assert progress == ["step 40/40 (100%), loss 2.3306, 16384 tok/s, 4 workers, mesh data4"]
    assert text[-4:] == [
        progress[0],
        "checkpoint 30 committed",
        "checkpoint 40 committed",
        "finished at step 40 (0 failures absorbed, 12.0s in all)",
    ]
    for t in text:  # sentences, not Python reprs
        assert not re.search(r"[{}\[\]]|None|'\w+':", t), t

    _, quiet = watch(RTrainTrainingJobTrigger(uri, handle(uri, "j2"), poll_interval=0.05, progress_every_s=0))
    assert [t for _, t in quiet if PROGRESS_LINE.match(t)] == []
    assert len(quiet) == len(lines) - 1


def test_a_live_run_gets_a_progress_line_at_the_cadence(tmp_path: Path) -> None:
    """A job that trains while the trigger watches: events written as the engine writes them (one object per event,
    0.5 s of training per step by their own times), the status rewritten by its leader; the trigger logs a progress
    line at most every progress_every_s, each with the step, the total, the ETA at the pace of the steps, the
    workers and the mesh of the round."""
    import fake_runs

    uri = str(tmp_path / "live")
    store = open_store(uri)
    writer = fake_runs._Writer(uri, time.time() - 3600)
    mesh = {"data": 4, "fsdp": 2, "tensor": 1}
    writer.emit("launch", attempt=0, round=0, workers=4, mesh=mesh, members=["h0", "h1", "h2", "h3"], resume="latest")
    writer.emit("init", step=0, mesh=mesh, seconds=0.5)
    write_status(store, state="starting", steps_total=300, job="j1", workers=4, mesh=mesh)
    cadence, last = 0.4, 80

    def train() -> None:
        writer.steps(1, 1, 4)  # step 1 and the round's "resumed" event
        for step in range(1, last + 1):
            if step > 1:
                writer.emit(
                    "progress",
                    dt=0.5,
                    step=step,
                    loss=fake_runs._loss(step),
                    step_time=0.5,
                    tokens_per_s=16384.0,
                    grad_norm=1.0,
                    accuracy=0.3,
                )
            write_status(store, state="running", step=step, steps_total=300, job="j1", workers=4, mesh=mesh)
            time.sleep(0.025)
        writer.emit("finished", step=last, failures=0, seconds=40.0)
        write_status(store, state="finished", step=last, steps_total=300, job="j1", workers=4, mesh=mesh)

    trainer = threading.Thread(target=train)
    started = time.monotonic()
    trainer.start()
    try:
        trigger = RTrainTrainingJobTrigger(uri, handle(uri), poll_interval=0.05, progress_every_s=cadence)
        event, lines = watch(trigger)
    finally:
        trainer.join()
    took = time.monotonic() - started
    assert event["status"] == "success" and event["step"] == last
    progress = [(t, PROGRESS_LINE.match(line)) for t, line in lines if line.startswith("[rtrain] step ")]
    assert all(m is not None for _, m in progress), [line for _, line in lines]
    assert 2 <= len(progress) <= took / cadence + 2, (took, [line for _, line in lines])
    steps = [int(m["step"]) for _, m in progress if m]
    assert steps == sorted(set(steps)) and steps[-1] <= last
    for (t0, _), (t1, _) in zip(progress, progress[1:], strict=False):
        assert t1 - t0 >= cadence - 0.05, (t0, t1)  # never more often than the cadence
    for _, m in progress:
        assert m is not None
        step = int(m["step"])
        assert m["total"] == "300" and int(m["pct"]) == int(100 * step / 300 + 0.5)
        assert m["workers"] == "4" and m["mesh"] == "data4 x fsdp2" and m["tps"] == "16384"
        # 0.5 s a step by the events' own clock (plus the 0.01 s of step 1's "resumed"), 300 - step steps to go.
        expected = (300 - step) * 0.5
        assert m["eta"] is not None and abs(eta_seconds(m["eta"]) - expected) <= 0.03 * expected + 1, m.group(0)
    text = [line for _, line in lines]
    assert "[rtrain] training started: step 1 done, 0.40s into the round" in text  # a first launch starts
    assert not any("training resumed" in line or "again" in line for line in text)
    assert text[-1] == "[rtrain] finished at step 80 (0 failures absorbed, 40.0s in all)"


def test_progress_every_s_is_checked_and_passed_on(tmp_path: Path) -> None:
    from airflow.sdk import DAG
    from rtrain_airflow.sensors.training import RTrainTrainingJobSensor

    with DAG("t", schedule=None):
        with pytest.raises(ValueError, match="progress_every_s"):
            RTrainTrainingJobSensor(task_id="w", spec_from="resolve_config", handle="{{ x }}", progress_every_s=-1)
        with pytest.raises(ValueError, match="give spec"):
            RTrainTrainingJobSensor(task_id="w2", handle="{{ x }}")
        sensor = RTrainTrainingJobSensor(task_id="w3", spec_from="resolve_config", handle="{{ x }}")
    assert sensor.progress_every_s == PROGRESS_EVERY_S == 10.0


def test_a_queued_run_of_the_shared_pool_is_alive_says_why_and_ends_with_its_placement(tmp_path: Path) -> None:
    """A run submitted to the pool that holds no host: the wait goes on (not "did not start"), the log says
    why it waits; once the scheduler records the run's end, the wait ends with it."""
    import fake_runs

    from training.checkpoint.lock import RunLock
    from training.service import scheduler
    from training.service.queue import Placement, Queue

    root = str(tmp_path / "runs")
    fake_runs.write_submission(root, "waits", "low")
    q = Queue(root)
    q.put_placement(Placement(run_name="waits", reason="queued: a run of higher priority than low needs the hosts"))
    lease = RunLock(q.store, owner="a scheduler of this test", lease_s=scheduler.LEASE_S)
    lease.acquire()  # a live scheduler: none is started for the run
    h: dict[str, Any] = {"backend": "local", "run_uri": f"{root}/waits", "root": root, "run_name": "waits"}
    h |= {"priority": "low"}
    h |= {"job": "", "attached": False, "launched_at": time.time() - 3600, "events_after": None}

    def end_later() -> None:
        time.sleep(1.5)
        q.put_placement(Placement(run_name="waits", job="j9", ended="cancelled", reason="not needed"))

    ender = threading.Thread(target=end_later)
    ender.start()
    try:
        event, lines = watch(
            RTrainTrainingJobTrigger(f"{root}/waits", h, poll_interval=0.1, start_timeout_s=1, progress_every_s=0.3)
        )
    finally:
        ender.join()
        lease.release()
    assert (event["status"], event["state"], event["message"]) == ("stopped", "cancelled", "not needed"), event
    queued = [line for _, line in lines if line.startswith("[rtrain] queued at priority low")]
    assert queued, lines
    assert "(queued: a run of higher priority than low needs the hosts): needs 2..4 host(s), step 0/100" in queued[0]
    assert not scheduler.log_path(root).exists(), "no scheduler was started while one held the lease"
