"""The run's records have closed schemas: events, checkpoint records and a DAG run's mark say only what they declare."""

from __future__ import annotations

from pathlib import Path

import pytest

from training import api
from training.checkpoint.ledger import Ledger
from training.events import EVENT_FIELDS, EventError, EventLog, make_event
from training.storage import open_store


def test_an_event_with_a_field_the_schema_does_not_declare_is_refused() -> None:
    ev = make_event("progress", "h1-1", 1.0, step=3, loss=2.5)
    assert (ev["type"], ev["step"], ev["loss"]) == ("progress", 3, 2.5)
    with pytest.raises(EventError, match=r"fields \['lose'\] that events.Event does not declare"):
        make_event("progress", "h1-1", 1.0, step=3, loss=2.5, lose=1.0)
    with pytest.raises(EventError, match="lacks"):
        make_event("progress", "h1-1", 1.0, step=3)
    assert {"type", "time", "source", "step", "reason"} <= EVENT_FIELDS


def test_events_read_back_as_written_with_their_key(tmp_path: Path) -> None:
    log = EventLog(open_store(str(tmp_path)), source="h1-1")
    written = log.emit("failure", attempt=2, reason="host h2 lost", detect_s=0.4)
    (read,) = api.events(str(tmp_path))
    assert read["_key"].startswith("events/")
    assert {k: v for k, v in read.items() if k != "_key"} == written


def test_a_checkpoint_record_with_an_undeclared_field_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    ledger = Ledger(open_store(str(tmp_path)))
    with pytest.raises(ValueError, match=r"no field \['metric'\]"):
        ledger.record(5, "validated", metrics={"loss": 1.0}, metric="loss")
    assert ledger.state(5) is None
    ledger.record(5, "validated", metrics={"loss": 1.0})
    ledger.record(5, "promoted")
    rec = api.checkpoint_states(str(tmp_path))[5]
    assert (rec["state"], rec["metrics"], rec["history"]) == ("promoted", {"loss": 1.0}, ["validated", "promoted"])


def test_a_dag_run_s_mark_is_written_once(tmp_path: Path) -> None:
    run = str(tmp_path)
    assert api.dag_run_mark(run, "manual__1") is None
    api.set_dag_run_mark(run, "manual__1", resume_from="latest", existed=False)
    api.set_dag_run_mark(run, "manual__1", resume_from="12", existed=True)  # a retry: the first mark stays
    mark = api.dag_run_mark(run, "manual__1")
    assert mark is not None and (mark["resume_from"], mark["existed"]) == ("latest", False)


def test_an_event_that_happened_before_it_was_written_keeps_its_time_and_its_place_in_the_log(tmp_path: Path) -> None:
    log = EventLog(open_store(str(tmp_path)), source="h1-1")
    later = log.emit("progress", reported_at=1000.25, step=2, loss=2.0)
    now = log.emit("progress", step=1, loss=2.5)
    assert later["time"] == 1000.25 and now["time"] > 1000.25
    # The log's order is the order of writing, whatever each event says about when it happened.
    assert [(e["step"], e["time"]) for e in api.events(str(tmp_path))] == [(2, 1000.25), (1, now["time"])]
    # An event's own fields keep their names: a fault's "at" (when it struck) is not the event's time.
    fault = log.emit("chaos", reported_at=1000.5, action="preempt", step=3, at=1000.4)
    assert (fault["time"], fault["at"]) == (1000.5, 1000.4)
