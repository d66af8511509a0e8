"""Training as a service: runs share a pool, priorities move hosts by notice, an ETA that knows about resizes.

Fast tests check the policy, the forecast and the verbs' refusals; the slow one
runs three real jobs on a pool of 4 local hosts, kills the scheduler in the
middle and checks that hosts moved with no step lost and nothing ran twice.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from jobs import assert_exact_data, job_config, wait_for

from training import api
from training.service import commands, scheduler
from training.service.eta import (
    JobStart,
    RunOutlook,
    forecast,
    resume_seconds,
    start_seconds,
    starting_since,
    step_seconds_by_hosts,
)
from training.service.policy import Demand, PriorityError, allocate
from training.service.queue import Placement, Queue, QueueError, Submission

REPO = Path(__file__).resolve().parents[2]


def _d(run: str, prio: str, lo: int, hi: int, at: float, step: int = 1) -> Demand:
    return Demand(run=run, priority=prio, min_hosts=lo, max_hosts=hi, submitted_at=at, step=step)


def test_a_higher_priority_takes_hosts_down_to_the_minimum_then_queues_the_lowest():
    low, high = _d("low", "low", 2, 4, 0), _d("high", "high", 2, 2, 1)
    assert allocate(4, [low]) == {"low": 4}
    assert allocate(4, [low, high]) == {"low": 2, "high": 2}
    big = _d("big", "urgent", 3, 3, 2)
    assert allocate(4, [low, high, big]) == {"low": 0, "high": 0, "big": 3}, "below their minimum: queued"
    # Backfill: a lower run whose minimum fits what is left runs; hosts grow whole slices at a time.
    small = _d("small", "low", 1, 1, 3)
    assert allocate(4, [low, high, big, small]) == {"low": 0, "high": 0, "big": 3, "small": 1}
    assert allocate(7, [_d("sl", "normal", 2, 6, 0, step=2)]) == {"sl": 6}
    # Equal priority: first come, first served.
    assert allocate(4, [_d("b", "low", 4, 4, 5), _d("a", "low", 4, 4, 4)]) == {"a": 4, "b": 0}
    with pytest.raises(PriorityError, match="unknown priority 'top'"):
        allocate(4, [_d("x", "top", 1, 1, 0)])


def test_the_forecast_replays_the_policy_with_measured_paces_and_resize_costs():
    low, high = _d("low", "low", 1, 4, 0.0), _d("high", "high", 2, 2, 1.0)
    etas = forecast(4, [RunOutlook(low, 100, 2, {4: 1.0}), RunOutlook(high, 50, 2, {2: 1.0}, [5.0])])
    # high: 50 steps at 1 s. low: 2 hosts meanwhile (2 s a step, predicted from 4 measured): 25 steps;
    # then back on 4 hosts after a resize that costs the pool's median (5 s): 75 steps at 1 s.
    assert etas["high"].seconds == pytest.approx(50.0)
    assert etas["low"].seconds == pytest.approx(130.0)
    assert any("predicted from 4 measured" in n for n in etas["low"].assumptions)
    lone = forecast(2, [RunOutlook(_d("big", "low", 4, 4, 0.0), 10, 0, {4: 1.0})])
    assert lone["big"].seconds is None and "never fits" in lone["big"].assumptions[-1]


def test_a_run_given_hosts_again_costs_what_its_job_starts_or_its_returns_of_capacity_cost_not_its_resizes():
    evs = [
        {"type": "config", "time": 98.0},  # a job launched: its processes start and take the run
        {"type": "launch", "reason": "start", "round": 1, "time": 100.0},  # its first round
        {"type": "resumed", "attempt": 1, "time": 103.0},
        {"type": "resumed", "attempt": 1, "time": 103.1},  # every process says so: the first counts
        {"type": "launch", "reason": "recovery", "round": 2, "time": 110.0},
        {"type": "resumed", "attempt": 2, "time": 111.0},
        {"type": "config", "time": 119.0},  # a new job of the run
        {"type": "launch", "reason": "start", "round": 1, "time": 120.0},
        {"type": "resumed", "attempt": 1, "time": 126.0},
    ]
    assert start_seconds(evs) == [JobStart(2.0, 3.0), JobStart(1.0, 6.0)]
    assert resume_seconds(evs) == []
    queued = RunOutlook(_d("low", "low", 4, 4, 0.0), 10, 0, {4: 1.0}, [1.0], start_seconds(evs))
    eta = forecast(4, [queued])["low"]
    # Queued in its job, no return measured yet: its agents come back into the launched job, whose round
    # starts as its starts' rounds did (median 4.5 s); then 10 steps at 1 s.
    assert eta.seconds == pytest.approx(4.5 + 10.0)
    assert "resumes on 4 host(s) at +0s, costing 4.5s" in eta.assumptions
    # A run that never started starts a job: the pool's starts, launch to first step (median 6 s).
    new = RunOutlook(_d("new", "low", 4, 4, 1.0), 10, 0, {}, [], [])
    assert forecast(8, [queued, new])["new"].seconds == pytest.approx(6.0 + 10.0)

    # Queued in its job (its hosts went to another run), then given hosts again: the job's agents come back.
    evs += [
        {"type": "capacity", "time": 130.0, "reason": "queued: a run of higher priority needs the hosts"},
        {"type": "waiting_for_capacity", "time": 131.0},
        {"type": "capacity", "time": 150.0, "reason": "the scheduler assigns 4 host(s)"},
        {"type": "capacity", "time": 150.2, "reason": "capacity returned"},
        {"type": "launch", "reason": "capacity returned", "round": 2, "time": 150.5},
        {"type": "resumed", "attempt": 2, "time": 152.0},
    ]
    assert resume_seconds(evs) == [2.0]
    queued.resume_s = resume_seconds(evs)
    assert forecast(4, [queued])["low"].seconds == pytest.approx(2.0 + 10.0)


def test_a_run_launched_that_has_not_stepped_yet_owes_the_rest_of_its_start():
    evs = [{"type": "config", "time": 10.0}, {"type": "launch", "reason": "start", "round": 1, "time": 12.0}]
    assert starting_since(evs) == 10.0
    assert starting_since([*evs, {"type": "resumed", "attempt": 1, "time": 14.0}]) is None
    starts = [JobStart(2.0, 3.0)]
    starting = RunOutlook(_d("big", "urgent", 4, 4, 0.0), 10, 4, {}, [], starts, starting_for=2.0)
    other = RunOutlook(_d("low", "low", 4, 4, 0.0), 10, 0, {4: 1.0}, [], starts)
    etas = forecast(4, [starting, other])
    assert etas["big"].seconds == pytest.approx(3.0 + 10.0)  # 3 s of its 5 s start left, then 10 steps at 1 s
    assert "starting: its first step in 3.0s" in etas["big"].assumptions
    assert etas["low"].seconds == pytest.approx(13.0 + 3.0 + 10.0)  # its agents back: a start's round, 3 s


def test_paces_are_wall_seconds_per_step_past_each_round_s_warm_up():
    evs = [
        {"type": "launch", "round": 1, "workers": 4, "time": 0.0},
        {"type": "progress", "attempt": 1, "step": 1, "time": 9.0},  # compile and restore: only starts the count
        {"type": "progress", "attempt": 1, "step": 5, "time": 15.0},  # warming up: 1.5 s a step
        {"type": "progress", "attempt": 1, "step": 11, "time": 21.0},
        {"type": "progress", "attempt": 1, "step": 16, "time": 26.0},  # steady: 1 s a step
        {"type": "progress", "attempt": 1, "step": 21, "time": 32.0},  # a save in these 5 steps: it counts
        {"type": "launch", "round": 2, "workers": 2, "time": 40.0},  # a round too short to leave its warm-up
        {"type": "progress", "attempt": 2, "step": 22, "time": 47.0},
        {"type": "progress", "attempt": 2, "step": 24, "time": 51.0},
        {"type": "config", "time": 60.0},  # a new job: its round 1 is not the old one's
        {"type": "launch", "round": 1, "workers": 4, "time": 61.0},
        {"type": "progress", "attempt": 1, "step": 25, "time": 70.0},
        {"type": "progress", "attempt": 1, "step": 36, "time": 81.0},
        {"type": "progress", "attempt": 1, "step": 37, "time": 82.2},
    ]
    # 4 hosts: steps 11 to 21 of the first job and 36 to 37 of the second (11 steps, 12.2 s); 2 hosts: all it has.
    assert step_seconds_by_hosts(evs) == {4: pytest.approx(12.2 / 11), 2: pytest.approx(2.0)}


def test_an_event_reader_kept_across_looks_reads_each_event_once(tmp_path):
    from training.events import EventLog, EventReader
    from training.storage import open_store

    uri = str(tmp_path / "r")
    store = open_store(uri)
    store.put("config.json", b"{}")
    log = EventLog(store, source="test")
    log.emit("launch", round=0, attempt=0, workers=2, mesh={"data": 2})
    first = log.emit("progress", step=1, attempt=0, step_time=0.5, loss=2.0)
    log.emit("checkpoint", step=1, committed=True)
    reader = EventReader()
    assert [e["type"] for e in reader.read(uri)] == ["launch", "progress", "checkpoint"]
    store.put(log.keys()[1], json.dumps({**first, "step": 99}).encode())  # the progress event, rewritten
    log.emit("progress", step=2, attempt=0, step_time=0.5, loss=1.9)
    steps = [e.get("step") for e in reader.read(uri) if e["type"] == "progress"]
    assert steps == [1, 2], "the first event was not read again (its rewrite is not seen), the new one was"
    assert [e.get("step") for e in EventReader().read(uri) if e["type"] == "progress"] == [99, 2]
    assert EventReader().read(str(tmp_path / "nothing")) == []


def test_an_event_reader_finds_an_event_that_landed_after_a_later_stamped_one(tmp_path):
    """An event is named by its stamp before it is stored: a slow upload or a host's clock behind lands it late."""
    from training.events import EventLog, EventReader
    from training.layout import EVENTS
    from training.storage import open_store

    uri = str(tmp_path / "r")
    store = open_store(uri)
    log = EventLog(store, source="test")
    log.emit("launch", round=0, attempt=0, workers=2, mesh={"data": 2})
    newest = log.emit("progress", step=1, attempt=0, step_time=0.5, loss=2.0)
    reader = EventReader()
    assert [e["type"] for e in reader.read(uri)] == ["launch", "progress"]
    # Stamped 30 s before the newest event seen, stored only now: it sorts before it.
    ns = int((newest["time"] - 30) * 1e9)
    late = {"type": "failure", "time": ns / 1e9, "source": "slow-host", "attempt": 0, "reason": "a late one"}
    store.create(f"{EVENTS}{ns:020d}-slow-host-x.json", json.dumps(late).encode())
    assert [e["type"] for e in reader.read(uri)] == ["failure", "launch", "progress"]  # in stamp order
    assert [e["type"] for e in reader.read(uri)] == ["failure", "launch", "progress"], "each event once"


