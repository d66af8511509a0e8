"""The local checkpoint tier and the preemption notice.

Fast tests check the tier's bookkeeping on disk (manifests, checksums, what a
pruned or damaged copy looks like); the slow one runs a real job on three
simulated hosts through a notice (SIGTERM), a lost host and a damaged local copy.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from jobs import hosts, job_config, run_job, step_ids, worker_logs

from training import api
from training.checkpoint import local, local_copy
from training.config import load_config
from training.faults import parse_chaos
from training.storage import open_store


def _fake_step(directory: Path, step: int, payload: bytes = b"x" * 1000) -> None:
    """A step directory as the tier leaves it once finalised (its mark, and data)."""
    d = directory / str(step)
    (d / "state").mkdir(parents=True)
    (d / "state" / "data.bin").write_bytes(payload)
    (d / local_copy.STEP_MARK).write_text("{}")


def test_finalised_steps_are_described_once_and_a_pruned_step_loses_its_manifest(tmp_path):
    _fake_step(tmp_path, 2)
    _fake_step(tmp_path, 4)
    (tmp_path / ".6.tmp-1").mkdir()  # a save in flight: not a step yet
    described = local.describe_new(tmp_path, round_=3)
    assert sorted(described) == [2, 4] and described[4].round == 3
    assert described[4].files["state/data.bin"][0] == 1000
    # Described once: a later round does not re-describe (and re-date) a copy it did not save.
    assert local.describe_new(tmp_path, round_=5)[2].round == 3
    import shutil

    shutil.rmtree(tmp_path / "2")  # the tier kept local_keep and pruned it
    assert sorted(local.read_manifests(tmp_path)) == [4]
    assert not (tmp_path / "2.manifest.json").exists()


def _write_copy(directory: Path, step: int) -> dict:
    """A real copy of a small state as local step ``step`` (described by its agent); the state."""
    import jax.numpy as jnp

    from training.checkpoint import lean

    state = {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64), "b": jnp.ones((3,), jnp.bfloat16)}
    local.write_step(
        state, directory, step, {"next_batch": step, "global_batch": 16}, 2, lean.plan(state, every_held_box=True)
    )
    local.describe_new(directory, round_=1)
    return state


def test_verify_names_what_is_wrong_with_a_local_copy(tmp_path):
    _write_copy(tmp_path, 8)
    assert local.verify(tmp_path, 8) == ""
    shards = tmp_path / "8" / local_copy.SHARDS
    data = shards.read_bytes()
    shards.write_bytes(data[:400])
    assert f"400 bytes, {len(data)} when saved (truncated?)" in local.verify(tmp_path, 8)
    shards.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert "lean/0.bin fails its CRC32C check" in local.verify(tmp_path, 8)
    shards.write_bytes(data)
    assert local.verify(tmp_path, 8) == ""
    (tmp_path / "8" / "lean.json").unlink()
    assert "lean.json of local step 8 is missing" in local.verify(tmp_path, 8)
    assert local.verify(tmp_path, 10) == "no local copy of step 10 on this host"


def test_a_copy_is_described_by_its_writers_sums_and_damage_after_the_write_is_caught(tmp_path):
    import jax
    import numpy as np

    from training.checkpoint import bulk

    state = _write_copy(tmp_path, 6)
    shards = tmp_path / "6" / local_copy.SHARDS
    index = json.loads((tmp_path / "6" / local_copy.INDEX).read_bytes())
    sums = bulk.Sums.from_json(index["chunks"])
    assert index["files"][local_copy.SHARDS] == [shards.stat().st_size, sums.digest()]
    assert list(sums.crcs) == [bulk.crc32c(shards.read_bytes())], "one chunk: its sum is the file's"
    # Damaged after the write: the manifest holds what the writer wrote.
    data = bytearray(shards.read_bytes())
    data[100] ^= 0xFF
    shards.write_bytes(bytes(data))
    (tmp_path / "6.manifest.json").unlink()
    described = local.describe_new(tmp_path, round_=1)
    assert described[6].files[local_copy.SHARDS] == index["files"][local_copy.SHARDS]
    assert "fails its CRC32C check" in local.verify(tmp_path, 6)
    data[100] ^= 0xFF  # mended: it verifies and restores as written
    shards.write_bytes(bytes(data))
    assert local.verify(tmp_path, 6) == ""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    got, pos = local.read_step(tmp_path, 6, abstract)
    assert pos == {"next_batch": 6, "global_batch": 16}
    for k in state:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(state[k]))


def test_a_copy_its_agent_checked_ahead_is_restored_without_summing_until_its_file_changes(tmp_path, monkeypatch):
    import os
    from concurrent.futures import ThreadPoolExecutor

    _write_copy(tmp_path, 8)
    summed: list[int] = []
    check = local_copy.check

    def counted(m: local_copy.Mapped, pool: ThreadPoolExecutor) -> str:
        summed.append(m.step)
        return check(m, pool)

    monkeypatch.setattr(local_copy, "check", counted)
    pool = ThreadPoolExecutor(2)
    assert not local.checked_ahead(tmp_path, 8)
    assert local.check_ahead(tmp_path, 8) == "" and summed == [8], "the agent sums every byte once"
    assert local.checked_ahead(tmp_path, 8)
    problem, copy = local.open_checked(tmp_path, 8, pool)
    assert problem == "" and copy is not None and summed == [8], "the worker takes the agent's verdict"
    # A write to the file after the check (its bytes the same even): the worker sums it again, and finds the damage.
    shards = tmp_path / "8" / local_copy.SHARDS
    data = bytearray(shards.read_bytes())
    data[7] ^= 0x10
    shards.write_bytes(bytes(data))
    assert not local.checked_ahead(tmp_path, 8)
    problem, copy = local.open_checked(tmp_path, 8, pool)
    assert "fails its CRC32C check" in problem and copy is None and summed == [8, 8]
    assert "fails its CRC32C check" in local.check_ahead(tmp_path, 8) and not local.checked_ahead(tmp_path, 8)
    data[7] ^= 0x10
    shards.write_bytes(bytes(data))
    # A file that changes while its agent checks it gets no verdict.
    verify = local.verify

    def touched(directory: Path, step: int) -> str:
        os.utime(shards, ns=(1, 1))
        return verify(directory, step)

    monkeypatch.setattr(local, "verify", touched)
    assert local.check_ahead(tmp_path, 8) == "" and not local.checked_ahead(tmp_path, 8)
    monkeypatch.setattr(local, "verify", verify)
    assert local.check_ahead(tmp_path, 8) == "" and local.checked_ahead(tmp_path, 8)
    # A dropped copy takes its verdict with it.
    for step in (10, 12):
        _write_copy(tmp_path, step)
    assert local.finalised_steps(tmp_path) == [10, 12] and not (tmp_path / local.CHECKED.format(step=8)).exists()
    assert not [p.name for p in tmp_path.iterdir() if "checked" in p.name], "no verdict or partial one is left"
    # A verdict cut off mid-write by an agent that is gone, and one written as its copy was dropped: both go.
    (tmp_path / ".12.checked.tmp-999999999").write_text("{")
    assert local.check_ahead(tmp_path, 10) == ""
    import shutil

    shutil.rmtree(tmp_path / "10")
    local._remove_orphans(tmp_path)
    assert sorted(local.read_manifests(tmp_path)) == [12]
    assert not [p.name for p in tmp_path.iterdir() if "checked" in p.name]


def test_an_agent_checks_its_newest_local_copy_ahead_in_the_idle_class(tmp_path):
    import os
    import threading

    from training.checkpoint.ledger import Ledger
    from training.elastic.host.heartbeat import Heartbeat, first_record
    from training.elastic.host.hostctx import HostContext
    from training.elastic.host.reports import ReportHandler
    from training.elastic.host.writer import Writer
    from training.elastic.rendezvous import Rendezvous
    from training.events import EventLog

    cfg = api.load_config("tiny", None, {"root": str(tmp_path / "root"), "run_name": "r", "local_checkpoint_every": 2})
    store = open_store(cfg.run_uri)
    rdv, events = Rendezvous(store), EventLog(store, source="test")
    heart = Heartbeat(rdv, first_record("h0", "j1", 1, "127.0.0.1:1", 0.0, ""), every_s=60)
    ctx = HostContext(cfg, cfg.run_uri, "j1", "h0", store, rdv, Ledger(store), events, heart, events.emit, None)
    local_dir = tmp_path / "local"
    handler = ReportHandler(
        ctx, local_dir=local_dir, step_beat_s=1.0, writer=Writer("h0"), leaving_at=lambda: None, warm=lambda: None
    )
    policies: list[int] = []
    check_ahead = local.check_ahead

    def spy(directory: Path, step: int) -> str:
        policies.append(os.sched_getscheduler(threading.get_native_id()))
        return check_ahead(directory, step)

    local.check_ahead, restore = spy, local.check_ahead
    try:
        for step in (4, 6):
            _write_copy(local_dir, step)
        handler.describe_local(1, now=False)
        assert handler._ahead is not None
        handler._ahead.join(30)
    finally:
        local.check_ahead = restore
    assert local.checked_ahead(local_dir, 6) and not local.checked_ahead(local_dir, 4), "the newest copy, once"
    assert policies == [os.SCHED_IDLE], policies
    handler.describe_local(1, now=False)
    assert handler._ahead is not None and not handler._ahead.is_alive(), "a copy checked is not checked again"


def test_a_local_copy_is_staged_and_written_only_once_the_guard_has_passed_its_step(tmp_path):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec())
    state = {"w": jax.device_put(jnp.arange(256, dtype=jnp.float32), sharding)}
    abstract = {"w": jax.ShapeDtypeStruct((256,), jnp.float32, sharding=sharding)}
    tier = local.LocalTier(tmp_path, 2, mesh, abstract)
    assert tier.enabled, tier.reason
    assert tier.save(4, state, {"next_batch": 4}) is not None
    assert not tier.can_save() and tier.skipped == 1  # one copy staged at a time
    tier.release(3)
    tier.wait()
    assert local.finalised_steps(tmp_path) == [], "the guard has not passed step 4 yet"
    tier.release(4)
    tier.wait()
    assert local.finalised_steps(tmp_path) == [4]
    assert [s for s, _ in tier.finished()] == [4]
    got, pos = tier.restore(4)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(256, dtype=np.float32))
    assert pos == {"next_batch": 4}
    # A process that leaves lets the write in flight finish (a slow one here), within its grace.
    import time

    write = tier.writer

    def slow(*args, **kwargs):
        time.sleep(0.5)
        write(*args, **kwargs)

    tier.writer = slow
    assert tier.save(5, state, {"next_batch": 5}) is not None
    tier.release(5)
    t0 = time.monotonic()
    tier.finish_writing(0.05)  # a grace shorter than the write: it does not wait longer
    assert time.monotonic() - t0 < 0.4 and local.finalised_steps(tmp_path) == [4]
    tier.finish_writing(10)
    assert local.finalised_steps(tmp_path) == [4, 5]
    tier.writer = write
    # A step the guard never passed (the round left at it) is not saved, not even when the tier closes.
    assert tier.can_save() and tier.save(6, state, {"next_batch": 6}) is not None
    tier.close()
    assert local.finalised_steps(tmp_path) == [4, 5]


def test_write_parts_writes_every_buffer_in_order_past_the_kernels_limit(tmp_path, monkeypatch):
    import numpy as np

    from training import storage

    monkeypatch.setattr(storage, "IOV_MAX", 7)  # many calls, each ending at a buffer
    parts = [np.full(i % 5, i % 251, np.uint8) for i in range(100)]  # empty ones among them
    parts.append(np.arange(1 << 20, dtype=np.uint32))  # one the kernel may write short
    storage.write_parts(tmp_path / "f", parts, sync=True)
    assert (tmp_path / "f").read_bytes() == b"".join(p.tobytes() for p in parts)
    storage.write_parts(tmp_path / "f", [b"ab"], sync=False)  # an existing file is replaced whole
    assert (tmp_path / "f").read_bytes() == b"ab"


def test_local_copies_are_per_run_job_and_host_and_other_jobs_are_forgotten(tmp_path, monkeypatch):
    monkeypatch.delenv(local.LOCAL_DIR_ENV, raising=False)
    a = local.host_dir(str(tmp_path), "/runs/a", "j1", "h0")
    b = local.host_dir(str(tmp_path), "/other/a", "j1", "h0")
    assert a != b and a.parent.parent != b.parent.parent, "two runs of one name in two roots do not meet"
    old = local.host_dir(str(tmp_path), "/runs/a", "j0", "h0")
    old.mkdir(parents=True)
    a.mkdir(parents=True)
    local.forget_other_jobs(str(tmp_path), "/runs/a", "j1")
    assert a.is_dir() and not old.exists()
    # A job that is over leaves nothing of it or of its run; another run's copies stay.
    (a.parent / "h1").mkdir()
    b.mkdir(parents=True)
    local.forget_job(str(tmp_path), "/runs/a", "j1")
    assert not a.parent.parent.exists() and b.is_dir()
    local.forget_job(str(tmp_path), "/runs/a", "j1")  # nothing left to forget: no error
    # A host's own setting (a pod's volume) wins over the config's.
    monkeypatch.setenv(local.LOCAL_DIR_ENV, str(tmp_path / "pod"))
    assert local.host_dir(str(tmp_path), "/runs/a", "j1", "h0").is_relative_to(tmp_path / "pod")


def test_a_round_s_resume_is_a_record_that_reads_back_and_reads_an_earlier_leader_s_text():
    """The leader tells the workers where to resume in a typed record (the local candidates, else the run's
    checkpoints); a round an earlier version wrote as text (``local:22,20``) still reads as the same record."""
    from training.elastic.rendezvous import ResumeFrom, Round

    offered = Round(round=3, job="j", gen=1, leader="h0", members=["h0"], resume=ResumeFrom(local=(22, 20)))
    written = json.loads(json.dumps(asdict(offered)))
    assert written["resume"] == {"checkpoint": "latest", "local": [22, 20]}
    assert Round.from_json(written).resume == ResumeFrom("latest", (22, 20)) == ResumeFrom.read("local:22,20")
    assert Round.from_json({**written, "resume": "40"}).resume == ResumeFrom("40")
    assert Round.from_json({k: v for k, v in written.items() if k != "resume"}).resume == ResumeFrom()
    assert (ResumeFrom(local=(22, 20)).text(), ResumeFrom("none").text()) == ("local:22,20", "none")


def test_the_damage_local_fault_is_checked():
    assert parse_chaos("damage_local:worker=0,step=9").worker == 0
    with pytest.raises(ValueError, match="damage_local needs the local tier"):
        load_config("tiny", None, {"chaos": ["damage_local:worker=0,step=9"]})
    cfg = load_config("tiny", None, {"chaos": ["damage_local:worker=0,step=9"], "local_checkpoint_every": 2})
    assert cfg.checkpoint.local_checkpoint_every == 2


def _attempts(run_uri: str) -> dict[int, int]:
    """How many rounds trained each step (the trace has one record per step, process and attempt)."""
    store = open_store(run_uri)
    seen: dict[int, set[int]] = {}
    for key in store.list("trace/"):
        _, step_s, name = key.split("/")
        seen.setdefault(int(step_s), set()).add(int(name[1:4]))
    return {s: len(a) for s, a in seen.items()}


@pytest.mark.slow
def test_a_notice_commits_the_step_a_lost_host_resumes_from_local_copies_and_a_damaged_copy_is_stepped_over(
    tmp_path, tiny_dataset, jax_cache
):
    from training.data import global_batch_ids

    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="local-tier",
        steps=34,
        global_batch=12,
        min_workers=1,
        max_workers=3,
        checkpoint_every=12,
        local_checkpoint_every=2,
        local_checkpoint_dir=str(tmp_path / "host-local"),
        trace_data_ids=True,
        chaos=[
            # 3 hosts: one gets a preemption notice (SIGTERM), the group stops at a step boundary and commits it.
            "preempt_notice:worker=1,step=5",
            # 2 hosts: one is lost outright; the survivor holds local copies newer than the persistent 12.
            "preempt:worker=1,step=17",
            # 1 host: its newest local copy goes bad, then its worker dies; the copy must be stepped over.
            "damage_local:worker=0,step=29",
        ],
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    st = api.status(cfg.run_uri)
    assert st["state"] == "finished" and st["step"] == 34, st

    events = api.events(cfg.run_uri)
    by = lambda t: [e for e in events if e["type"] == t]  # noqa: E731
    restores = by("restore")
    assert [e["workers"] for e in by("launch")] == [3, 2, 1, 1]

    # The notice: the step the group stopped at was committed within the grace period, and the next
    # round restored exactly that step, so no step was trained twice.
    [notice] = by("preemption_notice")
    assert notice["committed"] and 0 < notice["seconds"] < cfg.checkpoint.preemption_grace_s
    assert notice["step"] >= 5
    committed = {e["step"] for e in by("checkpoint") if e.get("committed")}
    assert notice["step"] in committed
    assert (restores[0]["step"], restores[0]["tier"]) == (notice["step"], "persistent")
    recovered = by("recovered")
    assert recovered[0]["kind"] == "notice" and recovered[0]["steps_lost"] == 0

    # The lost host: the survivor restored its own local copy, newer than the newest persistent one.
    failures = by("failure")
    assert "lost" in failures[0]["reason"]
    assert restores[1]["tier"] == "local" and 12 < restores[1]["step"] <= 17
    assert all(isinstance(e["checked_ahead"], bool) for e in restores if e["tier"] == "local"), restores
    assert restores[1]["step"] == failures[0]["resume_step"]
    # At most the steps since the newest local copy are trained again (not those since the persistent 12).
    assert recovered[1]["tier"] == "local" and 0 <= recovered[1]["steps_lost"] <= 17 - restores[1]["step"]

    # The damaged copy (this host's newest local copy): named and stepped over.  The round resumed from
    # the newest intact source: an older local copy newer than the newest persistent step committed by
    # then, or a committed persistent step.  Which one depends on how far the background saves got before
    # the fault (the save of persistent 24 may still have been in flight, and is made again after the
    # restore if so; local saves due while one is written are skipped).
    [skipped] = by("local_checkpoint_skipped")
    assert "truncated" in skipped["reason"]
    third = restores[2]
    committed_by_then = max(e["step"] for e in by("checkpoint") if e.get("committed") and e["time"] <= third["time"])
    assert third["step"] != skipped["step"] and third["step"] >= committed_by_then
    if third["tier"] == "local":
        assert third["step"] > committed_by_then
    else:
        assert third["step"] in api.committed_steps(cfg.run_uri)

    # Every step consumed exactly its global batch, whatever the tier it was resumed from; only the steps
    # after a restore point were trained again (none after the notice).
    ids = step_ids(cfg.run_uri)
    assert sorted(ids) == list(range(34))
    for step in (0, 5, 13, 20, 33):
        want = global_batch_ids(
            tiny_dataset, seed=cfg.optimizer.seed, global_batch=cfg.optimizer.global_batch, batch_index=step
        )
        assert ids[step] == sorted(int(i) for i in want)
    attempts = _attempts(cfg.run_uri)
    assert all(attempts[s] == 1 for s in range(notice["step"])), "a notice loses no step"

    # Each host kept at most local_keep copies, described in its rendezvous record; once the job
    # finished, its copies are gone from every host (a tmpfs would hold them in memory for good).
    survivor = restores[2]["host"]
    advertised = {s for s, _ in hosts(cfg.run_uri)[survivor].local}
    assert 1 <= len(advertised) <= cfg.checkpoint.local_keep, advertised
    assert not (local.base_dir(cfg.checkpoint.local_checkpoint_dir) / local.run_key(cfg.run_uri)).exists()
    json.dumps(events)  # every event is plain JSON
