"""Cheap saves: the host snapshot a background save writes, and the checkpoint format's options.

Each check runs real JAX (2 CPU devices) and real Orbax I/O in a fresh process, so the device
count is its own and nothing else in the session has imported JAX with other flags.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import cast

import pytest

SETUP = """
import json, os, sys
import numpy as np
import jax
from training.config import load_config
from training.mesh import build_mesh, plan_mesh
from training.tasks import load_task
from training.trainer import Trainer
from training.checkpoint import manager as ckpt, packing

root, dataset = sys.argv[1], sys.argv[2]
over = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
cfg = load_config("tiny", None, {"root": root, "dataset": dataset, "run_name": "saves", **over})
trainer = Trainer(cfg.optimizer, build_mesh(plan_mesh(cfg.placement, 1)), load_task(cfg))
state = trainer.init()
abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
"""


def _run(script: str, tmp_path: Path, dataset: str, over: dict[str, object] | None = None) -> dict[str, object]:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    code = SETUP + textwrap.dedent(script)
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "runs"), dataset, json.dumps(over or {})],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_background_save_writes_the_state_of_its_step_while_donating_steps_go_on(tmp_path, tiny_dataset):
    """The snapshot is the state at the save, though the next steps donate (reuse) its buffers."""
    res = _run(
        """
        from training import data

        batches = data.make_batches(cfg.dataset, "train", seed=0, global_batch=cfg.global_batch,
                                    process_index=0, process_count=1)
        before = host(state)
        run = os.path.join(sys.argv[1], "saves")
        mngr = ckpt.checkpoint_manager(cfg, run)
        given = []

        import threading

        def niceness():  # the calling thread's scheduling class
            return "idle" if os.sched_getscheduler(threading.get_native_id()) == os.SCHED_IDLE else "normal"

        nice = {"loop": niceness()}

        def save(snap, step):
            given.append(snap)
            nice["save"] = niceness()
            started = threading.Thread(target=lambda: nice.update(started=niceness()))  # as Orbax's threads
            started.start()
            started.join()
            ckpt.save(mngr, step, snap, {"next_batch": step}, cfg)

        bg = ckpt.BackgroundSave(abstract, "test-save", gather_small=True)
        bg.thread.submit(lambda: None).result()  # the thread's queue is in order: anything queued ahead ran
        compiled_at_start = bg.snapshot.fn is not None  # not on a round's busy start: after its first steps
        bg.start(save, state, 1)  # a save before prepare_ahead compiles the copy itself
        ahead = ckpt.BackgroundSave(abstract, "test-ahead")
        ahead.prepare_ahead()
        ahead.prepare_ahead()
        ahead.thread.submit(lambda: None).result()  # the thread's queue is in order: the compile is done
        ahead.close()
        for _ in range(3):  # each step donates the state it is given
            state, _ = trainer.step(state, trainer.global_batch(next(batches)), 1.0)
        jax.block_until_ready(state)
        handed_over, took = bg.collect()
        snap = given[0]
        kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(snap)})
        mngr.wait_until_finished()

        def fail(snap):
            raise OSError("disk gone")

        errors = []
        for background in (True, False):
            failing = ckpt.BackgroundSave(abstract, "test-fail", background=background)
            failing.start(fail, state)
            try:
                failing.collect()
            except OSError as e:
                errors.append(str(e))
            failing.close()
        inline = ckpt.BackgroundSave(abstract, "test-inline", background=False)
        inline.start(lambda s: given.append(s), state)
        bg.close()
        restored, position = ckpt.restore(mngr, 1, abstract)
        print(json.dumps({
            "kinds": kinds,
            "snapshot_is_the_saved_step": same(host(snap), before),
            "restored_is_the_saved_step": same(host(restored), before),
            "training_moved_on": not same(host(state), before),
            "position": position,
            "collected": [handed_over, took is not None and took > 0, bg.collect()],
            "errors": errors,
            "inline_saves_the_state_itself": given[-1] is state,
            "local_bytes": ckpt.local_bytes(state),
            "shard_bytes": sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards),
            # A small array's copy is whole on every device (the save packs it); a large one keeps its sharding.
            "snapshot_shardings": [
                (x.nbytes <= packing.PACK_MAX_BYTES and y.sharding.is_fully_replicated)
                or (x.nbytes > packing.PACK_MAX_BYTES and y.sharding.spec == x.sharding.spec)
                for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(snap))
            ],
            "small_sharded": sum(x.nbytes <= packing.PACK_MAX_BYTES and not x.sharding.is_fully_replicated
                                 for x in jax.tree.leaves(state)),
            "bandwidth": ckpt.copy_bandwidth(8 << 20),
            "nice": nice,
            "nice_after": niceness(),
            "compiled": [compiled_at_start, ahead.snapshot.fn is not None],
        }))
        """,
        tmp_path,
        tiny_dataset,
    )
    # A CPU device's memory is host RAM: the copy is a device copy there (an accelerator's goes to pinned_host);
    # it is the saved step though the steps after it donated the state (below).
    assert res["kinds"] == ["device"], "on CPU devices the copy is a copy on the device"
    assert res["snapshot_is_the_saved_step"] and res["restored_is_the_saved_step"]
    assert res["training_moved_on"], "the steps after the save must have changed the state"
    assert res["position"] == {"next_batch": 1}
    assert res["collected"] == [True, True, [True, None]], "collected once, with the thread's time"
    assert res["errors"] == ["disk gone", "disk gone"], "a failed save raises on collect, in a thread or not"
    assert res["inline_saves_the_state_itself"], "without a thread there is no copy to make"
    assert res["compiled"] == [False, True], "the copy is compiled when asked ahead, or at the first save"
    assert res["local_bytes"] == res["shard_bytes"] and int(str(res["local_bytes"])) > 0
    assert all(res["snapshot_shardings"]) and int(str(res["small_sharded"])) > 0
    assert float(str(res["bandwidth"])) > 1e8  # bytes/s: any machine copies memory faster than 100 MB/s
    # The save thread, and the threads it starts, run only on cores nothing else wants (Linux's idle class);
    # the loop keeps its own class.
    assert res["nice"] == {"loop": "normal", "save": "idle", "started": "idle"}, res["nice"]
    assert res["nice_after"] == "normal"


def test_checkpoints_are_uncompressed_by_default_and_older_compressed_ones_still_restore(tmp_path, tiny_dataset):
    """zstd off by default; a checkpoint written compressed (or by Orbax's standard handler) restores."""
    res = _run(
        """
        import glob
        import orbax.checkpoint as ocp

        def codecs(run):
            # The compressors named in the arrays' zarr metadata (zarr v2 .zarray or v3 zarr.json).
            found = set()
            for p in glob.glob(os.path.join(run, "**", ".zarray"), recursive=True):
                found.add((json.load(open(p)).get("compressor") or {}).get("id", "none"))
            for p in glob.glob(os.path.join(run, "**", "zarr.json"), recursive=True):
                for c in json.load(open(p)).get("codecs", []):
                    found |= {x["name"] for x in [c, *c.get("configuration", {}).get("codecs", [])]}
            return sorted(found)

        runs = sys.argv[1]
        want = host(state)
        out = {}
        for name, compress in (("plain", False), ("zstd", True)):
            c = cfg.model_copy(update={"checkpoint_compression": compress})
            m = ckpt.checkpoint_manager(c, os.path.join(runs, name))
            ckpt.save(m, 1, state, {"next_batch": 1}, c)
            m.wait_until_finished()
            out[name] = codecs(os.path.join(runs, name))
        # Read both with the default config (compression off), as a resumed run would.
        for name in ("plain", "zstd"):
            m = ckpt.checkpoint_manager(cfg, os.path.join(runs, name))
            out[name + "_restores"] = same(host(ckpt.restore(m, 1, abstract)[0]), want)
        # A checkpoint of an earlier version: Orbax's StandardCheckpointHandler, compressed.
        old = ocp.CheckpointManager(
            os.path.join(runs, "old", "checkpoints"),
            item_handlers={"state": ocp.StandardCheckpointHandler(use_ocdbt=False), "data": ocp.JsonCheckpointHandler()},
        )
        old.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"next_batch": 1})))
        old.wait_until_finished()
        m = ckpt.checkpoint_manager(cfg, os.path.join(runs, "old"))
        out["old_restores"] = same(host(ckpt.restore(m, 1, abstract)[0]), want)
        print(json.dumps(out))
        """,
        tmp_path,
        tiny_dataset,
        {"checkpoint_format": "zarr"},  # per-array zarr.json files say which codecs were used
    )
    plain, zstd = res["plain"], res["zstd"]
    assert isinstance(plain, list) and isinstance(zstd, list), res
    assert plain == ["none"] or (plain and "zstd" not in plain), res
    assert "zstd" in zstd, res
    assert res["plain_restores"] and res["zstd_restores"] and res["old_restores"], res


LISTER = """
import sys, time
from pathlib import Path
from etils import epath

root = epath.Path(sys.argv[1])
if sys.argv[3] == "worker":
    import training.checkpoint.manager  # what every worker imports before Orbax lists a gs:// root
    look = lambda: sorted(p.name for p in root.iterdir())
else:  # the Airflow side: a listing made before, then the committed steps
    from training.checkpoint.steps import committed_steps
    sorted(p.name for p in root.iterdir())
    look = lambda: [str(s) for s in committed_steps(sys.argv[1].rsplit("/checkpoints", 1)[0])]
print(look(), flush=True)
while not Path(sys.argv[2]).exists():
    time.sleep(0.05)
print(look(), flush=True)
"""


@pytest.mark.gcs
@pytest.mark.parametrize("who", ["worker", "reader"])
def test_a_process_sees_the_steps_another_host_committed_on_gs(gcs_root: str, tmp_path: Path, who: str) -> None:
    """Orbax lists gs:// through gcsfs, whose listings would otherwise stay as first seen in each process."""
    from training.storage import open_store

    store = open_store(f"{gcs_root}/checkpoints")
    store.put("4/commit_success.txt", b"ok")
    go = tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTER, f"{gcs_root}/checkpoints", str(go), who], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "['4']"
    store.put("8/commit_success.txt", b"ok")  # another host's commit
    go.touch()
    assert proc.stdout.readline().strip() == "['4', '8']"
    assert proc.wait(timeout=60) == 0