def test_bad_requests_are_one_line_refusals_that_change_nothing(tmp_path, tiny_dataset, jax_cache):
    root = str(tmp_path / "runs")
    cfg = job_config(root, tiny_dataset, jax_cache, run_name="big", min_workers=4, max_workers=4)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def rtrain(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "training.cli", *args], capture_output=True, text=True, env=env)

    r = rtrain("submit", "--priority", "top", f"root={root}", f"data.dataset={tiny_dataset}")
    assert r.returncode == 3 and r.stderr.strip().splitlines() == [
        "rtrain: error: unknown priority 'top': one of low, normal, high, urgent"
    ], r.stderr
    with pytest.raises(QueueError, match="never fits the pool of 2 host"):
        commands.submit(cfg, "low", pool_hosts=2)
    assert Queue(root).submissions() == []
    r = rtrain("priority", "nobody", "high", "--root", root)
    assert r.returncode == 6 and "no run 'nobody' was submitted" in r.stderr, r.stderr
    r = rtrain("cancel", "nobody", "--root", root)
    assert r.returncode == 6 and "no run 'nobody' was submitted" in r.stderr, r.stderr
    q = Queue(root)
    q.set_pool(4)
    sub = Submission(
        run_name="done",
        run_uri=f"{root}/done",
        priority="low",
        min_hosts=1,
        max_hosts=1,
        hosts_per_slice=1,
        steps=1,
        config="{}",
        submitted_at=time.time(),
    )
    q.put_submission(sub)
    q.put_placement(Placement(run_name="done", job="j1", ended="finished"))
    r = rtrain("priority", "done", "high", "--root", root)
    assert r.returncode == 6 and "already ended (finished)" in r.stderr, r.stderr
    assert q.submission("done").priority == "low"


