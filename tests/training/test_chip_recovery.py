"""The accelerator row's recovery sequence, run on CPU with the smallest shape: three processes in turn, the copy the
first one saved restored by a fresh process and by a standby told to resume."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.chip_recovery import rows
from benchmarks.table import find

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_sequence_measures_the_floor_a_save_and_a_fresh_and_a_standby_restore(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.chip_recovery", "--shape", "cpu-small", "--dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    train, fresh, standby = r["train"], r["fresh"], r["standby"]
    assert r["shape"] == "cpu-small" and 0 < train["state_gib"] < 0.1
    assert min(train[k] for k in ("d2h_s", "write_s", "read_s", "h2d_s", "save_written_s")) >= 0
    assert len(train["steps_before_s"]) == 5 and train["steps_during_s"], "steps ran while the copy was written"
    assert train["checked_ahead_s"] > 0
    for run in (fresh, standby):
        assert min(run[k] for k in ("imports_s", "runtime_s", "compile_s", "check_s", "first_step_s")) > 0
        assert run["checked_ahead"], "the restore took the agent's verdict on the copy"
        assert run["check_s"] < run["restore_s"] and run["total_s"] > 0
    # The fresh process's time counts from its start; the standby's from being told to resume, after its set-up.
    assert fresh["total_s"] >= fresh["imports_s"] + fresh["compile_s"] + fresh["restore_s"]
    assert standby["told"] > standby["started"] + standby["imports_s"] + standby["compile_s"]
    assert standby["total_s"] == pytest.approx(standby["restore_s"] + standby["first_step_s"], abs=1.0)
    assert list(tmp_path.iterdir()) == [], "the sequence leaves nothing behind"
    # The loop's time while the copy is written counts the save's pause, not only the steps after it.
    save = find(rows(r), f"accelerator:{r['shape']}:recovery:save")["ratio"]
    loop = (train["save_pause_s"] + sum(train["steps_during_s"])) / len(train["steps_during_s"])
    assert save is not None and save["median"] == pytest.approx(loop / statistics.median(train["steps_before_s"]))
