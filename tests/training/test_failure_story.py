"""How the leader tells a failure: what detected it, and which reason and worker it blames (pure, tables)."""

from __future__ import annotations

from typing import Any

import pytest

from training.elastic.host.round_end import detected_by_what, explain_failure, lasting_storage_error
from training.elastic.rendezvous import Outcome, Report


def _rep(host: str, rank: int, **kw: Any) -> Report:
    return Report(round=3, host=host, rank=rank, outcome=Outcome.FAILED, **kw)


@pytest.mark.parametrize(
    ("reports", "lapsed", "ended", "want"),
    [
        ([_rep("h0", 0, peer_lost=1)], [], [], "peer watch"),
        ([_rep("h1", 1, reason="worker crashed")], [], [], "failed worker"),
        ([], ["h1"], ["h1"], "host watch"),
        ([], ["h1", "h2"], ["h1"], "heartbeat timeout"),
        ([], [], [], "leader"),
    ],
)
def test_what_detected_a_failure(reports: list[Report], lapsed: list[str], ended: list[str], want: str) -> None:
    assert detected_by_what(reports, lapsed, ended) == want


def test_lost_hosts_are_the_reason_and_say_how_they_were_found() -> None:
    assert explain_failure(["h1"], ["h1"], "", []) == ("host h1 lost (agent gone)", None)
    assert explain_failure(["h1", "h2"], ["h1"], "", []) == ("host h1, h2 lost (no heartbeat since the failure)", None)
    assert explain_failure([], [], "step 40 hung for 300s", []) == ("step 40 hung for 300s", None)
    assert explain_failure([], [], "", []) == ("the round failed", None)


def test_a_signalled_worker_is_blamed_before_one_that_failed_on_its_own_before_a_bystander() -> None:
    bystander = _rep("h0", 0, reason="peer gone", peer_lost=2)
    own = _rep("h1", 1, reason="worker exited with code 1", error="ValueError: bad batch")
    killed = _rep("h2", 2, reason="worker killed by SIGKILL", returncode=-9)
    assert explain_failure([], [], "", [bystander, own, killed]) == ("worker killed by SIGKILL", killed)
    assert explain_failure([], [], "", [bystander, own]) == ("worker exited with code 1: ValueError: bad batch", own)
    assert explain_failure([], [], "", [bystander]) == ("peer gone", bystander)


SAVE = "RuntimeError: a checkpoint save to /r/run/checkpoints failed: [Errno {}] {}: '/r/run/checkpoints/5.tmp'"


@pytest.mark.parametrize(
    ("error", "want"),
    [
        (SAVE.format(30, "Read-only file system"), "the run root /r/run refuses writes (Read-only file system)"),
        (SAVE.format(122, "Disk quota exceeded"), "the run root /r/run refuses writes (Disk quota exceeded)"),
        (SAVE.format(28, "No space left on device"), "no space left on /r/run (No space left on device)"),
        ("RuntimeError: gloo: Connection reset by peer", ""),  # another round may well not meet it
        (SAVE.format(2, "No such file or directory"), ""),
    ],
)
def test_a_save_failing_on_storage_another_round_would_meet_again_is_the_job_s_end(error: str, want: str) -> None:
    bystander = _rep("h0", 0, peer_lost=1, error="peer process 1 of round 3 is gone")
    assert lasting_storage_error([bystander, _rep("h1", 1, error=error)], "/r/run") == want
