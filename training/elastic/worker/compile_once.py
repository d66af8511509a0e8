"""One compile per round on one machine: process 0 compiles the round's programs and the others load them.

Every process of a round compiles the same SPMD program.  On the local slice
the hosts share one machine's cores, so on a persistent-cache miss they all
compile at once and slow each other down (four compiles on two cores: the
round's start waits twice as long as for one).  Here process 0 compiles the
round's programs (the step, and a new model's initialisation) and passes each
to the others through the run root, serialized (``compiled/<job>/round-<n>/``);
they load it instead of compiling.

Process 0 always says what it has for each program, so nobody waits in vain:
the executable, or "none" when it has nothing it can pass on.  A process that
finds "none", cannot load what it finds, or has waited ``wait_s`` compiles the
program itself.  Where hosts are machines of their own (GKE), each compiles on
its own cores, as before.

A program process 0 got from the persistent cache is passed on too, serialized
whole from the cache's own entry (:func:`whole`): on XLA:CPU such an executable
serializes without its functions' code.  So on a hit the others do not trace,
lower or look the program up either: a second of CPU each for the ``small``
preset, on the cores the round starts on.

The others need nothing but the program, and only lowering it gives its key.
So process 0 announces each program's key as soon as it has lowered it
(:func:`announce`), before it compiles; the others wait for that key
(:func:`announced`) and then for the program.  The notes beside the cache's
entries (:func:`note_cached`) say which steps were compiled ahead for a round
program (:mod:`training.elastic.worker.ahead`): a note that outlived its entry costs
speed only.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from training.layout import COMPILED
from training.storage import NotFound, Store, open_store

log = logging.getLogger(__name__)

NONE = b"none"  # process 0 has no executable to pass on: compile it yourself
POLL_S = 0.05
# In the persistent cache's directory: one empty object per program compiled into it.  JAX's own cache
# reads only its "*-cache" entries there, so it neither counts nor evicts these.
NOTES = "rtrain-compiled/"
# The XLA options a program is compiled with (``compiler_options``), by name.
XlaOptions = Mapping[str, str | bool | int | float]


def enabled(backend: str, processes: int) -> bool:
    """Whether a round's programs are compiled once: its processes share one machine's cores (the local slice)."""
    from training.placement_traits import traits

    return traits(backend).hosts_here and processes > 1


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


# --- a program from the persistent cache, serialized whole ------------------------------------------------
#
# An executable JAX loaded from its persistent cache serializes without its functions' code on XLA:CPU
# (loaded again, it fails when run: "Function ... not found").  The cache's own entry is whole: JAX
# loads exactly those bytes on a hit.  So the key of each hit is taken from JAX's own log line of it (in
# the thread that compiled), and the executable is serialized with the entry's bytes in its place.

_HIT = "Persistent compilation cache hit for"
_HITS: dict[int, list[str]] = {}  # thread -> the cache keys of its hits not yet taken


class _CacheHits(logging.Filter):
    """Keeps the key of each persistent-cache hit JAX logs (at DEBUG), per thread; lets through only what
    would have been logged anyway."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_HIT) and len(record.args or ()) == 2:
            _HITS.setdefault(threading.get_ident(), []).append(str(record.args[1]))  # type: ignore[index]
        return record.levelno >= self.level


def watch_cache_hits() -> None:
    """From now on, keep the key of each of this process's persistent-cache hits (:func:`hits_here`)."""
    logger = logging.getLogger("jax._src.compiler")
    if not any(isinstance(f, _CacheHits) for f in logger.filters):
        logger.addFilter(_CacheHits(logger.getEffectiveLevel()))
        logger.setLevel(logging.DEBUG)


def hits_here() -> list[str]:
    """The cache keys of the calling thread's hits since it last asked (:func:`watch_cache_hits`)."""
    return _HITS.pop(threading.get_ident(), [])


Serialized = tuple[bytes, Any, Any]  # serialize_executable's (payload, in_tree, out_tree)


def whole(compiled: Any, cache_dir: str, hit: str | None) -> Serialized | None:
    """``compiled`` serialized whole (:func:`serialize_executable.serialize`'s triple); ``hit``: the cache key it
    was loaded under, when it came from the persistent cache in ``cache_dir``.  None when it cannot be."""
    try:
        from jax.experimental import serialize_executable

        if hit is None:
            return cast(Serialized, serialize_executable.serialize(compiled))
        return _from_cache_entry(compiled, open_store(cache_dir).get(f"{hit}-cache"))
    except Exception as e:  # noqa: BLE001 - then it is not passed on or kept: compiled again where needed
        log.warning("could not serialize a compiled program whole: %s: %s", type(e).__name__, e)
        return None


def _from_cache_entry(compiled: Any, entry: bytes) -> Serialized:
    """As :func:`serialize_executable.serialize`, with the executable's bytes from its persistent-cache entry."""
    import io

    import jax
    from jax._src import compilation_cache
    from jax._src.lib import xla_client
    from jax.experimental import serialize_executable

    executable, _ = compilation_cache.extract_executable_and_time(compilation_cache.decompress_executable(entry))

    class Pickler(serialize_executable._JaxPjrtPickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, xla_client.LoadedExecutable):
                return ("exec", executable)
            return super().persistent_id(obj)

    unloaded = compiled._executable._unloaded_executable
    args_info_flat, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
    with io.BytesIO() as f:
        Pickler(f).dump((unloaded, args_info_flat, compiled._no_kwargs))
        return f.getvalue(), in_tree, compiled.out_tree


class Compiled:
    """A program compiled here (:func:`compile_here`): from scratch, or looked up in the persistent cache."""

    def __init__(self, executable: Any, cache_hit: bool, hit_key: str | None) -> None:
        self.executable = executable
        self.cache_hit = cache_hit  # it came from the persistent cache
        self.hit_key = hit_key  # the cache key it was loaded under (None: not a hit, or a hit whose key was not seen)
        self._whole: tuple[Serialized | None] | None = None

    def whole(self, cache_dir: str) -> Serialized | None:
        """It serialized whole (:func:`whole`), once; None when it cannot be (a hit whose key was not seen)."""
        if self._whole is None:
            unseen = self.cache_hit and self.hit_key is None
            self._whole = (None if unseen else whole(self.executable, cache_dir, self.hit_key),)
        return self._whole[0]


def compile_here(lowered: Any, options: XlaOptions | None, hit_count: Callable[[], int]) -> Compiled:
    """Compile ``lowered`` with the XLA ``options`` (``hit_count``: the calling thread's count of persistent-cache
    hits, JAX's own), noting the cache key it was loaded under on a hit (:func:`watch_cache_hits`)."""
    hits_here()  # keys left from before: not this program's
    before = hit_count()
    executable = lowered.compile(compiler_options=options)
    keys = hits_here()
    hit = hit_count() > before or bool(keys)
    return Compiled(executable, hit, keys[-1] if keys else None)


def publish(store: Store, job: str, round_: int, name: str, program: Serialized | None) -> None:
    """Process 0: pass ``program`` (:func:`whole`; None: nothing to pass on) to the round's other processes."""
    data = NONE if program is None else pickle.dumps(program)
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


def program_key(lowered: Any, options: XlaOptions | None = None) -> str:
    """A lowered program's key: the same program (and JAX, XLA flags and the XLA ``options`` it is compiled with)
    in any process."""
    import jax

    text = lowered.as_text()
    salt = f"{jax.__version__}|{os.environ.get('XLA_FLAGS', '')}|"
    key = hashlib.sha256(salt.encode() + text.encode()).hexdigest()
    return derived_key(key, f"options:{sorted(options.items())}") if options else key


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
