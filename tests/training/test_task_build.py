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

import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
JAX_TASK = f"{REPO / 'tests/training/jax_task.py'}:make_task"
EXAMPLE = f"{REPO / 'examples/regression/task.py'}:make_task"
THREADED_TASK = f"{REPO / 'tests/training/threaded_task.py'}:make_task"

STANDBY = textwrap.dedent(
    """
    import json, sys
    import jax
    from jax._src import xla_bridge
    from training.config import load_config
    from training.elastic.worker import taskbuild

    coordinator, dataset, tasks = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfgs = {t: load_config("tiny", None, {"task": t, "dataset": dataset}) for t in tasks}
    built = {t: taskbuild.build_in_standby(cfg) for t, cfg in cfgs.items()}  # as a standby does, unassigned
    out = {t: {"in_standby": b is not None} for t, b in built.items()}
    started = xla_bridge.backends_are_initialized()
    # The round joins (one process here), and a task the standby left is built now.
    jax.distributed.initialize(coordinator, 1, 0, cluster_detection_method="deactivate")
    taskbuild.lift_fence()
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


THREADED = textwrap.dedent(
    """
    import json, sys, threading
    import jax
    from jax._src import xla_bridge
    from training.config import load_config
    from training.elastic.worker import taskbuild
    from tests.training.threaded_task import PREFETCH

    coordinator, dataset, task = sys.argv[1:]
    cfg = load_config("tiny", None, {"task": task, "dataset": dataset})
    built = taskbuild.build_in_standby(cfg)  # as a standby does, unassigned
    in_standby = built is not None
    if built is not None:
        built.task.go.set()  # the task's own thread reaches for the backend, after its build has returned
    for t in threading.enumerate():
        if t.name == PREFETCH:
            t.join()
    started = xla_bridge.backends_are_initialized()
    # The round joins (one process here): the task the standby built is built again.
    jax.distributed.initialize(coordinator, 1, 0, cluster_detection_method="deactivate")
    again = taskbuild.lift_fence()
    b = taskbuild.build(cfg) if again or built is None else built
    b.task.go.set()
    for t in threading.enumerate():
        if t.name == PREFETCH:
            t.join()
    print(json.dumps({"in_standby": in_standby, "started_in_standby": started, "built_again": again,
                      "fingerprint": b.data.fingerprint, "devices": len(jax.devices())}))
    """
)


def test_a_task_whose_own_thread_reaches_for_jax_in_the_standby_is_built_again_once_the_round_has_joined(
    tiny_dataset: str,
) -> None:
    r = subprocess.run(
        [sys.executable, "-c", THREADED, f"127.0.0.1:{free_port()}", tiny_dataset, THREADED_TASK],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)},
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]  # initialize refuses a process whose backend has started
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # Its build leaves the backend alone; its prefetch thread, started by data(), is fenced off in the standby
    # as the building thread is, and the task is built again once the round has joined.
    assert got["in_standby"] and not got["started_in_standby"] and got["built_again"], got
    assert "BackendFenced" in r.stderr, r.stderr[-3000:]
    assert got["fingerprint"].startswith("regression-") and got["devices"] >= 1, got


@pytest.mark.slow
def test_a_job_whose_task_starts_a_thread_that_reaches_for_jax_trains(tmp_path: Path, jax_cache: str) -> None:
    """Each worker's standby builds the task; its prefetch thread is fenced off there, and the task is built
    again once the round has joined (on the standby's own build, the round's initialize would be refused)."""
    from jobs import job_config, run_job, worker_logs

    from training import api

    cfg = job_config(
        str(tmp_path),
        "",
        jax_cache,
        run_name="threaded-task",
        task=THREADED_TASK,
        task_args={"hidden": 16, "train_examples": 256, "validation_examples": 64, "prefetch_at_once": True},
        steps=4,
        checkpoint_every=4,
        min_workers=2,
        max_workers=2,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    st = api.status(cfg.run_uri)
    assert st is not None and st["state"] == "finished" and st["step"] == cfg.optimizer.steps, st
    logs = worker_logs(cfg.run_uri)
    assert "BackendFenced" in logs and logs.count("reached for JAX in the standby: built after the join") == 2, logs
