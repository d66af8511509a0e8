"""A host's heartbeat on a real run root: changes written at once when asked, the last record final."""

from __future__ import annotations

import time
from pathlib import Path

from training.elastic.host.heartbeat import Heartbeat
from training.elastic.rendezvous import HostRecord, Rendezvous
from training.storage import open_store


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_change_asked_now_is_written_at_once_and_the_last_record_stays(tmp_path: Path) -> None:
    rdv = Rendezvous(open_store(str(tmp_path)))
    record = HostRecord(host="h0", job="j", slice=0, index=0, seq=0, time=0.0, pid=1, node="n", coordinator="c:1")
    heart = Heartbeat(rdv, record, every_s=30.0)  # far apart: only a change asked now is written soon
    heart.start()
    _wait(lambda: "h0" in rdv.hosts())
    heart.update(now=True, state="training", step=7)
    _wait(lambda: rdv.hosts()["h0"].step == 7)
    heart.update(now=False, step=8)  # with the next beat, 30 s away
    time.sleep(0.2)
    assert rdv.hosts()["h0"].step == 7
    heart.last("gone")
    final = rdv.hosts()["h0"]
    assert (final.state, final.step) == ("gone", 8)
    seq = final.seq
    time.sleep(0.2)
    assert rdv.hosts()["h0"].seq == seq, "nothing is written after the last record"
