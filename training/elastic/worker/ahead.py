"""Compiling ahead: the step for each smaller mesh a round may shrink to, in the persistent cache before it is needed.

A recovery onto a mesh the run has not trained on before would compile the
step from scratch, the longest part of such a recovery.  The sizes a job can
shrink to are known (whole slices in ``min_workers`` up to the current size
that split the batch), and a round of ``k`` processes always has processes
``0..k-1`` with the same devices: so process 0 of a larger round lowers and
compiles the step on the devices of its first ``k`` processes (compiling runs
nothing on them) and JAX writes the executable to the persistent cache, under
the key the smaller round will look up.  It runs in one background thread
once the round's first step was read; each size it finishes is reported.

Each step compiled here (the round's own too, from the cache or not) is also
kept whole on the run root (``compiled/<job>/step-<workers>.bin``,
:func:`compile_once.whole`): a later round of the job of that size loads it as
it is, without tracing, lowering or a cache lookup.  Only the job that wrote
them reads them (its code and config are the ones they were compiled from).

A size is compiled ahead once a job: skipped when this job keeps its step
already.  When the cache was noted to hold it for the same round program (the
round's own step, by its key: the same code, config and size, compiled by an
earlier job), it is still traced, lowered and looked up, once, in this thread,
and kept: a recovery onto that size then loads it, where it would otherwise
trace the step on its own path, beside the restore (a 1 GiB state's check and
restore took 0.15 s alone and 1.7 s beside the tracing, which the step waited
for too).  Such a size is reported as in the cache already.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from training.background import idle_this_thread
from training.config import Config
from training.elastic.worker import compile_once
from training.layout import COMPILED
from training.mesh import build_mesh, feasible_sizes, plan_mesh
from training.sections import PlacementSection
from training.storage import NotFound, Store

if TYPE_CHECKING:
    from training.tasks import Task

log = logging.getLogger(__name__)


def smaller_sizes(cfg: Config, workers: int) -> list[int]:
    """The sizes a round of ``workers`` hosts may shrink to, largest first (the likeliest next)."""
    return sorted((n for n in feasible_sizes(cfg) if n < workers), reverse=True)


def executable_key(job: str, workers: int) -> str:
    """Where a job's step compiled for ``workers`` hosts is kept on the run root."""
    return f"{COMPILED}{job}/step-{workers}.bin"


class Kept(NamedTuple):
    """A step this job kept, loaded: the executable and the key of the program it was compiled from."""

    compiled: Any
    key: str  # compile_once.program_key of its lowered program


def keep(store: Store, job: str, workers: int, program: compile_once.Serialized, key: str) -> None:
    """Keep a compiled step, serialized whole (of program ``key``), on the run root for the job's later rounds of
    ``workers`` hosts."""
    payload, in_tree, out_tree = program
    store.put(executable_key(job, workers), pickle.dumps((payload, in_tree, out_tree, key)))


def kept(store: Store, job: str, workers: int) -> bool:
    """Whether this job keeps a step for ``workers`` hosts."""
    return store.exists(executable_key(job, workers))


def load(store: Store, job: str, workers: int) -> Kept | None:
    """The step this job kept for ``workers`` hosts, loaded onto this process's devices (None when none is kept).

    The run root is trusted as the checkpoints are: a kept step is this job's own.
    """
    from jax.experimental import serialize_executable

    try:
        raw = store.get(executable_key(job, workers))
    except NotFound:
        return None
    payload, in_tree, out_tree, key = pickle.loads(raw)  # noqa: S301 - written by this job's process 0
    return Kept(serialize_executable.deserialize_and_load(payload, in_tree, out_tree), key)


def ahead_key(own_key: str, workers: int) -> str:
    """The note that the step for ``workers`` hosts, made from the round program ``own_key``, is in the cache."""
    return compile_once.derived_key(own_key, f"ahead:{workers}")


def forget_other_jobs(store: Store, job: str) -> None:
    """Delete the steps kept by the run's earlier jobs (their code or config may not be this job's)."""
    for key in store.list(COMPILED):
        if not key.startswith(f"{COMPILED}{job}/"):
            with contextlib.suppress(NotFound):
                store.delete(key)


class Ahead(NamedTuple):
    """What compiling ahead reports to and asks of the round (process 0's loop), from its thread."""

    done: Callable[[int, float, bool], None]  # (size, seconds, whether the cache held it already)
    keep: Callable[[int, compile_once.Serialized, str], None]  # keep a step: (size, it serialized, its program's key)
    have: Callable[[int], bool]  # whether the job keeps a step for this size already
    cache_hits: Callable[[], int]  # the process's count of persistent-cache hits


def compile_smaller(cfg: Config, task: Task, workers: int, own_key: str | None, to: Ahead) -> None:
    """Compile the step for each smaller size into the persistent cache (a lookup where it was noted there for this
    round program: ``own_key``, the round's own step's; None: not known) and keep it, unless the job keeps it."""
    import jax

    from training.trainer import Trainer

    for n in smaller_sizes(cfg, workers):
        t0 = time.time()
        note = ahead_key(own_key, n) if own_key else None
        if to.have(n):
            to.done(n, time.time() - t0, True)
            continue
        already = note is not None and compile_once.cached(cfg.placement.compilation_cache, note)
        devices = [d for d in jax.devices() if d.process_index < n]
        lowered = Trainer(cfg.optimizer, build_mesh(plan_mesh(cfg.placement, n), devices), task).lower()
        compiled = compile_once.compile_here(lowered, None, to.cache_hits)
        if note is not None:
            compile_once.note_cached(cfg.placement.compilation_cache, note)
        program = compiled.whole(cfg.placement.compilation_cache)
        if program is not None:  # kept before it is reported: a round of that size may start at once
            to.keep(n, program, compile_once.program_key(lowered))
        to.done(n, time.time() - t0, already)


# Off on TPU unless the config turns it on: loading an executable compiled in a runtime of more slices into
# one of fewer (the Multislice runtime's devices, libtpu's topology) has only ever run on CPU devices.
OFF_BY_DEFAULT_ON = frozenset({"tpu"})


def enabled(placement: PlacementSection, platform: str | None = None) -> bool:
    """Whether this job compiles ahead and loads kept steps: ``compile_ahead`` when set, else not on TPU.

    ``platform``: JAX's backend (``cpu``, ``tpu``, ...); by default this process's.
    """
    if placement.compile_ahead is not None:
        return placement.compile_ahead
    if platform is None:
        import jax

        platform = jax.default_backend()
    return platform not in OFF_BY_DEFAULT_ON


def start(
    cfg: Config, task: Task, workers: int, own: compile_once.Compiled | None, own_key: str | None, to: Ahead
) -> threading.Thread | None:
    """In a daemon thread (None when it is off): keep the round's own step (``own``, compiled for ``workers``;
    None when it was loaded as kept or passed on by process 0) whole, then compile ahead for each smaller size
    and keep those too (``own_key``: the key of the round's own step's program)."""
    if not enabled(cfg.placement):
        return None

    def run() -> None:
        idle_this_thread()  # the training's threads come first, and the collectives' transport threads too
        try:
            program = own.whole(cfg.placement.compilation_cache) if own is not None and own_key is not None else None
            if program is not None and own_key is not None:
                to.keep(workers, program, own_key)
            compile_smaller(cfg, task, workers, own_key, to)
        except Exception as e:  # noqa: BLE001 - a recovery then compiles as it would have; training goes on
            log.warning("compiling ahead failed: %s: %s", type(e).__name__, e)

    thread = threading.Thread(target=run, name="rtrain-compile-ahead", daemon=True)
    thread.start()
    return thread