def _scheduler_pids(root: str) -> list[int]:
    import psutil

    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if scheduler.PROCESS in " ".join(p.info["cmdline"] or []) and root in " ".join(p.info["cmdline"])
    ]


def _events(run_uri: str, *types: str) -> list[api.Event]:
    return api.events(run_uri, types or None)


@pytest.mark.slow
@pytest.mark.extended
def test_priorities_move_hosts_between_running_jobs_with_no_step_lost(tmp_path, tiny_dataset, jax_cache):
    root = str(tmp_path / "runs")
    common = {"checkpoint_every": 10, "trace_data_ids": True, "log_every": 5}
    # low must outlast high plus the scheduler's restart on 2 hosts: on a quiet machine a tiny step on 2
    # hosts takes ~55 ms, high and the restart ~30 s, so 400 steps raced them (CI ended low on 2 hosts).
    low = job_config(root, tiny_dataset, jax_cache, run_name="low", steps=800, min_workers=2, max_workers=4, **common)
    high = job_config(root, tiny_dataset, jax_cache, run_name="high", steps=30, min_workers=2, max_workers=2, **common)
    last = job_config(root, tiny_dataset, jax_cache, run_name="last", steps=12, min_workers=4, max_workers=4, **common)
    seen: dict[str, list[tuple[str, int]]] = {"low": [], "high": [], "last": []}
    stop = threading.Event()

    def watch() -> None:  # what `rtrain queue` showed along the way
        while not stop.is_set():
            try:
                for r in commands.view(root).rows:
                    if not seen[r.run] or seen[r.run][-1] != (r.state, r.hosts):
                        seen[r.run].append((r.state, r.hosts))
            except Exception:  # noqa: BLE001 - a look between two writes; the next one sees them
                pass
            time.sleep(0.3)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        commands.submit(low, "low", pool_hosts=4)
        wait_for(
            lambda: (
                (api.status(low.run_uri) or {}).get("workers") == 4
                and ((api.status(low.run_uri) or {}).get("step") or 0) >= 3
            ),
            240,
            "low training on 4 hosts",
        )
        commands.submit(high, "high")
        commands.submit(last, "low")  # lowest priority, min 4: stays queued until the pool allows
        wait_for(lambda: (api.status(high.run_uri) or {}).get("state") == "running", 240, "high running")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        shown = subprocess.run(
            [sys.executable, "-m", "training.cli", "status", "low", "--root", root],
            capture_output=True,
            text=True,
            env=env,
        ).stdout
        assert re.search(r"^queue\s+priority low, \w+, \d host\(s\) assigned$", shown, re.M), shown
        # Any duration the CLI writes (12.3s, 3m12s, 1h05m): how long is left depends on the machine's speed.
        assert re.search(r"^eta\s+(\d+\.\d+s|\d+m\d\ds|\d+h\d\dm) \(.*host", shown, re.M), shown
        # The scheduler dies mid-scenario; a new one takes over from what the root says.
        for pid in _scheduler_pids(root):
            os.kill(pid, signal.SIGKILL)
        # A dead scheduler's lease shows no refresh within half a lease: a new one is started then.
        wait_for(lambda: scheduler.ensure_running(root), 3 * scheduler.LEASE_S, "a new scheduler")
        wait_for(lambda: (api.status(low.run_uri) or {}).get("state") == "finished", 420, "low to finish")
        wait_for(lambda: (api.status(last.run_uri) or {}).get("state") == "finished", 300, "last to finish")
        wait_for(lambda: not _scheduler_pids(root), 30, "the scheduler to go with nothing left")
    finally:
        stop.set()
        watcher.join(timeout=5)
        for pid in _scheduler_pids(root):
            os.kill(pid, signal.SIGKILL)
    view = {r.run: r for r in commands.view(root).rows}
    assert {r: v.state for r, v in view.items()} == {"low": "finished", "high": "finished", "last": "finished"}
    q = Queue(root)
    for run in ("low", "high", "last"):
        assert q.placement(run).launches == 1, f"{run} launched once across the scheduler's restart"
        jobs = {e.get("job") for e in _events(f"{root}/{run}", "config")}
        assert len(jobs) == 1, f"{run}: one job ({jobs})"
    # low: shrunk to 2 by notice (its step committed, nothing replayed), grew back to 4 after high ended.
    notices = _events(low.run_uri, "preemption_notice")
    assert len(notices) == 2 and all(n["committed"] for n in notices), notices
    assert not _events(low.run_uri, "failure"), "a scheduler's move is not a failure"
    resizes = [(e["old_workers"], e["new_workers"]) for e in _events(low.run_uri, "resize")]
    assert resizes == [(4, 2), (2, 4)], resizes
    recovered = _events(low.run_uri, "recovered")
    assert recovered and all(e["steps_lost"] == 0 for e in recovered), recovered
    high_end = max(e["time"] for e in _events(high.run_uri, "finished"))
    grow = [e for e in _events(low.run_uri, "capacity") if e.get("assigned") and e["available"] == 4]
    assert grow and grow[-1]["time"] >= high_end - 1.0, "low grew back only once high was done"
    assert_exact_data(low.run_uri, tiny_dataset, low)
    assert_exact_data(high.run_uri, tiny_dataset, high)
    # last waited in the queue while low and high held the pool, then ran on all 4 hosts.
    first_start = min(e["time"] for e in _events(last.run_uri, "launch"))
    low_end = max(e["time"] for e in _events(low.run_uri, "finished"))
    assert first_start >= low_end - 1.0, "last started only when the pool allowed its minimum"
    assert ("queued", 0) in seen["last"] and ("running", 4) in seen["last"], seen["last"]
    assert ("running", 4) in seen["low"] and ("running", 2) in seen["low"], seen["low"]
    assert any(s == "queued" for s, _ in seen["high"]) or seen["high"][0][0] in ("pending", "starting", "running"), seen
    print(json.dumps(seen))
