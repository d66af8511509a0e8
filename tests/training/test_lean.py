"""The lean checkpoint format, retired for new saves: steps older runs wrote in it still restore.

A step is written by two real processes through ``LeanManager``, as a run with ``checkpoint_format: lean``
wrote it, and read back through today's checkpoint manager on other meshes.  The save runs in two processes joined by JAX's coordination service (gloo collectives, 2 CPU
devices each), so its barriers and the split of the writing among replicas are the real ones.
The reads run in a fresh process of another device count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import free_port

SAVE = """
import json, os, sys
import numpy as np
import jax
from training.config import load_config
from training.mesh import build_mesh, plan_mesh
from training.tasks import load_task
from training.trainer import Trainer
from training.checkpoint import manager as ckpt
from jax.experimental import multihost_utils

root, dataset, coord, pid, out = sys.argv[1:6]
jax.distributed.initialize(coord, 2, int(pid))
from training.checkpoint import lean
cfg = load_config("tiny", None, {"root": root, "dataset": dataset, "run_name": "lean",
                                 "min_workers": 1, "max_workers": 2})
trainer = Trainer(cfg.optimizer, build_mesh(plan_mesh(cfg.placement, 2)), load_task(cfg))
state = trainer.init()
state = jax.tree.map(lambda x: x + 1 if x.dtype == np.float32 else x, state)  # not the init a reader makes
m = lean.LeanManager(cfg.run_uri, 2, int(pid), cfg.model_dump(mode="json"))  # as a run saving in lean did
snap = ckpt.HostSnapshot(trainer.abstract)(state)  # as the worker makes it
m.save(3, snap, {"next_batch": 7})
m.save(6, snap, {"next_batch": 14})
today = ckpt.checkpoint_manager(cfg, cfg.run_uri)
back, pos = ckpt.restore(today, 6, trainer.abstract)
gather = lambda tree: [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(tree)]
whole, again = gather(state), gather(back)

# Onto a mesh that splits the state across the two processes: each reads the boxes it needs, not every file.
fetched = []
class Spy(lean._Blobs):
    MERGE_GAP = 0  # this state is small: with the default gap, a process's needed ranges make one request
    def __init__(self, step_dir, needed):
        super().__init__(step_dir, needed)
        fetched.append(sum(s.nbytes for s in needed) if self.local
                       else sum(len(d) for r in self.ranges.values() for _, d in r))
lean._Blobs = Spy
split = cfg.model_copy(update={"dcn_data": 1, "dcn_fsdp": 2})
sharded = Trainer(split.optimizer, build_mesh(plan_mesh(split.placement, 2)), load_task(split))
moved, _ = ckpt.restore(today, 6, sharded.abstract)
across = gather(moved)

# A write that fails in one process (its file's name taken by a directory): neither waits for the other.
import time
if pid == "1" and not root.startswith("gs://"):
    os.makedirs(os.path.join(cfg.run_uri, "checkpoints", "9" + lean.TMP_SUFFIX, "lean", "1.bin"))
t = time.time()
try:
    m.save(9, snap, {"next_batch": 18})
    failed = ""
except Exception as e:
    failed = f"{type(e).__name__}: {e}"
took = time.time() - t
if pid == "0":
    np.savez(out, *whole)
print(json.dumps({"steps": m.all_steps(), "pos": pos, "fetched": fetched[-1], "failed": failed, "took": took,
                  "same": all(np.array_equal(a, b) for a, b in zip(whole, again)),
                  "across": all(np.array_equal(a, b) for a, b in zip(whole, across))}))
"""

READ = """
import json, sys
import numpy as np
import jax
from training.config import load_config
from training.mesh import build_mesh, plan_mesh
from training.tasks import load_task
from training.trainer import Trainer
from training.checkpoint import manager as ckpt

root, dataset, saved = sys.argv[1:4]
cfg = load_config("tiny", None, {"root": root, "dataset": dataset, "run_name": "lean",
                                 "devices_per_worker": jax.device_count()})
