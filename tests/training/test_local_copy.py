"""A local copy's data path: bytes written and summed by chunk in parallel, read back bit-exact onto any layout from
the file's mapping, a damaged or torn copy refused, and nothing left behind by a writer killed mid-write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from training.checkpoint import bulk, local, local_copy

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as p:
        yield p


def test_parts_are_written_end_to_end_and_summed_per_chunk_whatever_their_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(bulk, "PIECE", 5)  # pieces written one at a time, their sums carried on within a chunk
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 255, n, dtype=np.uint8) for n in (5, 0, 17, 64, 3, 40)]
    sums = bulk.write(tmp_path / "f", parts, chunk=16)
    data = (tmp_path / "f").read_bytes()
    assert data == b"".join(p.tobytes() for p in parts)
    assert sums.size == 129 and sums.chunk == 16
    assert list(sums.crcs) == [bulk.crc32c(data[i : i + 16]) for i in range(0, 129, 16)]
    assert bulk.Sums.from_json(json.loads(json.dumps(sums.to_json()))) == sums
    with pytest.raises(ValueError, match="do not describe"):
        bulk.Sums.from_json({**sums.to_json(), "crcs": list(sums.crcs)[:-1]})


def test_a_file_is_written_over_in_place_and_cut_to_its_new_size(tmp_path):
    path = tmp_path / "f"
    bulk.write(path, [np.ones(100, np.uint8)], chunk=16)
    inode = path.stat().st_ino
    sums = bulk.write(path, [np.full(40, 7, np.uint8)], chunk=16)
    assert path.stat().st_ino == inode, "the same file: its pages are reused"
    assert path.read_bytes() == bytes([7] * 40) and sums.size == 40


def test_the_first_chunk_that_differs_is_named(tmp_path, pool):
    path = tmp_path / "f"
    data = np.arange(100, dtype=np.uint8)
    sums = bulk.write(path, [data], chunk=16)
    assert bulk.first_bad_chunk(bulk.map_file(path), sums, pool) is None
    raw = bytearray(path.read_bytes())
    raw[50] ^= 1  # chunk 3
    path.write_bytes(bytes(raw))
    assert bulk.first_bad_chunk(bulk.map_file(path), sums, pool) == 3
    path.write_bytes(bytes(raw[:90]))
    assert bulk.first_bad_chunk(bulk.map_file(path), sums, pool) == 0, "a short file fails at once"


# Saves a state on 2 devices of 4 (fsdp), then restores it onto 4 devices in three layouts, and compares every array
# bit for bit; a copy with one byte flipped in its second chunk is refused by the tier's check.
ROUND_TRIP = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from training.checkpoint import bulk, lean, local, local_copy
bulk.CHUNK = 4096  # many chunks in a small copy
d = Path(sys.argv[1])
local_copy.PUT_IN_THREADS = sys.argv[2] == "threads"  # as an accelerator's parts go
two = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
rng = np.random.default_rng(1)
host = {"w": rng.standard_normal((64, 48)).astype(np.float32), "e": rng.standard_normal((34, 8)).astype(jnp.bfloat16),
        "n": np.arange(5, dtype=np.int32), "s": np.float32(3.5)}
specs = {"w": P("fsdp"), "e": P(), "n": P(), "s": P()}
state = {k: jax.device_put(v, NamedSharding(two, specs[k])) for k, v in host.items()}
local.write_step(state, d, 7, {"next_batch": 7}, 2, lean.plan(state, every_held_box=True))
local.describe_new(d, 1)
four = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "fsdp"))
out = {}
for name, layout in {"same": specs, "rows": {**specs, "w": P(("data", "fsdp"))},
                     "cols": {**specs, "w": P(None, "fsdp"), "e": P("data")}}.items():
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(four, layout[k])) for k, v in host.items()}
    tier = local.LocalTier(d, 2, four, abstract)
    assert tier.check(7) == "", tier.check(7)
    flight = tier.in_flight  # the parts started for their devices while the copy was summed
    got, pos = tier.restore(7)
    out[name] = all(np.asarray(got[k]).tobytes() == np.asarray(host[k]).tobytes() for k in host) and pos == {"next_batch": 7}
    out[name + "_sharding"] = str(got["w"].sharding.spec)
    out[name + "_sent_while_checked"] = flight is not None and flight[0] == 7 and tier.in_flight is None
    out[name + "_parts_used"] = flight is not None and any(
        p.unsafe_buffer_pointer() == s.data.unsafe_buffer_pointer()
        for p in flight[1].arrived() for s in got["w"].addressable_shards)
tier = local.LocalTier(d, 2, four, abstract)
assert tier.check(7) == ""
kept = tier.in_flight[1].arrived()
tier.forget_checked()  # the round restores from elsewhere: the checked copy's parts leave the devices
out["forgotten"] = tier.in_flight is None and not tier.checked and all(p.is_deleted() for p in kept)
shards = d / "7" / local_copy.SHARDS
raw = bytearray(shards.read_bytes()); raw[4096 + 10] ^= 0x20; shards.write_bytes(bytes(raw))
sent, send = [], local_copy.send
def spy(m, a):
    f = send(m, a)
    sent.append(f.arrived())
    return f
local_copy.send = spy
out["damaged"] = tier.check(7)
out["damaged_parts_dropped"] = tier.in_flight is None and len(sent) == 1 and all(p.is_deleted() for p in sent[0])
print(json.dumps(out))
"""


