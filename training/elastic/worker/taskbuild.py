"""A worker's task, built in its standby where that leaves JAX's backend untouched, else once the round has joined.

A standby builds the run's task and opens its data before it has a round, so a recovery does not wait
for them.  But ``jax.distributed.initialize`` must come before anything starts JAX's backend, and a
user's task may well start it: a ``jnp`` constant in its constructor, ``jax.devices()`` in its factory,
a jitted function in ``data()``, a prefetch thread that puts arrays on a device.  So a standby fences
the backend off in every one of its threads, from its warm-up until its round has joined
(:func:`lift_fence`): the first call that would start it raises :class:`BackendFenced` instead.  A task
that never reaches for the backend (the built-in ones, most data pipelines) is ready when the round
comes; one that does, while it is built or after, in any thread, is dropped, and built again, as
written, once the round's processes have joined.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from training.config import Config

if TYPE_CHECKING:
    from training.tasks import Task, TaskData


class BackendFenced(RuntimeError):
    """What starting JAX's backend raises while a standby waits for its round (the task is built after the join)."""


@dataclass
class Fence:
    """The backend fenced off in this process: whether it is, and how often anything tried to start it."""

    touched: int = 0  # calls that would have started the backend, in any thread
    available: bool = True  # False: this JAX cannot be fenced; nothing is built before the round joins
    lifted: bool = False


_lock = threading.Lock()
_up: list[tuple[Fence, Callable[[], None]]] = []  # this process's fence (at most one) and what lifts it


def fence_backend() -> Fence:
    """Fence JAX's backend off in every thread of this process until :func:`lift_fence` (or the process joins
    ``jax.distributed``): a call that would start it raises :class:`BackendFenced`.  Every path to a device,
    a compile or ``jax.devices()`` goes through ``xla_bridge.backends``.  Returns the fence already up, if any."""
    with _lock:
        if _up:
            return _up[0][0]
        fence = Fence()
        try:
            from jax._src import distributed, xla_bridge

            original = xla_bridge.backends
        except (ImportError, AttributeError):
            fence.available = False
            _up.append((fence, lambda: None))
            return fence

        def fenced() -> Any:
            joined = distributed.global_state.client is not None  # within initialize, once it has connected
            if fence.lifted or joined or xla_bridge.backends_are_initialized():
                return original()
            with _lock:
                fence.touched += 1
            raise BackendFenced("JAX's backend is not started before the round's processes join")

        def lift() -> None:
            fence.lifted = True
            if xla_bridge.backends is fenced:
                xla_bridge.backends = original

        xla_bridge.backends = fenced
        _up.append((fence, lift))
        return fence


def lift_fence() -> bool:
    """Let JAX's backend start again in this process (once the round has joined ``jax.distributed``, or has
    one process); True if anything tried to start it while it was fenced, or it could not be fenced: a task
    the standby built is then built again."""
    with _lock:
        if not _up:
            return False
        fence, lift = _up.pop()
        lift()
        return bool(fence.touched) or not fence.available


@dataclass(frozen=True)
class Built:
    """The run's task, its methods named in their errors (:func:`training.tasks.named`), and its opened data."""

    task: Task
    data: TaskData


def build(cfg: Config) -> Built:
    """Build the config's task and open its data (a :class:`training.tasks.TaskError` naming the task, the
    method and the error if its code raises)."""
    from training.tasks import load_task, named

    task = named(load_task(cfg), cfg.task)
    return Built(task, task.data())  # opened, and checked (a prepared dataset: against its manifest's sha256)


def build_in_standby(cfg: Config) -> Built | None:
    """:func:`build` with the backend fenced off (:func:`fence_backend`, left up until :func:`lift_fence`);
    None when the task reached for it as it was built (build it after the join).

    Any other error of the task is raised as it is.  A task that reaches for the backend later, from a
    thread of its own, is caught by :func:`lift_fence`.
    """
    fence = fence_backend()
    if not fence.available:
        return None
    before = fence.touched
    try:
        built = build(cfg)
    except Exception:
        if fence.touched > before:
            return None
        raise
    return None if fence.touched > before else built  # a task that caught the fence's error may be half built
