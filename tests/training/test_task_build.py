"""A worker's task: built in the standby when that leaves JAX's backend alone, else once the round has joined.

The check runs in a fresh process, as a standby is one: ``jax.distributed.initialize`` succeeds only in a
process whose backend nothing has started yet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
JAX_TASK = f"{REPO / 'tests/training/jax_task.py'}:make_task"
EXAMPLE = f"{REPO / 'examples/regression/task.py'}:make_task"

STANDBY = textwrap.dedent(
    """
    import json, sys
    import jax
    from jax._src import xla_bridge
    from training.config import load_config
    from training.elastic import taskbuild

    coordinator, dataset, tasks = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfgs = {t: load_config("tiny", None, {"task": t, "dataset": dataset}) for t in tasks}
    built = {t: taskbuild.build_in_standby(cfg) for t, cfg in cfgs.items()}  # as a standby does, unassigned
    out = {t: {"in_standby": b is not None} for t, b in built.items()}
    started = xla_bridge.backends_are_initialized()
    # The round joins (one process here), and a task the standby left is built now.
    jax.distributed.initialize(coordinator, 1, 0, cluster_detection_method="deactivate")
    for t, b in built.items():
        b = b or taskbuild.build(cfgs[t])
        out[t].update(fingerprint=b.data.fingerprint, fields=sorted(b.data.train[0]))
    print(json.dumps({"started_in_standby": started, "tasks": out}))
    """
)


def test_a_task_is_built_in_the_standby_unless_it_uses_jax_then_once_the_round_has_joined(tiny_dataset: str) -> None:
    r = subprocess.run(
        [sys.executable, "-c", STANDBY, f"127.0.0.1:{free_port()}", tiny_dataset, EXAMPLE, "lm", JAX_TASK],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]  # initialize refuses a process whose backend has started
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["started_in_standby"] is False, got
    tasks = got["tasks"]
    # The example and the built-in language model leave JAX alone as they are built: ready in the standby
    # (a recovery does not wait for them, nor for a dataset's checks).
    assert tasks[EXAMPLE]["in_standby"] and tasks[EXAMPLE]["fingerprint"].startswith("regression-"), tasks
    assert tasks["lm"]["in_standby"] and tasks["lm"]["fingerprint"], tasks
    # Its import, factory, constructor and data() all use JAX: nothing of it in the standby, all of it after.
    assert not tasks[JAX_TASK]["in_standby"], tasks
    assert tasks[JAX_TASK]["fingerprint"].startswith("linear-") and tasks[JAX_TASK]["fields"] == ["x", "y"], tasks
