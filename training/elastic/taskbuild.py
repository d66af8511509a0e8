"""A worker's task, built in its standby where that leaves JAX's backend untouched, else once the round has joined.

A standby builds the run's task and opens its data before it has a round, so a recovery does not wait
for them.  But ``jax.distributed.initialize`` must come before anything starts JAX's backend, and a
user's task may well start it: a ``jnp`` constant in its constructor, ``jax.devices()`` in its factory,
a jitted function in ``data()``.  So the standby builds the task with the backend fenced off: the first
call that would start it raises :class:`BackendFenced` instead.  A task that never reaches for the
backend (the built-in ones, most data pipelines) is ready when the round comes; one that does is
dropped, and built again, as written, once the round's processes have joined.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from training.config import Config


class BackendFenced(RuntimeError):
    """What starting JAX's backend raises while a standby builds its task (caught there: the task waits)."""


@dataclass
class Fence:
    """Whether anything tried to start the backend while it was fenced off."""

    touched: bool = False
    available: bool = True  # False: this JAX cannot be fenced; nothing is built before the round joins


@contextlib.contextmanager
def backend_fenced() -> Iterator[Fence]:
    """Within, in this process: a call that would start JAX's backend raises :class:`BackendFenced` (every
    path to a device, a compile or ``jax.devices()`` goes through ``xla_bridge.backends``)."""
    fence = Fence()
    try:
        from jax._src import xla_bridge

        original = xla_bridge.backends
    except (ImportError, AttributeError):
        fence.available = False
        yield fence
        return
    owner = threading.get_ident()

    def fenced() -> Any:
        if threading.get_ident() != owner or xla_bridge.backends_are_initialized():
            return original()
        fence.touched = True
        raise BackendFenced("JAX's backend is not started before the round's processes join")

    xla_bridge.backends = fenced
    try:
        yield fence
    finally:
        xla_bridge.backends = original


@dataclass(frozen=True)
class Built:
    """The run's task, its methods named in their errors (:func:`training.tasks.named`), and its opened data."""

    task: Any
    data: Any


def build(cfg: Config) -> Built:
    """Build the config's task and open its data (a :class:`training.tasks.TaskError` naming the task, the
    method and the error if its code raises)."""
    from training.tasks import load_task, named

    task = named(load_task(cfg), cfg)
    return Built(task, task.data())  # opened, and checked (a prepared dataset: against its manifest's sha256)


def build_in_standby(cfg: Config) -> Built | None:
    """:func:`build` with the backend fenced off; None when the task reached for it (build it after the join).

    Any other error of the task is raised as it is.
    """
    with backend_fenced() as fence:
        if not fence.available:
            return None
        try:
            built = build(cfg)
        except Exception:
            if fence.touched:
                return None
            raise
    return None if fence.touched else built  # a task that caught the fence's error may be half built
