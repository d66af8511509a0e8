"""Hosts whose clocks disagree: real processes with their wall clocks set off by libfaketime.

Each skewed process runs with ``LD_PRELOAD=libfaketime.so.1`` and ``FAKETIME=-Ns``:
``time.time()`` in it (and in the workers it starts) runs ``N`` seconds behind this
process's, while its monotonic clock is the machine's.  The lease, the leader's
view of its hosts and the status check must hold whatever the clocks say.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import libfaketime
import pytest
from jobs import assert_exact_data, job_config, start_agent, wait_for, worker_logs

from training import api
from training.backends import local
from training.checkpoint.lock import LockHeld, RunLock
from training.elastic.host.clocks import CLEAR_SKEW_S, MIN_BEATS, HostClocks
from training.storage import open_store


def skewed_env(seconds: float) -> dict[str, str]:
    """This process's environment, with the wall clock of a process started with it ``seconds`` off."""
    _, additions = libfaketime.get_reload_information()
    return {**os.environ, **additions, "FAKETIME": f"{seconds:+.0f}s", "PYTHONUNBUFFERED": "1"}


def test_a_faked_clock_is_off_by_what_it_is_told_and_its_monotonic_clock_is_not() -> None:
    code = "import time; print(time.time(), time.monotonic())"
    out = subprocess.run([sys.executable, "-c", code], env=skewed_env(-30), capture_output=True, text=True, check=True)
    wall, mono = map(float, out.stdout.split())
    assert abs(wall - (time.time() - 30)) < 2 and abs(mono - time.monotonic()) < 2


HOLDER = """
import sys, time
from training.checkpoint.lock import LeaseKeeper, RunLock
from training.storage import open_store
lock = RunLock(open_store(sys.argv[1]), "holder", lease_s=1.0, margin_s=0.2)
lock.acquire()
LeaseKeeper(lock).start()
print("HOLDS", flush=True)
time.sleep(3600)
"""


def test_a_taker_whose_clock_runs_ahead_takes_no_lease_that_is_renewed_and_takes_a_lapsed_one(tmp_path: Path) -> None:
    # The holder's clock runs 20 s behind this process's: by this clock, each lease it writes ran out long ago.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], env=skewed_env(-20), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "HOLDS"
        taker = RunLock(open_store(str(tmp_path)), "taker", lease_s=60, margin_s=0.2)
        _gen, rec = taker.newest()
        assert rec is not None and taker.held_by() is None  # lapsed by the writer's clock, read on this one
        with pytest.raises(LockHeld, match="holder"):
            taker.acquire()  # but this process has not watched it lapse on its own
        newer = taker.wait_lapse(rec)
        assert newer is not None and newer["owner"] == "holder" and newer["gen"] > rec["gen"]  # renewed meanwhile
        time.sleep(2.0)
        with pytest.raises(LockHeld):
            taker.acquire()  # still renewed every quarter lease
    finally:
        holder.kill()
        holder.wait()
    # The holder is gone: its last lease lapses on this clock a lease after this process first read it.
    _gen, rec = taker.newest()
    t0 = time.monotonic()
    assert rec is not None and taker.wait_lapse(rec) is None
    assert 0.5 < time.monotonic() - t0 < 3.0  # the lease (1 s) and its margin after the first read, give or take
    taken = taker.acquire()
    assert taken["action"] == "takeover" and taken["previous"]["owner"] == "holder"


def test_a_lease_that_ran_out_over_a_minute_ago_by_its_writer_s_clock_is_lapsed_for_any_reader(
    tmp_path: Path,
) -> None:
    store = open_store(str(tmp_path))
    now = time.time()

    def write(gen: int, written: float, length: float) -> dict[str, Any]:
        rec = {"gen": gen, "action": "handoff", "owner": "launcher", "job": "j", "token": "t", "pid": 1,
               "host": "h", "acquired_at": written, "time": written, "expires_at": written + length}  # fmt: skip
        store.put(f"lock/{gen:012d}.json", json.dumps(rec).encode())
        return rec

    reader = RunLock(store, "reader")
    # A 900 s handoff that ran out 30 s ago by its writer's clock: a first look waits what is left of the
    # minute a clock may be off, not the handoff's whole length again.
    rec = write(1, now - 930, 900)
    assert reader.newest()[0] == 1 and 29 < reader.lapses_in(rec) <= 30.5
    rec = write(2, now - 1000, 900)
    assert reader.newest()[0] == 2 and reader.lapses_in(rec) == 0.0
    assert reader.acquire()["action"] == "takeover"


LIVE_JOB = """
import sys, time
from training.checkpoint.lock import LeaseKeeper, RunLock
from training.events import write_status
from training.storage import open_store
store = open_store(sys.argv[1])
lock = RunLock(store, "agent h0 of job j-live", lease_s=1.0, margin_s=0.2, job="j-live")
lock.acquire()
LeaseKeeper(lock).start()
print("HOLDS", flush=True)
while True:
    write_status(store, state="running", job="j-live", run_uri=sys.argv[1], step=3)
    time.sleep(0.5)
"""


