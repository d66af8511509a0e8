"""Training scalars as TensorBoard event files: written through the run store, read back by TensorBoard's reader."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tensorboard_view import read_scalars

from training.scalars import ScalarLog, logdir
from training.storage import open_store


@pytest.fixture(params=["local", "gcs"])
def run(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    return str(request.getfixturevalue("gcs_root")) + "/run"


def event_files(run: str, subdir: str = "train") -> list[str]:
    return [k for k in open_store(run).list(f"tensorboard/{subdir}/") if "tfevents" in k]


def losses(first: int, last: int, offset: float = 0.0) -> dict[int, float]:
    # Values exact in float32 (TensorBoard's scalar type), so the reads compare with ==.
    return {s: s / 4 + offset for s in range(first, last + 1)}


def series(run: str, tag: str = "loss", subdir: str = "train") -> list[tuple[int, float]]:
    return read_scalars(run, subdir)[tag]


def test_a_rollback_is_superseded_not_interleaved(run):
    log = ScalarLog(run, host=0)
    for step, v in losses(1, 10).items():
        log.add(step, {"loss": v, "lr": 0.5, "workers": 4})
    assert log.flush() == 1
    # Resumed from the checkpoint at step 5: steps 6.. are computed again, with other values.
    log.restart(6)
    for step, v in losses(6, 12, offset=100).items():
        log.add(step, {"loss": v, "lr": 0.25, "workers": 2})
    assert log.flush() == 1

    data = read_scalars(run)
    assert sorted(data) == ["loss", "lr", "workers"]
    assert data["loss"] == [(s, s / 4) for s in range(1, 6)] + [(s, s / 4 + 100) for s in range(6, 13)]
    assert data["lr"] == [(s, 0.5) for s in range(1, 6)] + [(s, 0.25) for s in range(6, 13)]
    assert [s for s, _ in data["workers"]] == list(range(1, 13))
    assert len(event_files(run)) == 2


def test_a_restart_in_a_later_flush_and_by_a_new_writer(run):
    # Several flushes, then the process dies; a new writer (another host, after a resize) resumes at 8.
    first = ScalarLog(run, host="host-a")
    for step, v in losses(1, 12).items():
        first.add(step, {"loss": v})
        if step % 4 == 0:
            assert first.flush() == 1
    second = ScalarLog(run, host="host-b")
    second.restart(8)
    for step, v in losses(8, 15, offset=-50).items():
        second.add(step, {"loss": v})
    second.flush()
    # Then a validation-triggered rollback to step 10, within the second writer, in a later flush.
    second.restart(10)
    second.flush()
    for step, v in losses(10, 16, offset=7).items():
        second.add(step, {"loss": v})
    second.flush()

    got = series(run)
    assert [s for s, _ in got] == list(range(1, 17))
    assert got == [(s, s / 4) for s in range(1, 8)] + [(s, s / 4 - 50) for s in (8, 9)] + [
        (s, s / 4 + 7) for s in range(10, 17)
    ]
    names = [k.rsplit("/", 1)[-1] for k in event_files(run)]
    assert len(names) == 3 + 3 and len(set(names)) == 6
    # Read in name order, the second writer's files come after all of the first's.
    assert [n.split(".")[5] for n in sorted(names)] == ["host-a"] * 3 + ["host-b"] * 3


def test_a_new_writer_starts_a_session_at_its_first_step(run):
    # No explicit restart: a new writer whose first step is 4 supersedes steps >= 4 of the old one.
    old = ScalarLog(run, host=0)
    for step, v in losses(1, 6).items():
        old.add(step, {"loss": v})
    old.flush()
    new = ScalarLog(run, host=1)
    for step, v in losses(4, 7, offset=1).items():
        new.add(step, {"loss": v})
    new.flush()
    assert series(run) == [(1, 0.25), (2, 0.5), (3, 0.75)] + [(s, s / 4 + 1) for s in range(4, 8)]


def test_a_step_going_backwards_is_a_restart_and_a_step_may_come_in_parts(run):
    log = ScalarLog(run, host=0)
    log.add(1, {"loss": 1.0})
    log.add(2, {"loss": 2.0})
    log.add(2, {"accuracy": 0.5})  # the same step, more tags: merged into it
    log.flush()
    log.add(2, {"tokens_per_s": 8.0})  # a new tag at a written step: no restart needed
    log.add(3, {"loss": 3.0})
    log.add(3, {"loss": 3.5})  # a tag given again while pending: replaced
    log.flush()
    log.add(3, {"loss": 4.0})  # given again after it was written: the step is rewritten whole
    log.add(2, {"loss": 9.0})  # backwards without restart(): a restart at 2
    log.flush()
    data = read_scalars(run)
    assert data["loss"] == [(1, 1.0), (2, 9.0)]
    assert "accuracy" not in data and "tokens_per_s" not in data  # superseded by the restart at 2


def test_a_rewritten_step_keeps_its_other_tags(run):
    log = ScalarLog(run, host=0)
    log.add(5, {"loss": 1.0, "grad_norm": 2.0})
    log.flush()
    log.add(5, {"loss": 1.5})
    log.flush()
    assert read_scalars(run) == {"loss": [(5, 1.5)], "grad_norm": [(5, 2.0)]}


def test_a_flush_with_nothing_pending_writes_nothing(run):
    log = ScalarLog(run, host=0)
    assert log.flush() == 0
    assert event_files(run) == [] and read_scalars(run) == {}
    log.add(1, {})  # no values: nothing to record
    assert log.flush() == 0
    log.add(1, {"loss": 1.0})
    assert log.pending == 2  # the session's start, then step 1
    assert log.flush() == 1
    assert log.pending == 0 and log.flush() == 0
    assert len(event_files(run)) == 1 and log.files_written == 1


def test_hosts_and_processes_never_share_a_file_name(run):
    # Two writers on the same host name flush in the same instant: both files stay, each read.
    a, b = ScalarLog(run, host=3), ScalarLog(run, host=3)
    a.add(1, {"loss": 1.0})
    b.add(2, {"loss": 2.0})
    a.flush()
    b.flush()
    assert len(event_files(run)) == 2
    assert series(run) == [(1, 1.0), (2, 2.0)]


def test_another_process_writes_alongside(run, tmp_path):
    # A separate process (its own stamps and nonce) writes steps 1..3, this one 4..5.
    code = (
        "from training.scalars import ScalarLog\n"
        f"log = ScalarLog({run!r}, host=7)\n"
        "for s in (1, 2, 3): log.add(s, {'loss': float(s)})\n"
        "assert log.flush() == 1\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    log = ScalarLog(run, host=7)
    log.add(4, {"loss": 4.0})
    log.add(5, {"loss": 5.0})
    log.flush()
    assert series(run) == [(s, float(s)) for s in range(1, 6)]
    assert len(event_files(run)) == 2


def test_validation_metrics_are_a_run_of_their_own(run):
    train, val = ScalarLog(run, host=0), ScalarLog(run, host=0, subdir="validation")
    for step in range(1, 21):
        train.add(step, {"loss": step / 2})
        if step % 10 == 0:
            val.add(step, {"loss": step / 8, "accuracy": 0.75})
    train.flush()
    val.flush()
    # Validation at 20 was rejected: roll both back to the checkpoint at 10.
    train.restart(11)
    val.restart(11)
    train.add(11, {"loss": 100.0})
    val.add(20, {"loss": 1.0, "accuracy": 0.5})
    train.flush()
    val.flush()
    assert read_scalars(run, "validation") == {
        "loss": [(10, 1.25), (20, 1.0)],
        "accuracy": [(10, 0.75), (20, 0.5)],
    }
    assert series(run)[-2:] == [(10, 5.0), (11, 100.0)]
    assert len(series(run)) == 11
    assert logdir(run) == run.rstrip("/") + "/tensorboard"
    assert len(event_files(run, "validation")) == 2


def test_a_new_writer_names_its_files_after_the_newest_one(tmp_path):
    # A writer whose clock is behind (another host) still sorts after what is there.
    run = str(tmp_path / "run")
    store = open_store(run)
    ahead = "tensorboard/train/events.out.tfevents.9999999999.000000000.old.abcdef12"
    log = ScalarLog(run, host=0, store=store)
    log.add(1, {"loss": 1.0})
    store.put(ahead, b"")  # (empty: a reader finds no records in it)
    log.flush()
    names = sorted(k for k in store.list("tensorboard/train/"))
    assert names[0] == ahead and names[1].startswith("tensorboard/train/events.out.tfevents.9999999999.000000001.0.")
    assert series(run) == [(1, 1.0)]


def test_a_failed_write_keeps_the_records(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").write_text("not a directory")  # the write fails
    log = ScalarLog(str(run), host=0)
    log.add(1, {"loss": 1.0})
    with pytest.raises(OSError):
        log.flush()
    assert log.pending == 2
    (run / "tensorboard").unlink()
    log.add(2, {"loss": 2.0})
    assert log.flush() == 1
    assert series(str(run)) == [(1, 1.0), (2, 2.0)]


def test_bad_arguments():
    with pytest.raises(ValueError):
        ScalarLog("/tmp/x", host=0, subdir="../escape")
    with pytest.raises(ValueError):
        ScalarLog("/tmp/x", host=0).add(-1, {"loss": 1.0})


def test_importing_the_module_loads_no_tensorboard_nor_jax():
    code = (
        "import sys, training.scalars\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'tensorboard', 'jax', 'flax', 'orbax', 'grain'})\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