trainer = Trainer(cfg.optimizer, build_mesh(plan_mesh(cfg.placement, 1)), load_task(cfg))
m = ckpt.checkpoint_manager(cfg, cfg.run_uri)
want = list(np.load(saved).values())
state, pos = ckpt.restore(m, 6, trainer.abstract)
got = [np.asarray(x) for x in jax.tree.leaves(state)]
params = ckpt.load_params_host(cfg.run_uri, 6)
pw = [np.asarray(x) for x in jax.tree.leaves(jax.tree.map(lambda a: a, trainer.abstract["params"]))]
half = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
    a.shape, jax.numpy.bfloat16 if a.dtype == np.float32 else a.dtype, sharding=a.sharding), trainer.abstract)
cast, _ = ckpt.restore(m, 6, half)
try:
    ckpt.restore(m, 6, {k: v for k, v in trainer.abstract.items() if k != "rng"})
    mismatch = ""
except ValueError as e:
    mismatch = str(e)
print(json.dumps({
    "devices": len(trainer.mesh.devices.flat),
    "same": len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)),
    "sharded_as_asked": all(x.sharding == a.sharding for x, a in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.abstract))),
    "params": all(np.array_equal(np.asarray(a), np.asarray(b))
                  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state["params"]))),
    "cast": all(y.dtype == h.dtype and np.allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-2, atol=1e-2)
                for x, y, h in zip(got, jax.tree.leaves(cast), jax.tree.leaves(half))),
    "pos": pos,
    "mismatch": mismatch,
}))
"""


def _env(devices: int) -> dict[str, str]:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    }


def _read(root: str, dataset: str, saved: Path, devices: int) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(READ), root, dataset, str(saved)],
        capture_output=True,
        text=True,
        env=_env(devices),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "where", ["local", pytest.param("gcs", marks=[pytest.mark.gcs, pytest.mark.slow, pytest.mark.extended])]
)
def test_two_processes_save_a_lean_step_that_restores_onto_other_meshes(
    request: pytest.FixtureRequest, tmp_path: Path, tiny_dataset: str, where: str
) -> None:
    root = request.getfixturevalue("gcs_root") if where == "gcs" else str(tmp_path / "runs")
    coord = f"127.0.0.1:{free_port()}"
    saved = tmp_path / "saved.npz"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(SAVE), root, tiny_dataset, coord, str(pid), str(saved)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(2),
        )
        for pid in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    res, other = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert res["pos"] == {"next_batch": 14} and res["same"] and res["across"], res
    if where == "local":  # process 1's write of step 9 failed: no commit, both processes told, at once
        assert res["steps"] == other["steps"] == [3, 6], (res, other)
        assert other["failed"].startswith("IsADirectoryError"), other
        assert res["failed"] == "RuntimeError: process 1 did not write its part of checkpoint 9", res
        assert max(res["took"], other["took"]) < 30, (res, other)  # not a barrier's timeout
    else:
        assert res["steps"] == [3, 6, 9] and not res["failed"], res

    from training.checkpoint.steps import recorded_checksums, verify
    from training.config import load_config
    from training.layout import step_uri
    from training.storage import open_store

    run = load_config("tiny", None, {"root": root, "dataset": tiny_dataset, "run_name": "lean"}).run_uri
    files = recorded_checksums(run, 6) or {}
    # Both processes wrote: the replicas share the writing, each shard once.
    assert files["lean/0.bin"][0] > 0 and files["lean/1.bin"][0] > 0, files
    assert verify(run, 6, None) == ""
    # Split across the processes, a process read little more than its half of the saved bytes.
    saved_bytes = files["lean/0.bin"][0] + files["lean/1.bin"][0]
    assert 0 < res["fetched"] < 0.7 * saved_bytes, (res["fetched"], saved_bytes)
    for devices in (1, 4):  # other meshes: one device; four in one process, each array split four ways
        back = _read(root, tiny_dataset, saved, devices)
        assert back["devices"] == devices
        assert back["same"] and back["sharded_as_asked"] and back["params"] and back["cast"], back
        assert back["pos"] == {"next_batch": 14}
        assert "not in this run's state: ['rng']" in str(back["mismatch"]), back["mismatch"]

    # A flipped byte is found by the step's integrity record before anything is read.
    store = open_store(step_uri(run, 3))
    blob = bytearray(store.get("lean/1.bin"))
    blob[len(blob) // 2] ^= 0xFF
    store.put("lean/1.bin", bytes(blob))
    assert "lean/1.bin of checkpoint 3 fails its CRC32C check" in verify(run, 3, None)
