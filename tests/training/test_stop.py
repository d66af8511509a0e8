"""A person's stop is a final state of its own: ``stopped`` (the job had started) or ``cancelled`` (it never ran).

Fast tests pin the states, the records and the queue's settling; the slow one starts a real job on the
local slice, stops it with ``rtrain stop``, reads ``stopped`` everywhere, and resumes it with ``rtrain train``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import job_config, start_job, wait_finished, wait_for

from training import api
from training.backends import SharedPoolBackend
from training.backends.pool_scheduler import launch
from training.checkpoint.lifecycle import format_report
from training.cli import Exit, main
from training.elastic.codes import AgentExit
from training.elastic.host.jobstatus import JobStatus, Phase, inherited_phase, run_state
from training.elastic.rendezvous import ResumeFrom, Round
from training.event_text import describe
from training.events import (
    ALIVE_STATES,
    FINAL_STATES,
    EventError,
    EventLog,
    RunState,
    make_event,
    write_status,
)
from training.layout import CONTROL, STOP
from training.service import commands
from training.service.queue import Placement, Queue, Submission
from training.service.scheduler import Scheduler
from training.storage import open_store

REPO = Path(__file__).resolve().parents[2]


def test_stopped_and_cancelled_are_final_states_a_person_caused() -> None:
    assert {"stopped", "cancelled"} <= FINAL_STATES and not {"stopped", "cancelled"} & ALIVE_STATES
    assert [s.value for s in RunState if s.by_request] == ["stopped", "cancelled"]
    assert not RunState.FAILED.by_request and not RunState.FINISHED.by_request
    with pytest.raises(EventError, match="lacks \\['reason'\\]"):
        make_event("stopped", "test", 0.0)
    ev = make_event("stopped", "test", 0.0, reason="stopped with rtrain stop", step=12)
    assert describe(ev) == (
        "the job was stopped: stopped with rtrain stop (at step 12); resumable from the newest committed checkpoint"
    )
    assert describe(make_event("cancelled", "s", 0.0, reason="cancelled: not today")) == (
        "the run was cancelled before it started: cancelled: not today"
    )


def test_every_agent_of_a_stopped_job_exits_stopped_and_a_new_leader_keeps_the_end(tmp_path: Path) -> None:
    assert AgentExit.of_final("stopped") == AgentExit.STOPPED == 7
    assert AgentExit.of_final("finished") == AgentExit.FINISHED
    assert AgentExit.of_final("failed") == AgentExit.FAILED
    stop = Round(
        round=4, job="j1", gen=1, leader="h0", action="stop", final="stopped", reason="stopped with rtrain stop"
    )
    assert inherited_phase(stop, None, 0.0)[0] == Phase.DONE
    from training.cadence import cadence

    status = JobStatus(
        open_store(str(tmp_path / "r")),
        cadence(2, False, 1.0, 10.0),
        stop,
        run_uri=str(tmp_path / "r"),
        job="j1",
        leader="h1",
        steps=10,
    )
    assert status.ending == (RunState.STOPPED, "stopped with rtrain stop")
    assert run_state(Phase.DONE, status.ending, True, stop) == RunState.STOPPED


def test_a_stop_of_the_job_outlives_the_leader_s_own_requests_to_its_workers(tmp_path: Path) -> None:
    """A person's stop stays until the job reads it, whatever the leader asks of its workers meanwhile: a round's
    opening drops a request of the rounds before (stop at a checkpoint), and the leader's ask to grow at the next
    checkpoint, written just after a person's stop (a cancel as hosts came back), could write over it while they
    shared one object: the job trained on, and its launcher killed it at the stop's deadline, recorded failed."""
    from training.checkpoint.ledger import Ledger
    from training.elastic.host.rounds import Carried, LeaderRecords, RoundWriter
    from training.elastic.rendezvous import Rendezvous
    from training.elastic.status import stop_asked

    cfg = api.load_config("tiny", None, {"root": str(tmp_path), "run_name": "r", "min_workers": 1})
    store = open_store(cfg.run_uri)
    events = EventLog(store, source="test")
    rec = LeaderRecords(
        cfg=cfg,
        store=store,
        rdv=Rendezvous(store),
        ledger=Ledger(store),
        events=events,
        job="j1",
        host="h0",
        emit=lambda type_, **f: None,
        fence=lambda: None,
    )
    writer = RoundWriter(rec, gen=lambda: 1, faults=lambda: [], prev=None)
    store.put(CONTROL, json.dumps({"action": "stop_at_checkpoint", "round": 1}).encode())
    rnd, _ = writer.open(None, ["h0"], "127.0.0.1:1", "start", ResumeFrom(), Carried(0, 0))
    assert not store.exists(CONTROL), "a request of the round before is forgotten"
    api.stop_job(cfg.run_uri, "stopped with rtrain stop")
    store.put(CONTROL, json.dumps({"action": "stop_at_checkpoint", "round": 1}).encode())  # as RoundWatch grows
    writer.open(rnd, ["h0"], "127.0.0.1:1", "recover", ResumeFrom(), Carried(0, 0))
    assert json.loads(store.get(STOP)) == {"action": "stop_job", "reason": "stopped with rtrain stop"}
    assert stop_asked(store) == "stopped with rtrain stop" and not store.exists(CONTROL)


