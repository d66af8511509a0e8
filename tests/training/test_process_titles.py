"""Processes a person can tell apart: each process of a job names itself where ``ps`` looks, and the host's record
on the rendezvous (and ``rtrain status --json``) gives its worker's and its standby's pids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest
from jobs import hosts, job_config, start_job, wait_finished, wait_for, worker_logs

from training import api, cli, procctl
from training.elastic.rendezvous import HostRecord, Rendezvous
from training.events import write_status
from training.storage import open_store


def _title(pid: int) -> str:
    """What ``ps`` shows as the process's command line."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_title_shows_as_the_command_line_and_the_thread_keeps_its_name_unless_given_one() -> None:
    script = textwrap.dedent(
        """
        import sys, threading
        from pathlib import Path
        from training import procctl
        procctl.set_title(procctl.job_title("worker", "/runs/r1", "j1", "h2", "r3"))
        kept = Path("/proc/self/comm").read_text().strip()
        procctl.set_title("rtrain standby h2 /runs/r1 --job j1", name="rtrain-worker-name-too-long")
        print(kept, Path("/proc/self/comm").read_text().strip(), sep="|")
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    try:
        assert proc.stdout is not None
        kept, named = proc.stdout.readline().strip().split("|")
        assert _title(proc.pid) == "rtrain standby h2 /runs/r1 --job j1"
    finally:
        proc.communicate("")
    assert kept == Path(sys.executable).name[:15] or kept.startswith("python"), kept
    assert named == "rtrain-worker-n", "the kernel keeps 15 bytes of a thread's name"
    assert procctl.job_title("worker", "/runs/r1", "j1", "h2", "r3") == "rtrain worker h2 r3 /runs/r1 --job j1"


def _record(
    host: str, job: str, state: str = "idle", round: int = -1, worker: int | None = None, standby: int | None = None
) -> HostRecord:
    return HostRecord(
        host=host,
        job=job,
        slice=0,
        index=0,
        seq=1,
        time=1.0,
        pid=100,
        node="n1",
        coordinator="c:1",
        state=state,
        round=round,
        worker_pid=worker,
        standby_pid=standby,
    )


def test_a_host_record_carries_its_worker_s_and_standby_s_pids_and_status_json_shows_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = str(tmp_path / "run")
    store = open_store(uri)
    rdv = Rendezvous(store)
    rdv.beat(_record("h0", "j1", state="training", round=4, worker=201, standby=202))
    rdv.beat(_record("h1", "j1", standby=302))
    rdv.beat(_record("h9", "j0"))  # an earlier job's host: not this job's
    older = asdict(_record("h2", "j1"))
    del older["worker_pid"], older["standby_pid"]  # a record written before records carried the pids
    store.put("rendezvous/hosts/h2.json", json.dumps(older).encode())

    assert (rdv.hosts()["h0"].worker_pid, rdv.hosts()["h0"].standby_pid) == (201, 202)
    assert (rdv.hosts()["h2"].worker_pid, rdv.hosts()["h2"].standby_pid) == (None, None)
    procs = api.host_processes(uri, "j1")
    assert list(procs) == ["h0", "h1", "h2"]
    assert procs["h0"] == {"node": "n1", "state": "training", "round": 4, "agent": 100, "worker": 201, "standby": 202}
    assert (procs["h1"]["worker"], procs["h1"]["standby"]) == (None, 302)
    assert api.host_processes(uri, None) == {}

    write_status(store, state="finished", job="j1", run_uri=uri, steps_total=10, step=10)
    assert cli.main(["status", uri, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["state"] == "finished" and shown["processes"]["h0"]["worker"] == 201
    assert shown["processes"]["h1"] == {**procs["h1"]}
    assert cli.main(["status", uri]) == 0
    text = capsys.readouterr().out
    assert "h0 on n1: agent 100, worker 201, standby 202 (training)" in text
    assert "h1 on n1: agent 100, standby 302 (idle)" in text


@pytest.mark.slow
def test_each_process_of_a_job_names_itself_and_status_gives_the_live_worker_and_standby(
    tmp_path: Path, tiny_dataset: str, jax_cache: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = job_config(str(tmp_path), tiny_dataset, jax_cache, run_name="titled", steps=150, min_workers=2)
    handle = start_job(cfg)
    run, job = cfg.run_uri, str(handle["job"])

    def both() -> dict[str, HostRecord] | None:
        recs = hosts(run)
        ready = len(recs) == 2 and all(r.worker_pid and r.standby_pid and r.round > 0 for r in recs.values())
        return recs if ready else None

    recs = wait_for(both, 240, "each host's worker and standby in its record", every=0.1)
    assert cli.main(["status", run, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["processes"]
    for host, r in sorted(recs.items()):
        assert _title(r.pid) == f"rtrain agent {host} {run} --job {job}"
        assert _comm(r.pid) == "rtrain-agent"
        assert _title(r.worker_pid) == f"rtrain worker {host} r{r.round} {run} --job {job}"
        assert _title(r.standby_pid) == f"rtrain standby {host} {run} --job {job}"
        assert {_parent(r.worker_pid), _parent(r.standby_pid)} == {r.pid}
        assert _title(_parent(r.pid)) == f"rtrain template {run} --job {job}"
        servers = [
            int(p)
            for p in os.listdir("/proc")
            if p.isdigit()
            and _safe(lambda p=p: _parent(int(p))) == r.pid
            and _safe(lambda p=p: _title(int(p))) == f"rtrain forkserver {host} {run} --job {job}"
        ]
        assert len(servers) == 1, f"{host}: one fork server, named"
        # What status --json says is this host's live worker and standby (as the record gave them moments ago).
        assert (shown[host]["agent"], shown[host]["worker"], shown[host]["standby"]) == (
            r.pid,
            r.worker_pid,
            r.standby_pid,
        ), shown
    st = wait_finished(handle)
    assert st["state"] == "finished", worker_logs(run)
    gone = hosts(run)
    assert all(r.worker_pid is None and r.standby_pid is None for r in gone.values()), "an agent's last record: none"


def _safe(read: object) -> object:
    try:
        return read()  # type: ignore[operator]
    except (OSError, ValueError, IndexError):
        return None