def test_a_step_carries_the_integrity_record_of_what_was_written_before_it_committed(tmp_path, tiny_dataset):
    """The record is written into the step by its commit: damage right after it is found."""
    res = _run(
        """
        from training.checkpoint.steps import INTEGRITY, UNRECORDED, file_checksums, recorded_checksums, verify

        run = os.path.join(sys.argv[1], "integrity")
        m = ckpt.checkpoint_manager(cfg, run)
        ckpt.save(m, 4, state, {"next_batch": 4}, cfg)
        m.wait_until_finished()
        record = recorded_checksums(run, 4)
        now = {k: v for k, v in file_checksums(run, 4).items() if k not in UNRECORDED}
        import glob
        from training.checkpoint.lifecycle import _data_position

        out = {"same": record == now, "files": len(record or {}), "clean": verify(run, 4, None)}
        out["records"] = sorted(os.path.relpath(p, run) for p in glob.glob(f"{run}/**/{INTEGRITY}", recursive=True))
        out["position"] = _data_position(run, 4)
        big = max(now, key=lambda k: now[k][0])
        path = os.path.join(run, "checkpoints", "4", big)
        raw = bytearray(open(path, "rb").read())
        raw[len(raw) // 2] ^= 1
        open(path, "wb").write(bytes(raw))
        out["damaged"] = verify(run, 4, None)
        out["big"] = big
        print(json.dumps(out))
        """,
        tmp_path,
        tiny_dataset,
    )
    assert res["same"] and int(str(res["files"])) >= 3 and res["clean"] == "", res
    assert res["records"] == ["checkpoints/4/integrity.json"] and res["position"] == {"next_batch": 4}, res
    assert (
        res["damaged"] == f"file {res['big']} of checkpoint 4 fails its CRC32C check (changed since it was committed)"
    )


