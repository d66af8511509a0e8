"""A worker's task: built in the standby when that leaves JAX's backend alone, else once the round has joined.

Each check runs in a fresh process, as a standby is one: ``jax.distributed.initialize`` succeeds only
in a process whose backend nothing has started yet.
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

    task, coordinator = sys.argv[1:3]
    cfg = load_config("tiny", None, {"task": task})
    built = taskbuild.build_in_standby(cfg)  # as a standby does, before its assignment
    in_standby, started = built is not None, xla_bridge.backends_are_initialized()
    # The round joins (one process here), and the task is built now if the standby left it.
    jax.distributed.initialize(coordinator, 1, 0, cluster_detection_method="deactivate")
    if built is None:
        built = taskbuild.build(cfg)
    print(json.dumps({
        "in_standby": in_standby,
        "started_in_standby": started,
        "fingerprint": built.data.fingerprint,
        "first": built.data.train[0]["x"].tolist(),
    }))
    """
)


def standby(task: str) -> dict[str, object]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [sys.executable, "-c", STANDBY, task, f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def test_a_task_that_uses_jax_as_it_is_built_waits_for_the_join_and_then_builds_as_written() -> None:
    got = standby(JAX_TASK)
    # Its import, factory, constructor and data() all use JAX: nothing of it in the standby, all of it after.
    assert got["started_in_standby"] is False and got["in_standby"] is False, got
    assert str(got["fingerprint"]).startswith("linear-") and len(got["first"]) == 8, got  # type: ignore[arg-type]


def test_a_task_that_leaves_jax_alone_as_it_is_built_is_ready_in_the_standby() -> None:
    got = standby(EXAMPLE)
    assert got["in_standby"] is True and got["started_in_standby"] is False, got
    assert str(got["fingerprint"]).startswith("regression-"), got
