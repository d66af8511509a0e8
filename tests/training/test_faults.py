"""Nothing lost, nothing trusted that should not be: damaged checkpoints and data, a bad restore, a full disk.

Real jobs on the local slice, with the damage done to real files.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from jobs import job_config, run_job, start_job, wait_finished, wait_for, worker_logs

from training import api
from training.checkpoint.ledger import Ledger
from training.storage import open_store

pytestmark = pytest.mark.slow


def _largest_file(step_dir: Path) -> Path:
    """The step's largest file: array data, in any checkpoint format."""
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def test_a_damaged_checkpoint_is_named_marked_corrupt_and_stepped_over(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="damaged",
        steps=15,
        checkpoint_every=5,
        min_workers=1,
        max_workers=1,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    run = Path(cfg.run_uri)

    # One flipped byte in the newest checkpoint's biggest data file: the restore refuses it, names the file,
    # marks the step corrupt (moved out of the resume path) and resumes from the next newest.
    victim = _largest_file(run / "checkpoints" / "15")
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    victim.write_bytes(bytes(raw))
    onward = cfg.model_copy(update={"steps": 20})
    assert run_job(onward) == 0, worker_logs(cfg.run_uri)
    [corrupt] = api.events(cfg.run_uri, ("checkpoint_corrupt",))
    rel = victim.relative_to(run / "checkpoints" / "15").as_posix()
    assert corrupt["step"] == 15 and rel in corrupt["reason"] and "CRC32C" in corrupt["reason"]
    ledger = Ledger(open_store(cfg.run_uri))
    assert ledger.state(15)["history"][:2] == ["committed", "corrupt"]
    restores = api.events(cfg.run_uri, ("restore",))
    assert restores[-1]["step"] == 10, "the job resumed from the next newest checkpoint, not the damaged one"
    assert api.status(cfg.run_uri)["state"] == "finished" and api.status(cfg.run_uri)["step"] == 20
    assert not api.events(cfg.run_uri, ("failure",)), "a damaged checkpoint is not a host failure"

    # A truncated file, then a deleted one: the same, each named.
    for damage, newest, back_to in (("truncate", 20, 15), ("delete", 25, 20)):
        victim = _largest_file(run / "checkpoints" / str(newest))
        if damage == "truncate":
            victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        else:
            victim.unlink()
        assert run_job(cfg.model_copy(update={"steps": newest + 5})) == 0, worker_logs(cfg.run_uri)
        last = api.events(cfg.run_uri, ("checkpoint_corrupt",))[-1]
        assert last["step"] == newest and victim.name in last["reason"]
        assert ("truncated" if damage == "truncate" else "missing") in last["reason"]
        assert api.events(cfg.run_uri, ("restore",))[-1]["step"] == back_to
    assert sorted(int(p.name.split("-")[0]) for p in (run / "quarantine").iterdir()) == [15, 20, 25]


def test_the_guard_never_rolls_back_to_the_step_it_restored_when_that_step_gave_the_bad_loss(
    tmp_path, tiny_dataset, jax_cache
):
    # The update of step 11 is NaN on every pass (repeat=1), so the loss goes non-finite at step 13.
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="guard",
        steps=20,
        checkpoint_every=5,
        min_workers=1,
        max_workers=1,
        log_every=1,
        max_guard_rollbacks=2,
        chaos=["nan:step=11,repeat=1"],
    )
    assert run_job(cfg) == 1
    rollbacks = api.events(cfg.run_uri, ("rollback",))
    # First back to 10 (committed before the bad step); restoring 10 gave the bad loss again with nothing
    # committed since, so the next rollback goes further back, to 5, and 10 is moved out of the way.
    assert [(e["from_step"], e["to_step"]) for e in rollbacks] == [(13, 10), (13, 5)]
    assert rollbacks[0]["quarantined"] == [] and rollbacks[1]["quarantined"] == [10]
    ledger = Ledger(open_store(cfg.run_uri))
    assert ledger.state(10)["history"][:3] == ["committed", "quarantined", "committed"]  # 10 was trained again
    [moved] = (Path(cfg.run_uri) / "quarantine").iterdir()
    assert moved.name.startswith("10-")
    st = api.status(cfg.run_uri)
    assert st["state"] == "failed" and "rollback(s) did not help (max_guard_rollbacks=2)" in st["reason"]


