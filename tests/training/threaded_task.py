"""A user's task that reaches JAX's backend only from a thread of its own: the regression example's task,
whose ``data()`` also starts a prefetch thread that puts an array on a device.

Its factory, constructor and ``data()`` leave the backend alone; only the thread starts it, once the task's
``go`` is set (after ``data()`` has returned), or at once (``tests/training/test_task_build.py``).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np

from training.config import Config
from training.tasks import TaskData

PREFETCH = "threaded-task-prefetch"  # the thread's name
EXAMPLE = Path(__file__).resolve().parents[2] / "examples/regression/task.py"


def example_factory() -> Any:
    """The regression example's ``make_task``."""
    spec = importlib.util.spec_from_file_location("threaded_task_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module.make_task


class Prefetching:
    """The example's task; ``data()`` also starts a thread that puts a batch on a device."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.go = threading.Event()  # set: the prefetch thread goes on (the test's cue: after data() has returned)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def data(self) -> TaskData:
        data: TaskData = self.inner.data()

        def prefetch() -> None:
            self.go.wait()
            jax.device_put(np.zeros((4,), np.float32))  # starts JAX's backend, if nothing has yet

        threading.Thread(target=prefetch, name=PREFETCH, daemon=True).start()
        return data


def make_task(cfg: Config, task_args: dict[str, Any]) -> Prefetching:
    """``task_args``: the example's, and ``prefetch_at_once`` (true: the thread goes on at once, not on ``go``)."""
    args = dict(task_args)
    at_once = bool(args.pop("prefetch_at_once", False))
    task = Prefetching(example_factory()(cfg, args))
    if at_once:
        task.go.set()
    return task
