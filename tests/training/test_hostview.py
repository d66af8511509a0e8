"""The leader's view of its hosts after a failure: who showed life since, read from real records on a run root."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from training.config import load_config
from training.elastic.host.hostview import HostView
from training.elastic.host.hostwatch import HostWatch
from training.elastic.rendezvous import HostRecord, Rendezvous
from training.storage import open_store


@pytest.fixture
def view(tmp_path: Path) -> Iterator[HostView]:
    cfg = load_config("tiny", None, {"root": str(tmp_path), "heartbeat_s": 0.5, "heartbeat_timeout_s": 40.0})
    watch = HostWatch()
    yield HostView(cfg.elastic, Rendezvous(open_store(str(tmp_path))), "j", "h0", watch)
    watch.close()


def _beat(view: HostView, host: str, started: float, seq: int) -> None:
    """One beat of ``host``'s agent (started at ``started``), written now; the leader reads it."""
    rec = HostRecord(
        host=host,
        job="j",
        slice=0,
        index=int(host[1:]),
        seq=seq,
        time=time.time(),
        pid=1,
        node="n",
        coordinator="c:1",
        started=started,
    )
    view.rdv.beat(rec)
    view.read(time.time())


def test_a_host_whose_agent_was_made_again_shows_life_with_its_first_beats(view: HostView) -> None:
    """A pod made again (a new agent, its heartbeat numbers start over) is alive at once, not after a timeout."""
    for h in ("h0", "h1", "h2"):
        _beat(view, h, started=100.0, seq=500)
    since = view.settle(time.time(), lapsed=[])
    time.sleep(0.01)
    _beat(view, "h1", started=200.0, seq=1)  # h1's pod was made again: a new agent, beat number 1
    _beat(view, "h0", started=100.0, seq=501)
    assert view.unsettled(["h0", "h1", "h2"], since, settle_s=20.0) == ["h2"]  # h2 may still show life
    assert view.lost_since(["h0", "h1", "h2"], since) == ["h2"]


def test_a_lapsed_agent_s_late_beats_are_no_life_but_a_new_agent_on_its_host_is(view: HostView) -> None:
    _beat(view, "h1", started=100.0, seq=7)
    since = view.settle(time.time(), lapsed=["h1"])
    time.sleep(0.01)
    _beat(view, "h1", started=100.0, seq=8)  # the same agent (a frozen one that thawed): still lost
    assert view.lost_since(["h1"], since) == ["h1"]
    _beat(view, "h1", started=300.0, seq=0)  # a new agent on that host
    assert view.lost_since(["h1"], since) == []


def test_a_beat_written_before_the_failure_is_no_life_even_from_a_new_agent(view: HostView) -> None:
    _beat(view, "h1", started=100.0, seq=7)
    at = time.time() + 5.0  # the failure, later than any beat written here
    since = view.settle(at, lapsed=[])
    _beat(view, "h1", started=200.0, seq=1)  # written before ``at``: read late, it says nothing of now
    assert view.lost_since(["h1"], since) == ["h1"]


def test_a_new_agent_s_beat_is_new_even_with_the_number_its_predecessor_last_wrote(view: HostView) -> None:
    _beat(view, "h1", started=100.0, seq=5)
    time.sleep(0.3)
    assert view.age("h1") >= 0.3
    _beat(view, "h1", started=200.0, seq=5)  # a new agent that has beaten as often as the old one had
    assert view.age("h1") < 0.3