def test_a_local_copy_restores_onto_another_mesh_and_a_failed_write_turns_the_tier_off(tmp_path, tiny_dataset):
    """The local tier's own format: a copy written on 2 devices reads back bit for bit on 2 and on 1.

    A write that the OS refuses (a file-size limit standing in for a full tmpfs) turns the tier off
    with the OS's reason and leaves no half-written copy; training is not stopped by it.
    """
    res = _run(
        """
        import resource, signal
        from pathlib import Path
        from training.checkpoint import local

        d = Path(sys.argv[1]) / "local"
        tier = local.LocalTier(d, 2, trainer.mesh, abstract)
        for step in (2, 4, 6):
            assert tier.save(step, state, {"next_batch": step}) is not None
            tier.release(step)  # the guard passed it
            tier.wait()
            saved = tier.finished()
        kept = local.finalised_steps(d)
        back, pos = tier.restore(6)
        same_mesh = same(host(state), host(back)) and all(
            a.sharding == b.sharding for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)))
        one = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), trainer.mesh.axis_names)
        single = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                sharding=jax.sharding.NamedSharding(one, a.sharding.spec)), abstract)
        other, _ = local.read_step(d, 6, single)
        on_one = same(host(state), host(other)) and all(
            len(x.sharding.device_set) == 1 for x in jax.tree.leaves(other))

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        tier.save(8, state, {"next_batch": 8})
        tier.release(8)
        tier.wait()
        after_failure = tier.save(10, state, {"next_batch": 10})
        print(json.dumps({
            "kept": kept, "pos": pos, "same_mesh": same_mesh, "on_one": on_one,
            "saved": [s for s, _ in saved],
            "enabled": tier.enabled, "failure": tier.failure, "after_failure": after_failure,
            "off_for_mesh": tier.off_for_mesh,
            "left": sorted(p.name for p in d.iterdir()),
        }))
        """,
        tmp_path,
        tiny_dataset,
    )
    assert res["kept"] == [4, 6]  # local_keep=2
    assert res["pos"] == {"next_batch": 6}
    assert res["same_mesh"] and res["on_one"]
    assert res["saved"] == [6]
    assert res["enabled"] is False and "a local save failed" in str(res["failure"])
    assert "File too large" in str(res["failure"])
    assert res["after_failure"] is None and res["off_for_mesh"] is False  # no write after; the loop's schedule holds
    assert res["left"] == ["4", "6"]  # the cut-off copy of step 8 is gone