def _child(script: str, *args: str, devices: int = 4) -> subprocess.Popen[str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("puts", ["one call", "threads"])
def test_a_copy_restores_bit_exact_onto_any_layout_and_a_flipped_byte_is_refused(tmp_path, puts):
    proc = _child(ROUND_TRIP, str(tmp_path), puts.split()[-1])
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["same"] and got["rows"] and got["cols"], got
    assert got["rows_sharding"] == "P(('data', 'fsdp'),)" and got["cols_sharding"] == "P(None, 'fsdp')"
    assert got["damaged"] == "local step 7: file lean/0.bin fails its CRC32C check (chunk 1, from byte 4096)"
    # The parts go to their devices while the copy is summed, and are the restored state's; a copy that fails its
    # sums has its parts' device memory given back.
    assert all(got[f"{n}_sent_while_checked"] and got[f"{n}_parts_used"] for n in ("same", "rows", "cols")), got
    assert got["damaged_parts_dropped"] and got["forgotten"], got


# Writes step 2, then step 4 over the spare left by ... (keep 1: step 2's file becomes the spare at step 4), stalling
# inside step 4's write after its first chunk; the parent kills it there.
KILLED_MID_WRITE = """
import os, sys, time
from pathlib import Path
import jax.numpy as jnp
from training.checkpoint import bulk, lean, local, local_copy
bulk.CHUNK = 1 << 16
d = Path(sys.argv[1])
state = {"w": jnp.arange(1 << 18, dtype=jnp.float32)}
plan = lean.plan(state, every_held_box=True)
for step in (1, 2):
    local.write_step(state, d, step, {"next_batch": step}, 1, plan)
pwrite, calls = os.pwrite, []
def stalling(fd, data, offset):
    calls.append(offset)
    if len(calls) == 2:
        (d.parent / "mid-write").touch()
        time.sleep(600)
    return pwrite(fd, data, offset)
os.pwrite = stalling
local.write_step({"w": state["w"] + 1}, d, 3, {"next_batch": 3}, 1, plan)
"""


def test_a_writer_killed_mid_write_leaves_no_copy_and_nothing_behind_once_the_next_one_starts(tmp_path):
    import jax

    d = tmp_path / "host"
    d.mkdir()
    proc = _child(KILLED_MID_WRITE, str(d), devices=1)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "mid-write").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        torn = [p.name for p in d.iterdir() if ".tmp-" in p.name]
        assert len(torn) == 1 and (d / torn[0] / local_copy.SHARDS).exists(), sorted(p.name for p in d.iterdir())
        assert not (d / local.SPARE).exists(), "step 1's file, the spare, is being written over"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert local.finalised_steps(d) == [2], "the torn step is not a step"
    local.describe_new(d, 1)
    assert local.verify(d, 2) == ""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = {"w": jax.ShapeDtypeStruct((1 << 18,), np.float32, sharding=sharding)}
    tier = local.LocalTier(d, 1, mesh, abstract)  # the next worker on this host
    assert sorted(p.name for p in d.iterdir()) == ["2", "2.manifest.json"]
    got, pos = tier.restore(2)
    assert pos == {"next_batch": 2} and np.array_equal(np.asarray(got["w"]), np.arange(1 << 18, dtype=np.float32))
    tier.close()


