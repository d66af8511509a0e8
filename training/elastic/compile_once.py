"""One compile per round on one machine: process 0 compiles the round's programs and the others load them.

Every process of a round compiles the same SPMD program.  On the local slice
the hosts share one machine's cores, so on a persistent-cache miss they all
compile at once and slow each other down (four compiles on two cores: the
round's start waits twice as long as for one).  Here process 0 compiles the
round's programs (the step, and a new model's initialisation) and passes each
to the others through the run root, serialized (``compiled/<job>/round-<n>/``);
they load it instead of compiling.

Process 0 always says what it has for each program, so nobody waits in vain:
the executable, or "none" when it has nothing it can pass on (a program it got
from the persistent cache does not serialize whole on CPU, and the others then
hit the same cache themselves).  A process that finds "none", cannot load what
it finds, or has waited ``wait_s`` compiles the program itself.  Where hosts
are machines of their own (GKE), each compiles on its own cores, as before.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from typing import Any

from training.layout import COMPILED
from training.storage import NotFound, Store

log = logging.getLogger(__name__)

NONE = b"none"  # process 0 has no executable to pass on: compile it yourself
POLL_S = 0.05


def enabled(backend: str, processes: int) -> bool:
    """Whether a round's programs are compiled once: its processes share one machine's cores (the local slice)."""
    return backend == "local" and processes > 1


def _key(job: str, round_: int, name: str) -> str:
    return f"{COMPILED}{job}/round-{round_}/{name}.bin"


def publish(store: Store, job: str, round_: int, name: str, compiled: Any | None) -> None:
    """Process 0: pass ``compiled`` (None: nothing to pass on) to the round's other processes."""
    data = NONE
    if compiled is not None:
        try:
            from jax.experimental import serialize_executable

            data = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # noqa: BLE001 - the others compile it themselves
            log.warning("could not serialize %s to pass it on: %s: %s", name, type(e).__name__, e)
    try:
        store.put(_key(job, round_, name), data)
    except Exception as e:  # noqa: BLE001 - "none", smaller, may still go through; else the others wait it out
        log.warning("could not pass %s on: %s: %s", name, type(e).__name__, e)
        with contextlib.suppress(Exception):
            store.put(_key(job, round_, name), NONE)


def fetch(store: Store, job: str, round_: int, name: str, wait_s: float) -> Any | None:
    """The other processes: process 0's executable of ``name``, loaded here; None to compile it here instead."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            raw = store.get(_key(job, round_, name))
            break
        except NotFound:
            if time.monotonic() > deadline:
                log.warning("process 0 did not pass %s on within %.0f s: compiling it here", name, wait_s)
                return None
            time.sleep(POLL_S)
    if raw == NONE:
        return None
    try:
        from jax.experimental import serialize_executable

        payload, in_tree, out_tree = pickle.loads(raw)  # noqa: S301 - written by this round's process 0
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception as e:  # noqa: BLE001 - compiled here instead
        log.warning("could not load %s from process 0: %s: %s; compiling it here", name, type(e).__name__, e)
        return None


def forget_earlier_rounds(store: Store, job: str, round_: int) -> None:
    """Process 0: delete what earlier rounds of the job passed on (their meshes are gone)."""
    here = f"{COMPILED}{job}/round-{round_}/"
    for key in store.list(f"{COMPILED}{job}/round-"):
        if not key.startswith(here):
            with contextlib.suppress(NotFound):
                store.delete(key)