@pytest.mark.parametrize("where", ["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_an_orbax_step_holds_the_named_tree_restores_onto_another_mesh_and_a_packed_one_still_restores(
    request: pytest.FixtureRequest, tmp_path: Path, tiny_dataset: str, where: str
) -> None:
    """Orbax's format saves the state's own tree, read back on any mesh or one device; earlier packed steps restore."""
    over: dict[str, object] = {"checkpoint_format": "auto"}
    if where == "gcs":
        over["root"] = request.getfixturevalue("gcs_root")
    res = _run(
        """
        import orbax.checkpoint as ocp
        from training.layout import step_uri

        run = cfg.run_uri
        m = ckpt.checkpoint_manager(cfg, run)
        snap = ckpt.HostSnapshot(abstract, gather_small=ckpt.packs_small(m))(state)  # as the worker makes it
        ckpt.save(m, 1, snap, {"next_batch": 1}, cfg)
        m.wait_until_finished()
        items = sorted(m.item_metadata(1))
        # A step of an earlier version: small arrays packed, with its layout.
        tree, layout = packing.pack(ckpt.HostSnapshot(abstract, gather_small=True)(state))
        m.save(2, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree), data=ocp.args.JsonSave({"next_batch": 2}),
                                          config=ocp.args.JsonSave(cfg.model_dump()),
                                          layout=ocp.args.JsonSave(layout.to_json())), force=True)
        m.wait_until_finished()
        one = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), trainer.mesh.axis_names)
        single = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                sharding=jax.sharding.NamedSharding(one, a.sharding.spec)), abstract)
        out = {"items": items}
        for step in (1, 2):
            back, pos = ckpt.restore(m, step, abstract)
            moved, _ = ckpt.restore(m, step, single)
            try:
                ckpt.restore(m, step, {k: v for k, v in abstract.items() if k != "rng"})
                mismatch = ""
            except ValueError as e:
                mismatch = str(e)
            half = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
                a.shape, jax.numpy.bfloat16 if a.dtype == np.float32 else a.dtype, sharding=a.sharding), abstract)
            cast, _ = ckpt.restore(m, step, half)
            out[str(step)] = {
                "same": same(host(state), host(back)) and all(
                    a.sharding == b.sharding for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back))),
                "moved": same(host(state), host(moved)) and all(
                    len(x.sharding.device_set) == 1 for x in jax.tree.leaves(moved)),
                "whole": same(host(state), host(ckpt.load_state_host(run, step))),
                "params": same(host(state["params"]), host(ckpt.load_params_host(run, step))),
                "pos": pos,
                "mismatch": mismatch,
                "cast": all(y.dtype == b.dtype and np.allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                                               rtol=1e-2, atol=1e-2)
                            for x, y, b in zip(jax.tree.leaves(state), jax.tree.leaves(cast), jax.tree.leaves(half))),
            }
        print(json.dumps(out))
        """,
        tmp_path,
        tiny_dataset,
        over,
    )
    assert res["items"] == ["config", "data", "state"], "no packing layout: the state's own tree"
    for step in ("1", "2"):
        got = cast(dict[str, object], res[step])
        assert got["same"] and got["moved"] and got["whole"] and got["params"], (step, got)
        assert got["pos"] == {"next_batch": int(step)}
        assert "not in this run's state: ['rng']" in str(got["mismatch"]), (step, got["mismatch"])
        assert got["cast"], "a state of another float dtype gets the saved values cast to it"


def test_a_step_an_older_run_saved_in_lean_restores_and_an_incomplete_one_is_named(tmp_path, tiny_dataset):
    """Lean is retired as a format to save in; a step an older run saved in it restores through today's manager."""
    res = _run(
        """
        import shutil
        from training.checkpoint import lean
        from training.checkpoint.steps import committed_steps
        from training.layout import step_uri

        run = cfg.run_uri
        older = lean.LeanManager(run, jax.process_count(), jax.process_index(), cfg.model_dump(mode="json"))
        older.save(2, state, {"next_batch": 2})  # as a run with checkpoint_format: lean saved it
        m = ckpt.checkpoint_manager(cfg, run)
        back, pos = ckpt.restore(m, 2, abstract)
        ckpt.save(m, 4, state, {"next_batch": 4}, cfg)
        ckpt.wait_saved(m)
        shutil.copytree(step_uri(run, 2), step_uri(run, 6))
        os.remove(os.path.join(step_uri(run, 6), "lean.json"))
        try:
            ckpt.restore(m, 6, abstract)
            incomplete = ""
        except ValueError as e:
            incomplete = str(e)
        print(json.dumps({"manager": type(m).__name__, "lean": [lean.is_lean(step_uri(run, s)) for s in (2, 4)],
                          "same": same(host(state), host(back)), "pos": pos, "steps": committed_steps(run),
                          "incomplete": incomplete}))
        """,
        tmp_path,
        tiny_dataset,
    )
    assert res["manager"] == "FailFastManager" and res["lean"] == [True, False], res  # today's saves are Orbax's
    assert res["same"] and res["pos"] == {"next_batch": 2}, res
    assert res["steps"] == [2, 4, 6], res
    assert res["incomplete"] == "checkpoint 6 has neither lean.json nor Orbax's metadata: it is incomplete", res