def test_a_broken_dataset_fails_the_job_with_the_worker_s_own_error_and_its_log(
    tmp_path, tiny_dataset, jax_cache, capsys
):
    from training import data
    from training.cli import main

    ds = tmp_path / "ds"
    data.prepare(None, str(ds), 64, max_bytes=60_000)
    shard = data.load_manifest(str(ds))["splits"]["train"]["shards"][0]["name"]
    raw = bytearray((ds / shard).read_bytes())
    raw[100] ^= 0xFF
    (ds / shard).write_bytes(bytes(raw))
    rc = main(
        [
            "train",
            "--preset",
            "tiny",
            f"root={tmp_path}",
            f"dataset={ds}",
            f"compilation_cache={jax_cache}",
            "run_name=broken",
            "min_workers=1",
            "max_workers=1",
            "max_failures=0",
            "steps=5",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert "rtrain: the job failed: failure budget spent" in err
    assert f"dataset: {ds / shard}: sha256" in err and "does not match the manifest" in err
    assert "--- the end of " in err and "worker-" in err  # the failed worker's log, named, and its last lines


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def _fill(mnt: Path) -> Path:
    """Fill the file system at ``mnt`` with one file; its path."""
    filler = mnt / f"filler-{uuid.uuid4().hex}"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return filler


@pytest.mark.parametrize(
    ("checkpoint_format", "failure"), [("lean", "full"), ("ocdbt", "full"), ("ocdbt", "read-only")]
)
def test_a_storage_failure_ends_the_job_naming_it_and_a_rerun_resumes(
    tmp_path: Path, tiny_dataset: str, jax_cache: str, checkpoint_format: str, failure: str
) -> None:
    """A full disk under the run root, or its checkpoint root gone read-only, in either format (Orbax's background
    commit failing too) ends the job soon, naming the error; no process is left, the lease is given back, and
    with the storage back a rerun resumes from a committed step."""
    import psutil

    from training.checkpoint.lock import RunLock

    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)):
        pytest.skip("needs a tmpfs mount (root) to make a disk that fills up")
    ckpts = mnt / "runs" / "broken" / "checkpoints"
    try:
        cfg = job_config(
            str(mnt / "runs"),
            tiny_dataset,
            jax_cache,
            run_name="broken",
            steps=40,
            checkpoint_every=5,
            checkpoint_format=checkpoint_format,
            min_workers=1,
            max_workers=2,
            log_every=5,
        )
        handle = start_job(cfg)
        wait_for(lambda: ((api.status(cfg.run_uri) or {}).get("latest_committed") or 0) >= 5, 240, "a checkpoint")
        t = time.time()
        if failure == "full":
            filler = _fill(mnt)
            named = f"no space left on {cfg.run_uri} (No space left on device"
        else:  # the checkpoint root alone: the run's status and lease stay writable
            assert _mount("--bind", str(ckpts), str(ckpts)) and _mount("-o", "remount,bind,ro", str(ckpts))
            named = "Read-only file system"
        st = wait_finished(handle, timeout=300)
        took = time.time() - t
        print(
            f"{checkpoint_format} {failure}: the job ended {took:.1f} s after the storage failed: {st['reason'][:200]}"
        )
        assert st["state"] == "failed" and named in st["reason"], st
        assert took < 120, f"the job went on {took:.0f} s after its checkpoint storage failed"
        procs = [p for p in psutil.process_iter(["cmdline"]) if cfg.run_uri in " ".join(p.info["cmdline"] or [])]
        assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], procs
        assert api.job_state(handle)["state"] == "failed"
        assert RunLock(open_store(cfg.run_uri), owner="test").held_by() is None, "the lease is given back"
        committed = api.committed_steps(cfg.run_uri)
        assert committed and min(committed) >= 5, committed
        if failure == "full":
            filler.unlink()
        else:
            subprocess.run(["umount", "-l", str(ckpts)], capture_output=True)
        assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
        restored = [e["step"] for e in api.events(cfg.run_uri, ("restore",))]
        assert restored and restored[-1] in committed, (restored, committed)
        assert (api.status(cfg.run_uri) or {}).get("step") == 40
    finally:
        for p in psutil.process_iter(["cmdline"]):
            if str(mnt) in " ".join(p.info["cmdline"] or []):
                p.kill()
        subprocess.run(["umount", "-l", str(ckpts)], capture_output=True)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        os.sync()
