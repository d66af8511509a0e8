"""Orbax's persistent format: a trained run's steps read by plain ``orbax.checkpoint``, by name, without this project.

A real job trains the tiny preset saving in the default format (OCDBT, on a local root and on gs://
against the GCS emulator); a fresh process with the project's packages blocked from import restores a
committed step's ``state`` item with Orbax alone, with no target (Orbax's own sharding record) and onto
a one-device mesh (resharded), and its named leaves equal what the project's own restore reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from jobs import job_config, run_job, worker_logs

from training import api
from training.checkpoint.steps import committed_steps
from training.layout import step_uri
from training.storage import open_store

# The project's own read of a step, flattened by each leaf's path in the state.
PROJECT = """
import sys
import jax, numpy as np
from training.checkpoint import manager as ckpt
run, step, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
state = ckpt.load_state_host(run, step)
np.savez(out, **{jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state)})
"""

# Plain Orbax: the project's packages cannot be imported here.
PLAIN = """
import json, sys
for name in ("training", "plugins", "dags", "benchmarks"):
    sys.modules[name] = None  # an import of the project's code fails
import jax, numpy as np
import orbax.checkpoint as ocp
from etils import epath
step_dir, out = epath.Path(sys.argv[1]), sys.argv[2]
meta = ocp.PyTreeCheckpointer().metadata(step_dir / "state")  # Orbax's own record of the tree
meta = getattr(meta, "item_metadata", meta)
meta = getattr(meta, "tree", meta)
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # the job's mesh had 2 devices
target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta)
tree = ocp.StandardCheckpointer().restore(step_dir / "state", target)  # resharded onto one device
as_numpy = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), meta)
moved = ocp.PyTreeCheckpointer().restore(step_dir / "state", restore_args=as_numpy)  # host arrays
flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}
np.savez(out, **flat)
print(json.dumps({
    "top": sorted(tree),
    "moved": all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(tree))
             and all(isinstance(x, np.ndarray) for x in jax.tree.leaves(moved))
             and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(moved))),
    "devices": jax.device_count(),
}))
"""


def _py(code: str, *args: str, devices: int, cwd: Path) -> str:
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
    }
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "gs"])
def test_a_trained_runs_step_restores_with_plain_orbax_by_name(
    request: pytest.FixtureRequest, tmp_path: Path, tiny_dataset: str, jax_cache: str, where: str
) -> None:
    """The default format, ``auto``, is OCDBT on either root (on gs:// it was plain zarr against the emulator)."""
    root = str(tmp_path / "runs") if where == "local" else request.getfixturevalue("gcs_root")
    cfg = job_config(
        root,
        tiny_dataset,
        jax_cache,
        run_name="orbax-named",
        steps=6,
        checkpoint_every=3,
        min_workers=1,
        max_workers=1,
    )
    assert cfg.checkpoint.checkpoint_format == "auto", "the default"
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    st = api.status(cfg.run_uri)
    assert st is not None and st["state"] == "finished"
    step = committed_steps(cfg.run_uri)[-1]
    assert step == 6
    step_dir = step_uri(cfg.run_uri, step)
    files = open_store(step_dir).list()
    assert not any(f.startswith("layout/") for f in files), "a step of Orbax's format has no packing layout"
    assert "state/manifest.ocdbt" in files, ("OCDBT", files[:10])

    ours, theirs = tmp_path / "ours.npz", tmp_path / "theirs.npz"
    _py(PROJECT, cfg.run_uri, str(step), str(ours), devices=2, cwd=Path(__file__).resolve().parents[2])
    res = json.loads(_py(PLAIN, step_dir, str(theirs), devices=1, cwd=tmp_path).strip().splitlines()[-1])
    assert res["top"] == ["opt_state", "params", "rng", "step"], res
    assert res["moved"] and res["devices"] == 1, res

    want, got = dict(np.load(ours)), dict(np.load(theirs))
    assert not any("pack_" in name for name in got), sorted(got)[:5]
    # The parameters have the same names and values as the project reads them.
    want_params = {k: v for k, v in want.items() if k.startswith("['params']")}
    got_params = {k: v for k, v in got.items() if k.startswith("['params']")}
    assert set(got_params) == set(want_params) and len(got_params) > 5, (
        sorted(got_params)[:5],
        sorted(want_params)[:5],
    )
    for name, value in want_params.items():
        np.testing.assert_array_equal(got_params[name], value, err_msg=name)
    # The optimizer's tree: Orbax gives its named tuples as dicts of the same names, in the same order.
    opt_want = [v for k, v in want.items() if k.startswith("['opt_state']")]
    opt_got = [v for k, v in got.items() if k.startswith("['opt_state']")]
    assert len(opt_got) == len(opt_want) > len(want_params)
    assert any("['mu']['" in k for k in got), "Adam's first moment is saved under its name"
    for a, b in zip(opt_got, opt_want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(got["['step']"]) == 6
    np.testing.assert_array_equal(got["['rng']"], want["['rng']"])
