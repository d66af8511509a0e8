"""A worker's end its agent cannot write as a report (a full disk) still reaches the leader, in the heartbeat."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from training import api
from training.cadence import cadence
from training.checkpoint.ledger import Ledger
from training.elastic.host.heartbeat import Heartbeat, first_record
from training.elastic.host.hostctx import HostContext
from training.elastic.host.hostview import HostView
from training.elastic.host.hostwatch import HostWatch
from training.elastic.host.jobstatus import JobStatus
from training.elastic.host.reports import ReportHandler
from training.elastic.host.round_end import RoundFailed, lasting_storage_error
from training.elastic.host.rounds import Carried, LeaderRecords, RoundWriter
from training.elastic.host.roundwatch import RoundWatch
from training.elastic.host.writer import Writer
from training.elastic.rendezvous import Outcome, Rendezvous, ResumeFrom
from training.events import EventLog
from training.storage import open_store


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB file system of its own, unmounted at the end."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("needs a tmpfs mount (root) to make a disk that fills up")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(mnt: Path) -> None:
    with open(mnt / f"filler-{uuid.uuid4().hex}", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def test_a_report_the_full_disk_refuses_rides_the_heartbeat_and_the_leader_ends_the_job_naming_it(
    small_disk: Path,
) -> None:
    """With the space held back for the job's end spent, a worker's failure report cannot be made a file, while
    its agent's heartbeat, rewritten in place, still gets through.  The heartbeat carries the report: the leader
    sees the round fail at once, and the job's end names the full disk, instead of a round that looks alive until
    the hang watchdog ends it."""
    cfg = api.load_config("tiny", None, {"root": str(small_disk), "run_name": "r", "min_workers": 1})
    store = open_store(cfg.run_uri)
    rdv, events = Rendezvous(store), EventLog(store, source="test")
    rec = LeaderRecords(cfg, store, rdv, Ledger(store), events, "j1", "h0", lambda type_, **f: None, lambda: None)
    rnd, _plan = RoundWriter(rec, gen=lambda: 1, faults=lambda: [], prev=None).open(
        None, ["h0", "h1"], "127.0.0.1:1", "start", ResumeFrom(), Carried(0, 0)
    )
    rdv.beat(first_record("h1", "j1", 1, "127.0.0.1:2", time.time(), ""))  # h1 trains on
    heart = Heartbeat(rdv, first_record("h0", "j1", 1, "127.0.0.1:1", time.time(), ""), every_s=0.2)
    heart.start()
    writer = Writer("h0")
    writer.start()
    ctx = HostContext(cfg, cfg.run_uri, "j1", "h0", store, rdv, rec.ledger, events, heart, events.emit, None)
    handler = ReportHandler(
        ctx, local_dir=small_disk / "local", step_beat_s=1.0, writer=writer, leaving_at=lambda: None, warm=lambda: None
    )
    watch = HostWatch()
    view = HostView(cfg.elastic, rdv, "j1", "h0", watch)
    status = JobStatus(store, cadence(1, False, 0.2, 10.0), rnd, run_uri=cfg.run_uri, job="j1", leader="h0", steps=10)
    round_watch = RoundWatch(rec, view, status)
    try:
        view.read(time.time())
        assert round_watch.look(rnd, time.time()) is None, "the round trains"
        _fill(small_disk)
        handler.report(rnd.round, 0, Outcome.FAILED, reason="worker 0 exited with code 1")
        assert not rdv.reports(rnd.round), "no report could be written"
        seen = None
        deadline = time.time() + 10
        while not isinstance(seen, RoundFailed) and time.time() < deadline:
            time.sleep(0.1)
            view.read(time.time())
            seen = round_watch.look(rnd, time.time())
        assert isinstance(seen, RoundFailed), f"the leader did not see the round fail: {seen}"
        assert [r.host for r in seen.reports] == ["h0"] and "worker 0 exited with code 1" in seen.reports[0].reason
        ends = lasting_storage_error(seen.reports, cfg.run_uri)
        assert ends == f"no space left on {cfg.run_uri} (No space left on device)", ends
    finally:
        heart.last("gone")
        writer.close(timeout=1.0)
        watch.close()
