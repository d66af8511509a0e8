"""One training process of the multi-controller program (one per host), started by its host agent.

The agent starts it ahead of need, as a standby that dies with its agent (``PR_SET_PDEATHSIG``), so
a recovery starts at ``jax.distributed`` and pays no imports or dataset checks.  Read top to bottom:
warm-up (imports, config, dataset; beside a training round, in a thread of the idle class:
:mod:`training.elastic.worker.warmup`); the assignment (one JSON line on stdin: round, rank, processes,
coordinator, resume, faults: :mod:`training.elastic.worker.link`); set-up (``jax.distributed``, the peer
watch, the round's mesh and shardings: :mod:`training.elastic.worker.join`); restore
(``training.checkpoint.resume``, its integrity check, Orbax's resharding restore:
:mod:`training.elastic.worker.restore`); compile (AOT, a persistent-cache hit on a mesh seen before, once
per round on one machine: :mod:`training.elastic.worker.programs`); train (saves and the
stop-at-checkpoint decision at checkpoint steps: :mod:`training.elastic.worker.train_loop`,
:mod:`training.elastic.worker.saves`).

Outcomes go to the agent as JSON lines over a pipe; the exit code says how it ended
(``training.elastic.codes.WorkerExit``).  On any error it reports the error line and leaves at once
with ``os._exit``, as it does (from the watch's thread, even inside a collective) when the peer
watch sees another process go: a clean ``jax.distributed`` shutdown would wait for the lost peer.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NoReturn

from training import procctl
from training.elastic.codes import WorkerExit
from training.elastic.wire import ReportType
from training.elastic.worker import link
from training.elastic.worker.join import set_up
from training.elastic.worker.link import Assignment, Reporter, die_with_parent, leave
from training.elastic.worker.programs import make_step
from training.elastic.worker.restore import restore
from training.elastic.worker.saves import Pins, Saver
from training.elastic.worker.train_loop import CPU_AT_ASSIGNMENT, FirstAhead, Notice, RoundLoop, train_batches
from training.elastic.worker.warmup import Warm, warm_up, warm_up_in_background

if TYPE_CHECKING:
    from training.checkpoint.ledger import Ledger
    from training.config import Config
    from training.elastic.worker.taskbuild import Built
    from training.storage import Store


def main() -> int:
    die_with_parent()
    Notice.install()  # from now on a SIGTERM is a preemption notice: stop at a step boundary, save, leave
    rep = Reporter()
    run = os.environ["RTRAIN_RUN_URI"]
    host, job = os.environ.get("RTRAIN_HOST", "?"), os.environ.get("RTRAIN_JOB", "?")
    procctl.set_title(procctl.job_title("standby", run, job, host), name="rtrain-worker")

    # --- 1. warm-up ----------------------------------------------------------------------------
    warm, warming = Warm(), None
    if os.environ.get("RTRAIN_WARM_BACKGROUND") == "1":
        warming = warm_up_in_background(run, warm)
    else:
        warm_up(run, warm)

    # --- 2. assignment -------------------------------------------------------------------------
    a = Assignment.read(sys.stdin)
    rep.rank, rep.round = a.rank, a.round
    procctl.set_title(procctl.job_title("worker", run, a.job or job, host, f"r{a.round}"))
    if warming is not None:
        warming.join()
    try:
        if warm.failure is not None:
            raise warm.failure
        assert warm.cfg is not None and warm.store is not None  # set by a warm-up that did not fail
        from training.checkpoint.ledger import Ledger

        return train(warm.cfg, run, warm.store, a, rep, warm.built, Ledger(warm.store))
    except BaseException as e:  # noqa: BLE001 - every error leaves the same way: reported, at once
        traceback.print_exc()  # the whole traceback, a task's own code's included, in this worker's log
        code, line = error_line(e)
        leave(rep, code, line)


def error_line(e: BaseException) -> tuple[WorkerExit, str]:
    """How a worker leaves on ``e``, and the one line it reports.

    An exception from the task's own code, at any stage (its import, its factory, ``init``, ``loss``,
    ``data()``...), ends the job at once (``TASK``): another round would run the same code again.
    """
    from training.data.errors import DatasetError
    from training.tasks import TaskError

    text = str(e).strip()
    if isinstance(e, TaskError):
        return WorkerExit.TASK, text
    first = text.splitlines()[0] if text else ""
    if isinstance(e, DatasetError):
        return WorkerExit.ERROR, f"dataset: {first}"
    return WorkerExit.ERROR, f"{type(e).__name__}: {first}"


def train(
    cfg: Config, run: str, store: Store, a: Assignment, rep: Reporter, built: Built | None, ledger: Ledger
) -> int:
    """One round of this process: set up, restore, compile, then train until done, a notice or a stop request.

    ``built``: the task and its data, as the standby built them (None: built in the set-up, once joined).
    """
    t_assigned, CPU_AT_ASSIGNMENT[0] = time.time(), time.process_time()
    trainer, mngr, built = set_up(cfg, run, a, rep, built, t_assigned)
    task, task_data = built.task, built.data
    pins = Pins(store, a.rank, a.round)
    with ThreadPoolExecutor(1, thread_name_prefix="rtrain-step") as pool:
        making = pool.submit(make_step, cfg, trainer, store, a)  # while the state is restored
        start = restore(cfg, run, a, rep, trainer, mngr, ledger, task_data.fingerprint, pins)
        # read while the step compiles
        batches = FirstAhead(train_batches(cfg.optimizer, a, task_data, start.next_batch))
        t0 = time.time()
        step = making.result()
    rep.send(
        ReportType.COMPILED,
        step=start.step,
        seconds=time.time() - t0,
        compile_s=round(step.seconds, 3),
        cache_hit=step.cache_hit,
        loaded=step.loaded,
    )
    saver = Saver(run, mngr, rep, pins, trainer.abstract, background=cfg.checkpoint.async_checkpoint)
    loop = RoundLoop(cfg, store, a, rep, trainer, saver, start, t_assigned, task, step)
    return loop.run(task_data, batches)


def run_main() -> NoReturn:
    """Run this worker and leave with its exit code (a process started as one, or forked to be one)."""
    code = main()
    sys.stdout.flush()
    link.outlast_peers()  # finished, or stopped at a checkpoint, as the whole group did
    os._exit(code)


if __name__ == "__main__":
    run_main()
