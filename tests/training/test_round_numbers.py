"""Round numbers (a job's launches) count through the run: a new job's first round follows the last job's newest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training import api
from training.cadence import cadence
from training.checkpoint.ledger import Ledger
from training.elastic.host.follower import RoundFollower
from training.elastic.host.rounds import Carried, LeaderRecords, RoundWriter
from training.elastic.rendezvous import Rendezvous, ResumeFrom
from training.events import EventLog, RunState
from training.storage import open_store, scheme


def test_a_new_job_s_rounds_and_launches_count_on_from_the_jobs_before_it(tmp_path: Path) -> None:
    cfg = api.load_config("tiny", None, {"root": str(tmp_path), "run_name": "r", "min_workers": 1})
    store = open_store(cfg.run_uri)
    rdv = Rendezvous(store)
    events = EventLog(store, source="test")

    def emit(type_: str, **fields: Any) -> None:
        events.emit(type_, **fields)

    def writer(job: str) -> RoundWriter:
        rec = LeaderRecords(
            cfg=cfg,
            store=store,
            rdv=rdv,
            ledger=Ledger(store),
            events=events,
            job=job,
            host="h0",
            emit=emit,
            fence=lambda: None,
        )
        return RoundWriter(rec, gen=lambda: 1, faults=lambda: [], prev=None)

    first = writer("j1")
    rnd = None
    for _ in range(3):  # a job with two recoveries
        rnd, _plan = first.open(rnd, ["h0"], "127.0.0.1:1", "start", ResumeFrom(), Carried(0, 0))
    first.stop(rnd, RunState.FAILED, "its failure budget ran out", Carried(2, 0))
    assert rdv.round_numbers() == [1, 2, 3, 4]

    rdv.clear()  # the launcher of the next job (api.begin_job), under the run lock
    assert rdv.round_numbers() == [] and rdv.rounds_before() == 4
    follower = RoundFollower(
        rdv, "j2", cadence(1, scheme(cfg.run_uri).requests, cfg.elastic.heartbeat_s, cfg.elastic.lease_s)
    )
    assert list(follower.new_rounds(busy=False)) == []
    second = writer("j2")
    rnd, _plan = second.open(None, ["h0"], "127.0.0.1:1", "start", ResumeFrom(), Carried(0, 0))
    assert rnd.round == 5
    follower.look_now()
    assert [r.round for r in follower.new_rounds(busy=False)] == [5], "its agents find it by name, at once"

    rdv.clear()
    rdv.clear()  # a launch refused after it cleared: the count is kept all the same
    assert rdv.rounds_before() == 5
    assert writer("j3").stop(None, RunState.FAILED, "refused before it ran", Carried(0, 0)).round == 6
    launches = [e["attempt"] for e in events.read(types=("launch",))]
    assert launches == [1, 2, 3, 5], "no launch numbered again: the report and the demo's summary list #1 #2 #3 #5"
