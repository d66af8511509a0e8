"""A worker's reports to its agent: a closed set of types, read back as they were written."""

from __future__ import annotations

import json

import pytest

from training.elastic.host.reports import EVENT_REPORTS
from training.elastic.wire import REQUIRED, ReportType, WorkerReport, decode, report


def test_every_report_type_reads_back_as_written() -> None:
    for kind in ReportType:
        rep = report(kind, 3, 1, **{**{f: 0 for f in REQUIRED[kind]}, "step": 7, "mesh": {"data": 2}})
        back = decode(rep.line())
        assert back == rep and back.type is kind
        assert (back.fields["attempt"], back.fields["process_id"], back.fields["step"]) == (3, 1, 7)
        assert isinstance(back.fields["time"], float)


def test_a_line_of_no_known_type_or_no_object_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no report type 'progres'"):
        decode(json.dumps({"type": "progres", "step": 1}))
    with pytest.raises(ValueError, match="no report type None"):
        decode(json.dumps({"step": 1}))
    with pytest.raises(ValueError, match="a JSON object, not list"):
        decode("[1, 2]")
    with pytest.raises(ValueError):
        decode(b"{not json")


def test_a_report_lacking_its_type_s_fields_is_refused_where_it_is_written_and_where_it_is_read() -> None:
    assert set(REQUIRED) == set(ReportType), "every report type says what it carries"
    with pytest.raises(ValueError, match="a checkpoint report lacks committed"):
        report(ReportType.CHECKPOINT, 1, 0, step=5)
    with pytest.raises(ValueError, match="a metrics report lacks step_time, values"):
        decode(json.dumps({"type": "metrics", "step": 1, "loss": 2.0}))


def test_a_report_s_type_is_one_of_the_set_and_the_events_are_among_them() -> None:
    with pytest.raises(ValueError):
        report("bogus", 0, 0)  # type: ignore[arg-type]
    assert EVENT_REPORTS <= set(ReportType)
    assert WorkerReport(ReportType.METRICS, {"step": 1}).line() == '{"type": "metrics", "step": 1}\n'
