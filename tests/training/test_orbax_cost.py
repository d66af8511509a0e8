"""The cheaper Orbax save writes what Orbax's own writes: the same ``_sharding`` record, metadata and arrays.

A process saves the tiny model's state twice through the run's manager, once as configured
(:mod:`training.checkpoint.orbax_cost`) and once with Orbax's stock array handler and no data file
size given; the two steps' files are compared, and a plain Orbax restore with no target reads the
arrays back with their shardings from the record.
"""

from __future__ import annotations

import pytest
from test_saves import _run

SCRIPT = """
import orbax.checkpoint as ocp
from absl import flags
from orbax.checkpoint import type_handlers
from orbax.checkpoint._src.multihost import multihost
from training.checkpoint.orbax_cost import FLAG
from training.layout import step_uri
from training.storage import open_store

run = cfg.run_uri
ours = ckpt.checkpoint_manager(cfg, run)
ckpt.OneWriteShardings = lambda **kw: type_handlers.ArrayHandler(enable_write_sharding_file=True, **kw)
stock = ckpt.checkpoint_manager(cfg, run)
given = ours.target_size
stock.target_size = None
snap = ckpt.HostSnapshot(abstract)(state)
for m, step in ((ours, 1), (stock, 2)):
    ckpt.save(m, step, snap, {"next_batch": 1}, cfg)  # the same data position: the same data item
    m.wait_until_finished()
files = [open_store(step_uri(run, step)) for step in (1, 2)]
# Data files and OCDBT manifests are named at random; the arrays in them are compared through Orbax.
names = [sorted(n for n in f.list() if "/d/" not in n and "commit_success" not in n) for f in files]
timed = ("_CHECKPOINT_METADATA", "integrity.json")
differ = [n for n in names[0] if n not in timed and not n.endswith(".ocdbt") and files[0].get(n) != files[1].get(n)]
plain, theirs = (ocp.PyTreeCheckpointer().restore(step_uri(run, s) + "/state") for s in (1, 2))  # shardings: the record
print(json.dumps({
    "names": names,
    "differ": differ,
    "record": len(json.loads(files[0].get("state/_sharding"))),
    "leaves": len(jax.tree.leaves(state)),
    "plain": same(host(state), host(plain)) and same(host(theirs), host(plain)) and all(
        a.sharding == b.sharding for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(plain))),
    "given": given,
    "flag": bool(flags.FLAGS[FLAG].present) and multihost.use_experimental_distributed_process_id() is False,
}))
"""


@pytest.mark.parametrize("where", ["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_a_save_writes_the_files_orbaxs_own_handler_writes(request, tmp_path, tiny_dataset, where: str) -> None:
    over: dict[str, object] = {"checkpoint_format": "auto"}
    if where == "gcs":
        over["root"] = request.getfixturevalue("gcs_root")
    res = _run(SCRIPT, tmp_path, tiny_dataset, over)
    assert res["names"][0] == res["names"][1] and "state/_sharding" in res["names"][0], res["names"]
    assert res["differ"] == [], "the sharding record and Orbax's metadata are the same bytes"
    assert res["record"] == res["leaves"], "every array's sharding is in the record"
    assert res["plain"], "a plain restore with no target gives each array its saved sharding"
    assert res["given"] == (400 << 20 if where == "gcs" else 1 << 31), "Orbax's own data file size for the root"
    assert res["flag"], "Orbax's flag is read as a value, not an exception"
