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


def test_a_job_s_writes_under_a_vanished_run_root_raise_root_gone_and_make_nothing(tmp_path: Path) -> None:
    """A process that works in a run root (``expect_root``) never makes it anew once it is gone, nor writes on the
    directory now in its place; the error is a lasting one that names the root."""
    from training.storage import RootGone, expect_root, is_transient

    run = tmp_path / "run"
    store = open_store(str(run))
    store.put("status.json", b"{}")
    expect_root(str(run))
    step = open_store(str(run / "checkpoints" / "5"))  # a store of a step, below the root
    step.put("meta", b"x")
    run.rename(tmp_path / "away")
    for write in (lambda: store.put("status.json", b"{}"), lambda: step.put("meta", b"y")):
        with pytest.raises(RootGone, match=f"the run root {run} is gone \\(No such file or directory\\)") as gone:
            write()
        assert not is_transient(gone.value)
    assert not run.exists(), "nothing was made anew"
    run.mkdir()  # another directory in its place (a volume unmounted leaves its mount point)
    with pytest.raises(RootGone, match="another directory is in its place"):
        store.create("lock/000000000001.json", b"{}")
    assert not list(run.iterdir())
    expect_root(str(run))  # a process that begins a job on the new directory expects that one
    store.put("status.json", b"{}")


class Broken:
    """One storage failure of a running job's run root: how it is done, what the job's end must name, how it is undone."""

    def __init__(self, failure: str, mnt: Path, run: Path) -> None:
        self.failure, self.mnt, self.run = failure, mnt, run
        self.filler: Path | None = None
        self.volume = mnt / "volume"  # the vanishing root's own volume (a bind mount stands for it)
        # Where nothing can be written (status, lease, events), the job's end is known only to the launcher.
        self.writable = failure in ("full", "checkpoints-read-only")
        if failure == "vanished":
            self.volume.mkdir()
            run.mkdir(parents=True)
            assert _mount("--bind", str(self.volume), str(run))

    def do(self) -> str:
        """Break the storage; the words the job's end reason must hold."""
        if self.failure == "full":
            self.filler = _fill(self.mnt)
            return f"no space left on {self.run} (No space left on device"
        if self.failure == "vanished":
            # Its volume unmounted: files open already go on; by path, the empty directory under it is all there is.
            assert subprocess.run(["umount", "-l", str(self.run)]).returncode == 0
            return f"the run root {self.run} is gone (another directory is in its place"
        ro = self.run / "checkpoints" if self.failure == "checkpoints-read-only" else self.run
        # A read-only mount over it: files open already (the logs) write on; every new write is refused.
        assert _mount("--bind", str(ro), str(ro)) and _mount("-o", "remount,bind,ro", str(ro))
        return f"the run root {self.run} refuses writes (Read-only file system"

    def undo(self) -> None:
        if self.filler is not None:
            self.filler.unlink()
        elif self.failure == "vanished":
            assert _mount("--bind", str(self.volume), str(self.run))
        else:
            ro = self.run / "checkpoints" if self.failure == "checkpoints-read-only" else self.run
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)


STORAGE_FAILURES = ("full", "checkpoints-read-only", "root-read-only", "vanished")


@pytest.mark.parametrize("failure", STORAGE_FAILURES)
def test_a_storage_failure_ends_the_job_naming_it_and_a_rerun_resumes(
    tmp_path: Path, tiny_dataset: str, jax_cache: str, failure: str
) -> None:
    """A storage failure under a running job (Orbax's background commit failing too) ends the job soon with one line naming the run root and the error; no process is left, and with the storage back a
    rerun resumes from a committed step.

    The failures: a full disk; the checkpoint root gone read-only; the whole run root gone read-only; the run
    root vanished (its volume unmounted: by path, only the empty directory under it is left).
    Where the root still takes writes, the job records its end there and gives the lease back.  Where it takes
    none (read-only or vanished: the status and the lease live in it), the launcher still ends, failed, with
    the reason (``api.job_state`` of its handle: the end is kept on this machine), and the job writes none of
    its records on whatever directory is in a vanished root's place.  Its lease then lapses; with the root
    back, a status check records the job failed with that reason (never a live job) and the rerun takes the
    run over.
    """
    import psutil

    from training.checkpoint.lock import RunLock
    from training.events import ALIVE_STATES

    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)):
        pytest.skip("needs a tmpfs mount (root) to make a disk that fills up")
    run = mnt / "runs" / "broken"
    broken = Broken(failure, mnt, run)
    try:
        cfg = job_config(
            str(mnt / "runs"),
            tiny_dataset,
            jax_cache,
            run_name="broken",
            steps=40,
            checkpoint_every=5,
            min_workers=1,
            max_workers=2,
            log_every=5,
        )
        handle = start_job(cfg)
        wait_for(lambda: ((api.status(cfg.run_uri) or {}).get("latest_committed") or 0) >= 5, 240, "a checkpoint")
        t = time.time()
        named = broken.do()
        try:
            st = wait_finished(handle, timeout=150)
        except AssertionError as e:  # what the job was doing instead of ending: its records, where still readable
            told = [(x.get("type"), x.get("step"), x.get("reason")) for x in api.events(cfg.run_uri)[-25:]]
            raise AssertionError(
                f"{e}\nstatus: {api.status(cfg.run_uri)}\nevents: {told}\n{worker_logs(cfg.run_uri)}"
            ) from None
        took = time.time() - t
        look = api.job_state(handle)
        print(f"{failure}: the job ended {took:.1f} s after the storage failed: {look['reason']}")
        assert look["state"] == "failed" and named in look["reason"] and "\n" not in look["reason"], look
        # It ended on the failure itself, not on the watchdog of a job that made no progress (hang_timeout_s:
        # 120 s here), whatever this machine's load makes of the seconds between.
        assert "(hang)" not in look["reason"], f"the job went on {took:.0f} s after its storage failed: {look}"
        procs = [p for p in psutil.process_iter(["cmdline"]) if cfg.run_uri in " ".join(p.info["cmdline"] or [])]
        assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], procs
        if broken.writable:
            assert st["state"] == "failed" and named in st["reason"], st
            assert RunLock(open_store(cfg.run_uri), owner="test").held_by() is None, "the lease is given back"
        elif failure == "vanished":
            assert not (run / "status.json").exists(), "the job wrote on the directory in its root's place"
        broken.undo()
        assert (api.repair_status(cfg.run_uri) or {}).get("state") not in ALIVE_STATES, "no live job is shown"
        committed = api.committed_steps(cfg.run_uri)
        assert committed and min(committed) >= 5, committed
        assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
        restored = [e["step"] for e in api.events(cfg.run_uri, ("restore",))]
        assert restored and restored[-1] in committed, (restored, committed)
        assert (api.status(cfg.run_uri) or {}).get("step") == 40
    finally:
        for p in psutil.process_iter(["cmdline"]):
            if str(mnt) in " ".join(p.info["cmdline"] or []):
                p.kill()
        for ro in (run / "checkpoints", run):
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        os.sync()