def test_the_copy_a_worker_restored_from_is_never_written_over_while_its_state_may_hold_its_pages(tmp_path):
    """A CPU device takes the mapped copy's pages as its buffers: the tier deletes that copy's file, not reuses it."""
    import jax
    import jax.numpy as jnp

    from training.checkpoint import lean

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = {"w": jax.ShapeDtypeStruct((1 << 16,), jnp.float32, sharding=sharding)}
    saved = {s: {"w": jax.device_put(jnp.full((1 << 16,), float(s)), sharding)} for s in range(1, 7)}
    plan = lean.plan(saved[1], every_held_box=True)
    for s in (1, 2):
        local.write_step(saved[s], tmp_path, s, {"next_batch": s}, 2, plan)
    local.describe_new(tmp_path, 1)
    tier = local.LocalTier(tmp_path, 2, mesh, abstract)
    assert tier.check(2) == ""
    restored, _ = tier.restore(2)
    for s in (3, 4, 5, 6):  # each drops the oldest; dropped files are written over by later copies
        tier.writer(saved[s], tmp_path, s, {"next_batch": s}, 2)
    assert local.finalised_steps(tmp_path) == [5, 6]
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((1 << 16,), 2.0, np.float32))
    tier.close()


def test_a_cpu_device_takes_every_part_of_a_restored_copy_from_its_mapping_without_a_copy(tmp_path):
    """Each box starts 64-byte aligned in the file (a scalar before it included), so no part is copied on restore."""
    import jax
    import jax.numpy as jnp

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = {
        "a_step": jax.device_put(jnp.int32(3), sharding),
        "b": jax.device_put(jnp.ones((3, 5), jnp.bfloat16), sharding),
        "c": jax.device_put(jnp.arange(1000, dtype=jnp.float32), sharding),
    }
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    tier = local.LocalTier(tmp_path, 2, mesh, abstract)
    tier.writer(state, tmp_path, 1, {"next_batch": 1}, 2)
    local.describe_new(tmp_path, 1)
    offsets = [e["offset"] for e in json.loads((tmp_path / "1" / local_copy.INDEX).read_bytes())["entries"]]
    assert len(offsets) == 3 and all(o % 64 == 0 for o in offsets), offsets
    assert tier.check(1) == ""
    mapped = tier.checked[1].data
    lo, hi = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    got, _ = tier.restore(1)
    for k, x in got.items():
        assert lo <= x.addressable_data(0).unsafe_buffer_pointer() < hi, f"{k} was copied"
        np.testing.assert_array_equal(np.asarray(x), np.asarray(state[k]))
    tier.close()


# Saves one state through the local tier twice, once as a CPU device's copy and once fetched into host memory by
# threads (as an accelerator's is); each time the step that follows the save donates the state and changes it.
FETCHED = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from training.checkpoint import local, local_copy
root = Path(sys.argv[1])
mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
rng = np.random.default_rng(2)
host = {"w": rng.standard_normal((256, 64)).astype(np.float32), "e": rng.standard_normal((34, 8)).astype(jnp.bfloat16),
        "s": np.float32(1.5)}
specs = {"w": P("fsdp"), "e": P(), "s": P()}
shardings = {k: NamedSharding(mesh, specs[k]) for k in host}
abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in host.items()}
step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s), donate_argnums=0, out_shardings=shardings)
out = {}
for name, threads in (("device_copy", False), ("fetched", True)):
    local_copy.THREADED_TRANSFERS = threads
    d = root / name
    state = {k: jax.device_put(v, shardings[k]) for k, v in host.items()}
    tier = local.LocalTier(d, 1, mesh, abstract)
    tier.save(3, state, {"next_batch": 3})
    out[name + "_kind"] = type(tier.staged.copy).__name__
    state = step_fn(state)  # takes the saved buffers
    jax.block_until_ready(state)
    tier.release(3)
    tier.wait()
    tier.close()
    local.describe_new(d, 1)
    check = local.LocalTier(d, 1, mesh, abstract)
    out[name + "_check"] = check.check(3)
    got, _ = check.restore(3)
    out[name] = all(np.asarray(got[k]).tobytes() == np.asarray(host[k]).tobytes() for k in host)
out["same_file"] = (root / "device_copy/3" / local_copy.SHARDS).read_bytes() == (root / "fetched/3" / local_copy.SHARDS).read_bytes()
print(json.dumps(out))
"""


def test_a_copy_fetched_into_host_memory_by_threads_is_the_device_copy_byte_for_byte(tmp_path):
    proc = _child(FETCHED, str(tmp_path))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["device_copy_kind"] == "dict" and got["fetched_kind"] == "Fetched", got
    assert got["device_copy_check"] == got["fetched_check"] == "", got
    assert got["device_copy"] and got["fetched"] and got["same_file"], got