def test_a_retry_whose_clock_runs_ahead_follows_the_live_job_instead_of_taking_its_run(
    tmp_path: Path, tiny_dataset: str, jax_cache: str
) -> None:
    # An Airflow retry on a machine whose clock runs 30 s ahead of the job's hosts: the job's status and
    # lease look 30 s old there, yet the job renews its lease: the retry follows it.
    cfg = job_config(str(tmp_path), tiny_dataset, jax_cache, run_name="live")
    job = subprocess.Popen(
        [sys.executable, "-c", LIVE_JOB, cfg.run_uri], env=skewed_env(-30), stdout=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "HOLDS"
        lines: list[str] = []
        handle = local.launch(cfg, allow_attach=True, on_line=lines.append)
        assert handle["attached"] and handle["job"] == "j-live", (handle, lines)
        assert (RunLock(open_store(cfg.run_uri), "probe").newest()[1] or {}).get("job") == "j-live"
        assert job.poll() is None
    finally:
        job.kill()
        job.wait()


def test_the_leader_reads_a_skewed_host_s_beats_on_its_own_clock() -> None:
    clocks = HostClocks()
    now = 1_000_000.0
    # A host 30 s behind: each beat read between 0.05 and 0.4 s after it was written; trusted after MIN_BEATS.
    for i, delay in enumerate([0.4, 0.2, 0.05, 0.3, 0.2, 0.1, 0.4, 0.3][:MIN_BEATS]):
        assert clocks.skew("h1", 1.0) == 0.0
        clocks.observe("h1", 1.0, now + i - 30.0, now + i + delay)
    assert clocks.skew("h1", 1.0) == pytest.approx(30.05)
    assert clocks.local_time("h1", 1.0, now - 30.0 + 10) == pytest.approx(now + 10.05)
    # A new agent on that host (a new machine, maybe) starts from nothing.
    assert clocks.skew("h1", 2.0) == 0.0
    # Within the clear skew, times are taken as written (the estimate holds a read's delay too).
    for i in range(MIN_BEATS):
        clocks.observe("h2", 1.0, now + i, now + i + CLEAR_SKEW_S * 0.8)
    assert clocks.skew("h2", 1.0) == 0.0
    # A host ahead: its times are moved back.
    for i in range(MIN_BEATS):
        clocks.observe("h3", 1.0, now + i + 12.0, now + i + 0.1)
    assert clocks.local_time("h3", 1.0, now + 20.0) == pytest.approx(now + 8.1)


def _events(run_uri: str, *types: str) -> list[api.Event]:
    return api.events(run_uri, types or None)


@pytest.mark.slow
@pytest.mark.extended
def test_hosts_whose_clocks_disagree_train_as_one_job_through_a_crash(tmp_path, tiny_dataset, jax_cache) -> None:
    cfg = job_config(
        str(tmp_path / "root"),
        tiny_dataset,
        jax_cache,
        run_name="skew",
        steps=24,
        global_batch=12,
        min_workers=2,
        max_workers=3,
        checkpoint_every=4,
        chaos=["crash:worker=2,step=10"],
        trace_data_ids=True,
    )
    job = api.begin_job(cfg, on_line=lambda _line: None)
    # h1 leads; h2's clock runs 12 s ahead of h1's (past the lease), h0's 15 s behind it (past the heartbeat
    # timeout); every host's runs behind this process's, which reads the status as Airflow's sensor does.
    skews = {"h1": -20, "h0": -35, "h2": -8}
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(host: str) -> None:
        procs[host] = start_agent(cfg.run_uri, job, host, tmp_path / f"agent-{host}.log", skewed_env(skews[host]))

    lock = RunLock(open_store(cfg.run_uri), "probe")
    states: list[str] = []
    try:
        start("h1")
        wait_for(lambda: (lock.newest()[1] or {}).get("owner") == f"agent h1 of job {job}", 60, "h1 to lead")
        start("h0")
        start("h2")

        def ended() -> bool:
            st = api.repair_status(cfg.run_uri) or {}  # the check that records a gone job as failed
            states.append(str(st.get("state")))
            return all(p.poll() is not None for p in procs.values())

        wait_for(ended, 400, "the job's end", every=0.5)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
    logs = "\n".join(f"--- {h}\n{(tmp_path / f'agent-{h}.log').read_text()[-3000:]}" for h in procs)
    st = api.status(cfg.run_uri)
    assert st is not None and st["state"] == "finished" and st["step"] == 24, (st, logs, worker_logs(cfg.run_uri))
    assert "failed" not in states, "a status check took the live job for a gone one"
    # One leader the whole run: the handoff claimed by h1, no lease taken from it by a clock running ahead.
    takeovers = [(e["owner"], e.get("handoff")) for e in _events(cfg.run_uri, "lock") if e["action"] == "takeover"]
    assert takeovers == [(f"agent h1 of job {job}", True)], (takeovers, logs)
    # The crash: the round forms again on all three hosts; h0, whose beats are dated 15 s before the
    # leader's clock, showed life after the failure and was not taken for lost.
    assert [e["workers"] for e in _events(cfg.run_uri, "launch")] == [3, 3], logs
    assert not _events(cfg.run_uri, "host_lost")
    assert len(_events(cfg.run_uri, "failure")) == 1
    assert_exact_data(cfg.run_uri, tiny_dataset, cfg)
    assert "clock of host h0 runs about 1" in logs and "behind this host's" in logs