def _queued(root: Path, run: str, **placement: object) -> tuple[Queue, str]:
    q = Queue(str(root))
    q.pool_or_create(2)
    uri = str(root / run)
    sub = Submission(
        run_name=run,
        run_uri=uri,
        priority="normal",
        min_hosts=1,
        max_hosts=2,
        hosts_per_slice=1,
        steps=10,
        config="{}",
        submitted_at=time.time(),
        cancelled="cancelled with rtrain cancel",
    )
    q.put_submission(sub)
    q.put_placement(Placement(run_name=run, **placement))  # type: ignore[arg-type]
    return q, uri


def _tick(root: Path) -> None:
    s = Scheduler(str(root), launch)
    s.acquire()
    try:
        s.tick()
    finally:
        s.release()


def test_a_run_cancelled_before_it_ran_ends_cancelled_in_the_queue_its_status_and_its_events(tmp_path: Path) -> None:
    q, uri = _queued(tmp_path, "never")
    _tick(tmp_path)
    assert q.placement("never").ended == "cancelled"
    st = api.status(uri) or {}
    assert (st.get("state"), st.get("reason")) == ("cancelled", "cancelled with rtrain cancel")
    assert [e["reason"] for e in api.events(uri, ("cancelled",))] == ["cancelled with rtrain cancel"]
    assert commands.look(str(tmp_path), "never").state == "cancelled"
    look = SharedPoolBackend(priority="normal").poll({"root": str(tmp_path), "run_name": "never", "run_uri": uri}, {})
    assert (look["state"], look["reason"]) == ("cancelled", "cancelled with rtrain cancel")
    out = subprocess.run(
        [sys.executable, "-m", "training.cli", "status", "never", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert re.search(r"^state\s+cancelled: cancelled with rtrain cancel$", out.stdout, re.M), out


def test_a_cancelled_run_whose_job_ran_ends_stopped_not_failed(tmp_path: Path) -> None:
    q, uri = _queued(tmp_path, "ran", job="j1", hosts=2, reason="stopping: cancelled with rtrain cancel")
    write_status(
        open_store(uri),
        state="stopped",
        job="j1",
        run_uri=uri,
        step=6,
        reason="cancelled: cancelled with rtrain cancel",
    )
    _tick(tmp_path)
    p = q.placement("ran")
    assert (p.ended, p.hosts) == ("stopped", 0)
    row = commands.look(str(tmp_path), "ran")
    assert (row.state, row.step) == ("stopped", 6)
    look = SharedPoolBackend(priority="normal").poll({"root": str(tmp_path), "run_name": "ran", "run_uri": uri}, {})
    assert look["state"] == "stopped" and "cancelled with rtrain cancel" in look["reason"]


def test_the_report_lists_each_stop() -> None:
    report = {
        "run": "r",
        "state": "stopped",
        "steps": 6,
        "steps_total": 10,
        "final_loss": 2.0,
        "launches": [],
        "failures": 0,
        "recoveries": [],
        "resizes": [],
        "validations": [],
        "rollbacks": [],
        "stops": [{"kind": "stopped", "step": 6, "reason": "stopped with rtrain stop"}],
        "checkpoints_kept": [5],
        "checkpoints_pruned": [],
        "resume_pointer": None,
        "saves": None,
        "wall_s": 1.0,
        "goodput": None,
        "goodput_breakdown": {},
    }
    text = format_report(report)
    assert re.search(r"^state\s+stopped\s+step 6/10", text, re.M)
    assert re.search(r"^  stopped\s+stopped with rtrain stop at step 6$", text, re.M), text


@pytest.mark.slow
def test_rtrain_stop_ends_a_running_job_stopped_and_rtrain_train_resumes_it(
    tmp_path: Path, tiny_dataset: str, jax_cache: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        f"root={tmp_path}",
        "run_name=s",
        f"dataset={tiny_dataset}",
        f"compilation_cache={jax_cache}",
        "max_workers=2",
        "checkpoint_every=5",
        "log_every=5",
    ]
    # `rtrain train` in the foreground, stopped by someone else: it says so and exits STOPPED.
    train = subprocess.Popen(
        [sys.executable, "-m", "training.cli", "train", *args, "steps=2000"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    uri = str(tmp_path / "s")
    try:
        wait_for(lambda: api.committed_steps(uri), 240, "a committed checkpoint")
        assert main(["stop", "s", "--root", str(tmp_path)]) == Exit.OK
        assert "ends `stopped`" in capsys.readouterr().out
        out, err = train.communicate(timeout=120)
    finally:
        if train.poll() is None:
            train.kill()
    assert train.returncode == Exit.STOPPED, (out[-2000:], err[-2000:])
    assert "rtrain: the job was stopped: stopped with rtrain stop" in err
    st = api.repair_status(uri) or {}
    assert (st.get("state"), st.get("reason")) == ("stopped", "stopped with rtrain stop")
    [stopped] = api.events(uri, ("stopped",))
    assert not api.events(uri, ("failed",)), "a stop is not a failure"
    assert main(["status", "s", "--root", str(tmp_path)]) == Exit.OK
    assert re.search(r"^state\s+stopped: stopped with rtrain stop$", capsys.readouterr().out, re.M)
    assert main(["report", "s", "--root", str(tmp_path)]) == Exit.OK
    assert re.search(r"^  stopped\s+stopped with rtrain stop", capsys.readouterr().out, re.M)
    committed = max(api.committed_steps(uri))
    # Resumable: the same run trains on from its newest committed checkpoint and finishes.
    assert main(["train", *args, f"steps={committed + 5}"]) == Exit.OK
    restores = [e for e in api.events(uri, ("restore",)) if e["time"] > stopped["time"]]
    assert restores and restores[0]["step"] == committed, restores
    assert (api.status(uri) or {}).get("state") == "finished"


@pytest.mark.slow
def test_a_job_held_with_no_host_left_ends_stopped_when_asked(
    tmp_path: Path, tiny_dataset: str, jax_cache: str
) -> None:
    """No host of the job is left: the local slice holds the run; ``rtrain stop`` ends it stopped there too."""
    import glob

    cfg = job_config(
        str(tmp_path), tiny_dataset, jax_cache, run_name="held", min_workers=1, max_workers=2, steps=200,
        capacity_timeout_s=120, chaos=["capacity:to=0,step=2"], heartbeat_s=0.5, heartbeat_timeout_s=3.0,
        lease_s=1.0, join_timeout_s=10,
    )  # fmt: skip
    handle = start_job(cfg)
    uri = cfg.run_uri
    wait_for(lambda: (api.status(uri) or {}).get("state") == "waiting_for_capacity", 120, "the run held, waiting")
    assert main(["stop", "held", "--root", str(tmp_path), "--reason", "no capacity today"]) == Exit.OK
    t0 = time.monotonic()
    st = wait_finished(handle, timeout=60)
    assert time.monotonic() - t0 < 15, "not the capacity timeout: the stop"
    assert (st["state"], st["reason"]) == ("stopped", "no capacity today (while waiting for capacity)"), st
    assert [e["reason"] for e in api.events(uri, ("stopped",))] == [st["reason"]]
    stops = [json.loads(open(p).read()) for p in glob.glob(f"{uri}/rendezvous/rounds/*.json")]
    assert any(r["action"] == "stop" and r["final"] == "stopped" for r in stops), stops


@pytest.mark.slow
def test_a_stop_commits_the_step_the_job_stopped_at(tmp_path: Path, tiny_dataset: str, jax_cache: str) -> None:
    """``rtrain stop`` of a job that trains: its 2 hosts stop together at the next step and commit it, as for a
    preemption notice, though no checkpoint was due (every 1000 steps); the job ends stopped at that step (its
    status names it as the newest committed), and no preemption notice is on record."""
    cfg = job_config(
        str(tmp_path), tiny_dataset, jax_cache, run_name="at-step", min_workers=2, max_workers=2, steps=2000,
        checkpoint_every=1000, local_checkpoint_every=0,
    )  # fmt: skip
    handle = start_job(cfg)
    uri = cfg.run_uri
    wait_for(lambda: ((api.status(uri) or {}).get("step") or 0) >= 3, 240, "the job training")
    assert main(["stop", "at-step", "--root", str(tmp_path)]) == Exit.OK
    st = wait_finished(handle, timeout=120)
    assert (st["state"], st["reason"]) == ("stopped", "stopped with rtrain stop"), st
    [stopped] = api.events(uri, ("stopped",))
    step = int(stopped["step"])
    assert 3 <= step < 1000, stopped
    assert api.committed_steps(uri) == [step], "the step it stopped at is committed, and no other"
    assert st["step"] == st["latest_committed"] == step, "the status names the step the stop committed"
    assert not api.events(uri, ("preemption_notice",)), "a person's stop is not a preemption notice"
    assert not api.events(uri, ("failed",)) and not api.events(uri, ("failure",))
