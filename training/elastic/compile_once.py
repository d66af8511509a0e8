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

Waiting is worth it only on a cache miss.  On a hit, process 0's compile is a
lookup the others could make side by side with it, and waiting for its "none"
puts their lookups after its own.  So whoever compiles a program into the
persistent cache leaves a note of it there (:func:`note_cached`, keyed on the
lowered program), and a process that finds the note compiles at once.  A note
that outlived its cache entry costs speed only: JAX's own key still decides
what is loaded.

The others need the program's key before they know which case they are in, and
only lowering the program gives it: a second of CPU per process for a small
model, which on a miss buys nothing, since they load process 0's executable.
So process 0 announces each program's key as soon as it has lowered it
(:func:`announce`), before it compiles; the others wait for that key
(:func:`announced`), and lower the program themselves only on a hit.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import time
from typing import Any

from training.layout import COMPILED
from training.storage import NotFound, Store, open_store

log = logging.getLogger(__name__)

NONE = b"none"  # process 0 has no executable to pass on: compile it yourself
POLL_S = 0.05
# In the persistent cache's directory: one empty object per program compiled into it.  JAX's own cache
# reads only its "*-cache" entries there, so it neither counts nor evicts these.
NOTES = "rtrain-compiled/"


def enabled(backend: str, processes: int) -> bool:
    """Whether a round's programs are compiled once: its processes share one machine's cores (the local slice)."""
    return backend == "local" and processes > 1


def _key(job: str, round_: int, name: str) -> str:
    return f"{COMPILED}{job}/round-{round_}/{name}.bin"


def _key_of(job: str, round_: int, name: str) -> str:
    return f"{COMPILED}{job}/round-{round_}/{name}.key"


def announce(store: Store, job: str, round_: int, name: str, key: str) -> None:
    """Process 0: the key of program ``name`` (:func:`program_key`), lowered and about to be compiled."""
    try:
        store.put(_key_of(job, round_, name), key.encode())
    except Exception as e:  # noqa: BLE001 - the others lower the program themselves when they see no key
        log.warning("could not announce %s: %s: %s", name, type(e).__name__, e)


def announced(store: Store, job: str, round_: int, name: str, wait_s: float) -> str | None:
    """The other processes: the key process 0 announced for ``name``; None once it passed something on without
    one (it had the program already: nothing to pass on) or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return store.get(_key_of(job, round_, name)).decode()
        except NotFound:
            if store.exists(_key(job, round_, name)):  # passed on: a key it had is there now
                with contextlib.suppress(NotFound):
                    return store.get(_key_of(job, round_, name)).decode()
                return None
            if time.monotonic() > deadline:
                return None
            time.sleep(POLL_S)


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


def program_key(lowered: Any) -> str:
    """A lowered program's key for :func:`note_cached`: the same program (and JAX and XLA flags) in any process."""
    import jax

    text = lowered.as_text()
    salt = f"{jax.__version__}|{os.environ.get('XLA_FLAGS', '')}|"
    return hashlib.sha256(salt.encode() + text.encode()).hexdigest()


def derived_key(key: str, what: str) -> str:
    """The key of a program made from the one keyed ``key`` in a known way (``what``: e.g. its step for 2 hosts)."""
    return hashlib.sha256(f"{key}|{what}".encode()).hexdigest()


def note_cached(cache_dir: str, key: str) -> None:
    """Note that the persistent cache in ``cache_dir`` holds the program ``key`` (after compiling it there)."""
    try:
        open_store(cache_dir).put(NOTES + key, b"")
    except Exception as e:  # noqa: BLE001 - a note not left costs a later round's processes a wait only
        log.warning("could not note a compiled program in %s: %s: %s", cache_dir, type(e).__name__, e)


def cached(cache_dir: str, key: str) -> bool:
    """Whether the persistent cache in ``cache_dir`` was noted to hold the program ``key``."""
    try:
        return open_store(cache_dir).exists(NOTES + key)
    except Exception:  # noqa: BLE001 - no note: wait for process 0 as without one
        return False
