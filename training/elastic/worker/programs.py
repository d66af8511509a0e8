"""A round's programs: the step loaded as this job kept it, or compiled once in the round on one machine; a
new model's init; this process's persistent-cache hits.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from training.elastic.worker import ahead, compile_once
from training.elastic.worker.link import Assignment

if TYPE_CHECKING:
    from training.config import Config
    from training.sections import PlacementSection
    from training.storage import Store
    from training.trainer import Trainer

# This process's hits in JAX's persistent compilation cache, by the thread that compiled (JAX reports a hit
# in the thread that looked it up): the step, a new model's init and the steps compiled ahead run side by side.
CACHE_HITS: collections.Counter[int] = collections.Counter()


def count_cache_hits() -> None:
    """Count this process's persistent compilation cache hits in :data:`CACHE_HITS`."""
    from jax import monitoring

    def on_event(event: str, **_: str | int) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            CACHE_HITS[threading.get_ident()] += 1

    monitoring.register_event_listener(on_event)


def cache_hits() -> int:
    """The persistent cache hits of the calling thread's compiles."""
    return CACHE_HITS[threading.get_ident()]


def share_cpu_compilation_cache() -> None:
    """Let every process of a CPU slice find the program process 0 compiled.

    JAX keys its persistent compilation cache on, among others, the devices'
    topology fingerprint, and only process 0 writes entries.  On TPU the
    fingerprint is the slice's, the same in every process, so all of them hit
    process 0's entry.  On CPU each process's fingerprint describes its own
    devices, so every other process misses and compiles again after each
    restart, and the group's first step waits for the slowest compile.  Here the
    CPU key is made of the global device ids instead, as TPU's is in effect:
    the same SPMD program, the same key.  Nothing changes for other platforms.
    """
    from jax._src import cache_key

    original = cache_key._hash_accelerator_config

    def global_devices(hash_obj: Any, accelerators: Any) -> None:
        devices = list(accelerators.flat)
        if devices and all(d.platform == "cpu" for d in devices):
            hash_obj.update(repr(sorted((d.id, d.process_index) for d in devices)).encode())
        else:
            original(hash_obj, accelerators)

    cache_key._hash_accelerator_config = global_devices


@dataclass(frozen=True)
class StepMade:
    """How the round's step was made: loaded as this job kept it, or compiled (from the cache or not)."""

    loaded: bool
    cache_hit: bool
    seconds: float  # its own time, mostly hidden behind the restore it ran beside
    key: str | None  # its program's key (compile_once.program_key); None where this process did not lower it
    compiled: compile_once.Compiled | None  # as compiled here, to keep; None when loaded (kept, or passed on)


def make_step(cfg: Config, trainer: Trainer, store: Store, a: Assignment) -> StepMade:
    """Load the round's step as this job kept it (``compile_ahead``), else compile it (once in the round, on one
    machine: :mod:`training.elastic.worker.compile_once`); run beside the restore."""
    t0, hits = time.time(), cache_hits()
    kept = load_kept(store, a, trainer) if ahead.enabled(cfg.placement) else None
    loaded, key, compiled = kept is not None, kept.key if kept is not None else None, None
    if share_compiles(cfg.placement, a):
        if a.rank == 0:
            compile_once.forget_earlier_rounds(store, a.job, a.round)
        if a.rank == 0 or not loaded:
            shared = compile_shared(cfg, store, a, "step", None if loaded else trainer.lower)
            if shared.compiled is not None:
                trainer.load(shared.compiled)
            loaded, key, compiled = loaded or shared.passed, shared.key or key, shared.made
    elif not loaded:
        lowered = trainer.lower()
        key = compile_once.program_key(lowered)
        compiled = compile_once.compile_here(lowered, None, cache_hits)
        trainer.load(compiled.executable)
    return StepMade(loaded, loaded or cache_hits() > hits, time.time() - t0, key, compiled)


def share_compiles(placement: PlacementSection, a: Assignment) -> bool:
    """Whether the round's programs are compiled once, by process 0 (:mod:`training.elastic.worker.compile_once`)."""
    return compile_once.enabled(placement.backend, a.processes) and bool(a.job)


@dataclass(frozen=True)
class Shared:
    """A round's program compiled once (:func:`compile_shared`), as this process got it."""

    compiled: Any | None  # None: process 0 had the program already
    passed: bool  # loaded as process 0 compiled it
    key: str | None  # the program's key (compile_once.program_key, with its options); None where not known
    made: compile_once.Compiled | None = None  # process 0: as it compiled it


def compile_shared(
    cfg: Config,
    store: Store,
    a: Assignment,
    name: str,
    lower: Callable[[], Any] | None,
    options: compile_once.XlaOptions | None = None,
) -> Shared:
    """Program ``name`` of the round, compiled once (:mod:`training.elastic.worker.compile_once`) with the XLA ``options``.

    Process 0 lowers it (``lower``; None: it has the program already), announces its key, compiles it (or
    loads it from the persistent cache) and passes it on, serialized whole.  The others wait for it and load
    it, without lowering it at all; they lower and compile it themselves only when process 0 passes nothing on.
    """
    if a.rank == 0:
        if lower is None:
            compile_once.publish(store, a.job, a.round, name, None)
            return Shared(None, False, None)
        lowered = lower()
        key = compile_once.program_key(lowered, options)
        compile_once.announce(store, a.job, a.round, name, key)
        compiled = compile_once.compile_here(lowered, options, cache_hits)
        compile_once.publish(store, a.job, a.round, name, compiled.whole(cfg.placement.compilation_cache))
        return Shared(compiled.executable, False, key, compiled)
    assert lower is not None
    wait_s = cfg.elastic.hang_timeout_s / 2
    announced = compile_once.announced(store, a.job, a.round, name, wait_s)
    got = None if announced is None else compile_once.fetch(store, a.job, a.round, name, wait_s=wait_s)
    if got is None:
        print(f"round {a.round} process {a.rank}: {name} compiled here: process 0 passed none on", file=sys.stderr)
        lowered = lower()
        return Shared(lowered.compile(compiler_options=options), False, compile_once.program_key(lowered, options))
    print(
        f"round {a.round} process {a.rank}: {name} loaded as process 0 passed it on, not lowered here", file=sys.stderr
    )
    return Shared(got, True, announced)


def init_once(cfg: Config, trainer: Trainer, store: Store, a: Assignment) -> Any:
    """A new model's state: its initialisation compiled once in the round (:mod:`training.elastic.worker.compile_once`)."""
    if share_compiles(cfg.placement, a):
        shared = compile_shared(cfg, store, a, "init", trainer.lower_init, trainer.init_compiler_options())
        trainer.load_init(shared.compiled)
    state = trainer.init()
    load = getattr(trainer.task, "initial_params", None)
    if cfg.model.init_from and load is not None:  # the optimizer's new state does not depend on the values
        state = {**state, "params": load(trainer.abstract["params"])}
        print(f"round {a.round} process {a.rank}: parameters from {cfg.model.init_from}", file=sys.stderr)
    return state


def load_kept(store: Store, a: Assignment, trainer: Trainer) -> ahead.Kept | None:
    """Load the step this job kept for a round of this size (``ahead``), if any (None when none was loaded)."""
    try:
        kept = ahead.load(store, a.job, a.processes) if a.job else None
    except Exception as e:  # noqa: BLE001 - compiled as usual instead (a hit in the persistent cache)
        print(f"could not load the kept step for {a.processes} hosts: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    if kept is not None:
        trainer.load(kept.compiled)
    return kept
