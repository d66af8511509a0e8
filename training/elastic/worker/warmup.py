"""A standby worker's warm-up: imports, the run's config, the compilation cache, the task and its data, made
ready before its assignment (beside a training round: in a thread of the idle class).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from training import procctl
from training.elastic.worker import compile_once
from training.elastic.worker.programs import count_cache_hits, share_cpu_compilation_cache

if TYPE_CHECKING:
    from training.config import Config
    from training.elastic.worker.taskbuild import Built
    from training.storage import Store


@dataclass
class Warm:
    """What a standby made ready before its assignment: the run's store and config, the task and its data."""

    store: Store | None = None
    cfg: Config | None = None
    built: Built | None = None  # the task and its data; None: built once the round has joined
    failure: BaseException | None = None  # the warm-up failed: raised once this worker has a round


def import_libraries() -> None:
    """Import what a round needs (JAX, Orbax, the trainer, the tasks), while nothing waits for this process.

    Imports only: no JAX backend, no threads, so a process that did this can still be forked
    (:mod:`training.elastic.worker.forkserver`)."""
    # Orbax's optional Cloud Logging logger is not used here: with its library marked absent, orbax leaves
    # it out (it guards that import), and each worker is spared 0.4 s of importing at its start.
    sys.modules.setdefault("google.cloud.logging", None)  # type: ignore[arg-type]  # None: "absent"
    import jax  # noqa: F401

    import training.checkpoint.manager
    import training.tasks.lm  # the built-in task (a user's task module is imported with the config)
    import training.trainer  # noqa: F401


def warm_up(run: str, warm: Warm) -> None:
    """Imports, the run's config, the compilation cache, the task and its (checked) data, into ``warm``.

    The task is built here only if that leaves JAX's backend untouched (:mod:`training.elastic.worker.taskbuild`):
    the backend is fenced off in every thread of this process until the round has joined.
    """
    import_libraries()
    import jax

    from training.config import config_from_json
    from training.elastic.worker.taskbuild import build_in_standby, fence_backend
    from training.layout import CONFIG
    from training.storage import expect_root, open_store

    fence_backend()  # in every thread of this process; lifted in set_up, once the round has joined
    expect_root(run)  # a run root that vanishes is not made anew by this worker's writes
    warm.store = open_store(run)
    cfg = warm.cfg = config_from_json(warm.store.get(CONFIG).decode())
    # The persistent compilation cache makes a relaunch on a mesh seen before skip XLA compilation.
    jax.config.update("jax_compilation_cache_dir", cfg.placement.compilation_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    share_cpu_compilation_cache()
    count_cache_hits()
    compile_once.watch_cache_hits()  # to serialize a program from the cache whole (compile_once.whole)
    # For the saves' reports: measured in the idle class, off the path to the round's first step (a save
    # that comes first measures it itself).
    threading.Thread(target=measure_copy_bandwidth, name="rtrain-bandwidth", daemon=True).start()
    try:
        warm.built = build_in_standby(cfg)
    except Exception as e:  # noqa: BLE001 - raised once this worker has a round, and reported then
        warm.failure = e


WARM_UP_THREAD = "rtrain-warm-up"  # the OS name of a standby's warm-up thread (as ``top -H`` shows it)


def name_this_thread(name: str) -> None:
    """Give the calling thread an OS name (Linux: up to 15 bytes); a no-op elsewhere."""
    with contextlib.suppress(OSError):
        procctl.prctl(procctl.PR_SET_NAME, name.encode()[:15])


def measure_copy_bandwidth() -> None:
    """This host's memory copy bandwidth (:func:`training.checkpoint.manager.copy_bandwidth`), in the idle class."""
    from training.background import idle_this_thread
    from training.checkpoint.manager import copy_bandwidth

    idle_this_thread()
    copy_bandwidth()


def warm_up_in_background(run: str, warm: Warm) -> threading.Thread:
    """:func:`warm_up` in a thread of the idle class: a standby started beside a training round.

    The round's first steps come first; the warm-up takes the CPU they leave.  Only
    this thread is lowered (and the threads it starts): the main thread, which runs
    the round once assigned, keeps its priority, which an unprivileged process
    could not raise again.  Numpy is imported first, here, so its BLAS threads are
    started at the main thread's priority.
    """
    import numpy  # noqa: F401

    from training.background import idle_this_thread

    def run_lowered() -> None:
        idle_this_thread()
        name_this_thread(WARM_UP_THREAD)
        try:
            warm_up(run, warm)
        except BaseException as e:  # noqa: BLE001 - raised once this worker has a round, and reported then
            warm.failure = e

    thread = threading.Thread(target=run_lowered, name="warm-up", daemon=True)
    thread.start()
    return thread
