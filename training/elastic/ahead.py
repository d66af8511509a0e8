"""Compiling ahead: the step for each smaller mesh a round may shrink to, in the persistent cache before it is needed.

A recovery onto a mesh the run has not trained on before would compile the
step from scratch, the longest part of such a recovery.  The sizes a job can
shrink to are known (whole slices in ``min_workers`` up to the current size
that split the batch), and a round of ``k`` processes always has processes
``0..k-1`` with the same devices: so process 0 of a larger round lowers and
compiles the step on the devices of its first ``k`` processes (compiling runs
nothing on them) and JAX writes the executable to the persistent cache, under
the key the smaller round will look up.  It runs in one background thread
after the round's first steps; each size it finishes is reported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from training.config import Config
from training.mesh import build_mesh, feasible_sizes, plan_mesh

log = logging.getLogger(__name__)

NICE = 10  # the compiling thread's niceness: it takes the CPU the training leaves


def smaller_sizes(cfg: Config, workers: int) -> list[int]:
    """The sizes a round of ``workers`` hosts may shrink to, largest first (the likeliest next)."""
    return sorted((n for n in feasible_sizes(cfg) if n < workers), reverse=True)


def compile_smaller(cfg: Config, task: Any, workers: int, done: Callable[[int, float], None]) -> None:
    """Compile the step for each smaller size into the persistent cache; ``done(size, seconds)`` after each."""
    import jax

    from training.trainer import Trainer

    for n in smaller_sizes(cfg, workers):
        t0 = time.time()
        devices = [d for d in jax.devices() if d.process_index < n]
        Trainer(cfg, build_mesh(plan_mesh(cfg, n), devices), task).compile()
        done(n, time.time() - t0)


def start(cfg: Config, task: Any, workers: int, done: Callable[[int, float], None]) -> threading.Thread | None:
    """Compile ahead in a daemon thread (None when there is nothing smaller, or it is off)."""
    if not cfg.compile_ahead or not smaller_sizes(cfg, workers):
        return None

    def run() -> None:
        with contextlib.suppress(OSError):  # the training's threads come first (Linux: a thread's own niceness)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        try:
            compile_smaller(cfg, task, workers, done)
        except Exception as e:  # noqa: BLE001 - a recovery then compiles as it would have; training goes on
            log.warning("compiling ahead failed: %s: %s", type(e).__name__, e)

    thread = threading.Thread(target=run, name="rtrain-compile-ahead", daemon=True)
    thread.start()
    return thread
