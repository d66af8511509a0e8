"""How a lean step's boxes are read back: straight into buffers a CPU device takes as its own, or pieced together.

The saved file is written here byte for byte as the format lays it out, so each way a wanted box
can sit in the saved ones is tried against numpy's own slicing of the whole array.
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

from training.checkpoint import lean


def _saved(tmp_path: Path, whole: np.ndarray, cuts: list[int]) -> tuple[lean._Blobs, list[lean.Saved]]:
    """``whole`` saved as boxes split along its first axis at ``cuts``, one after another in process 0's file."""
    (tmp_path / "lean").mkdir()
    bounds = [0, *cuts, whole.shape[0]]
    saved, blob = [], b""
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        box = ((lo, hi), *((0, n) for n in whole.shape[1:]))
        data = np.ascontiguousarray(whole[lo:hi]).tobytes()
        saved.append(lean.Saved(0, box, len(blob), len(data)))
        blob += data
    (tmp_path / "lean" / "0.bin").write_bytes(blob)
    return lean._Blobs(str(tmp_path), saved), saved


@pytest.mark.parametrize(
    "want",
    [
        ((0, 8), (0, 6)),  # a whole saved box: read straight in
        ((1, 3), (0, 6)),  # rows of one saved box: read straight in
        ((2, 7), (0, 6)),  # rows across two saved boxes: pieced together
        ((5, 8), (1, 4)),  # a block of columns: pieced together
        ((0, 16), (0, 6)),  # the whole array, from both boxes
    ],
)
@pytest.mark.parametrize("shared", [True, False])
def test_a_wanted_box_reads_back_as_numpy_slices_it(
    tmp_path: Path, want: tuple[tuple[int, int], ...], shared: bool
) -> None:
    whole = np.arange(16 * 6, dtype=np.float32).reshape(16, 6) * 1.5
    blobs, saved = _saved(tmp_path, whole, [8])
    try:
        got = lean.assemble("w", whole.dtype, saved, want, blobs=blobs, shared=shared)
    finally:
        blobs.close()
    np.testing.assert_array_equal(got, whole[tuple(slice(lo, hi) for lo, hi in want)])
    assert (got.ctypes.data % lean.ALIGN == 0) is shared


def test_a_box_the_saved_ones_do_not_cover_is_refused(tmp_path: Path) -> None:
    whole = np.ones((4, 3), np.int32)
    blobs, saved = _saved(tmp_path, whole, [2])
    try:
        with pytest.raises(ValueError, match="only part of w"):
            lean.assemble("w", whole.dtype, saved[:1], ((1, 4), (0, 3)), blobs=blobs, shared=True)
    finally:
        blobs.close()


def test_a_file_shorter_than_its_index_is_an_error_not_a_short_array(tmp_path: Path) -> None:
    whole = np.ones((4, 3), np.float32)
    blobs, saved = _saved(tmp_path, whole, [])
    os.truncate(tmp_path / "lean" / "0.bin", 20)
    try:
        with pytest.raises(ValueError, match="ends before the box"):
            lean.assemble("w", whole.dtype, saved, ((0, 4), (0, 3)), blobs=blobs, shared=True)
    finally:
        blobs.close()


@pytest.mark.parametrize("shape", [(3,), (1 << 19,), (0, 4), ()])
@pytest.mark.parametrize("shared", [True, False])
def test_a_shared_restore_buffer_becomes_the_devices_own_and_another_is_copied(
    shape: tuple[int, ...], shared: bool
) -> None:
    import jax

    buf = lean.empty(list(shape), np.float32, shared=shared)
    assert buf.shape == shape and buf.flags.writeable
    buf[...] = 2.0
    on = jax.device_put(buf, jax.devices("cpu")[0])
    if buf.size:  # an empty array has no data to share
        assert (on.unsafe_buffer_pointer() == buf.ctypes.data) is shared
    np.testing.assert_array_equal(np.asarray(on), np.full(shape, 2.0, np.float32))


REPLICAS = """
import json, sys
import numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from training.checkpoint import lean
step_dir = sys.argv[1]
x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
(__import__("pathlib").Path(step_dir) / "lean").mkdir(parents=True)
open(step_dir + "/lean/0.bin", "wb").write(x.tobytes() * 2)
json.dump({"entries": [{"path": f"['{k}']", "box": [[0, 64], [0, 8]], "offset": i * x.nbytes, "nbytes": x.nbytes}
                       for i, k in enumerate("wb")]}, open(step_dir + "/lean/0.json", "w"))
json.dump({"format": lean.FORMAT, "processes": 1, "data": {"next_batch": 5}, "config": {},
           "leaves": [{"path": f"['{k}']", "keys": [k], "shape": [64, 8], "dtype": "float32"} for k in "wb"]},
          open(step_dir + "/" + lean.META, "w"))
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "fsdp"))
specs = {"w": P("fsdp", None), "b": P()}  # split two ways and held twice; held by all four
abstract = {k: jax.ShapeDtypeStruct((64, 8), np.float32, sharding=NamedSharding(mesh, p)) for k, p in specs.items()}
state, pos = lean.restore(step_dir, abstract)
pointers = {k: [s.data.unsafe_buffer_pointer() for s in v.addressable_shards] for k, v in state.items()}
same = all(bool(np.array_equal(np.asarray(v), x)) for v in state.values())
step = jax.jit(lambda s: {k: v * 2 + 1 for k, v in s.items()}, donate_argnums=0)
after = step(state)
print(json.dumps({"same": same, "pos": pos,
                  "own_buffers": all(len(set(p)) == len(p) == 4 for p in pointers.values()),
                  "reused": all({s.data.unsafe_buffer_pointer() for s in after[k].addressable_shards} == set(p)
                                for k, p in pointers.items()),
                  "after": all(bool(np.array_equal(np.asarray(v), x * 2 + 1)) for v in after.values())}))
"""


def test_devices_holding_the_same_box_each_get_a_buffer_of_their_own(tmp_path: Path) -> None:
    """Each device copies its part into a buffer of its own, so a step that donates the state can reuse it."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(REPLICAS), str(tmp_path / "step")],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res == {"same": True, "pos": {"next_batch": 5}, "own_buffers": True, "reused": True, "after": True}, res
