"""Passing a round's compiled programs from process 0 to the others through the run root (one process here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import serialize_executable

from training.elastic.worker import compile_once
from training.storage import open_store


def test_a_program_process_0_passes_on_is_loaded_and_runs_as_compiled(tmp_path):
    store = open_store(str(tmp_path))
    compiled = jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.zeros(8)).compile()
    compile_once.publish(store, "j1", 3, "step", serialize_executable.serialize(compiled))
    got = compile_once.fetch(store, "j1", 3, "step", wait_s=1)
    assert got is not None
    x = jnp.arange(8.0)
    np.testing.assert_array_equal(np.asarray(got(x)), np.asarray(compiled(x)))


def test_nothing_to_pass_on_a_broken_executable_or_none_in_time_means_compiling_here(tmp_path):
    store = open_store(str(tmp_path))
    compile_once.publish(store, "j1", 1, "init", None)  # process 0 got it from the cache: nothing to pass on
    t0 = time.monotonic()
    assert compile_once.fetch(store, "j1", 1, "init", wait_s=30) is None
    assert time.monotonic() - t0 < 5, "a 'none' is an answer at once, not a wait"
    store.put("compiled/j1/round-1/step.bin", b"not a pickled executable")
    assert compile_once.fetch(store, "j1", 1, "step", wait_s=30) is None
    t0 = time.monotonic()
    assert compile_once.fetch(store, "j1", 2, "step", wait_s=0.3) is None  # process 0 never said anything
    assert 0.3 <= time.monotonic() - t0 < 5


def test_a_late_program_is_waited_for(tmp_path):
    import threading

    store = open_store(str(tmp_path))
    compiled = jax.jit(lambda x: x + 1).lower(jnp.zeros(4)).compile()
    program = serialize_executable.serialize(compiled)
    later = threading.Timer(0.5, compile_once.publish, (store, "j1", 1, "step", program))
    later.start()
    got = compile_once.fetch(store, "j1", 1, "step", wait_s=30)
    later.join()
    assert got is not None and np.asarray(got(jnp.zeros(4))).tolist() == [1.0] * 4


def test_process_0_forgets_what_earlier_rounds_passed_on_and_only_on_one_machine_is_it_on(tmp_path):
    store = open_store(str(tmp_path))
    for rnd in (1, 2, 3):
        compile_once.publish(store, "j1", rnd, "step", None)
    compile_once.publish(store, "j2", 1, "step", None)
    compile_once.forget_earlier_rounds(store, "j1", 3)
    assert sorted(store.list("compiled/")) == ["compiled/j1/round-3/step.bin", "compiled/j2/round-1/step.bin"]
    assert compile_once.enabled("local", 2) and not compile_once.enabled("local", 1)
    assert not compile_once.enabled("gke", 4)


def _lowered_in_a_process_of_its_own() -> str:
    import subprocess
    import sys

    code = (
        "import jax, jax.numpy as jnp\n"
        "from training.elastic.worker import compile_once\n"
        "lowered = jax.jit(lambda x: jnp.tanh(x) @ x.T).lower(jnp.zeros((8, 8)))\n"
        "print(compile_once.program_key(lowered))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_a_program_compiled_into_the_cache_is_noted_under_the_same_key_in_every_process(tmp_path):
    lowered = jax.jit(lambda x: jnp.tanh(x) @ x.T).lower(jnp.zeros((8, 8)))
    key = compile_once.program_key(lowered)
    assert key == _lowered_in_a_process_of_its_own()  # another process lowering the same program finds the note
    assert key != compile_once.program_key(jax.jit(lambda x: jnp.tanh(x) @ x).lower(jnp.zeros((8, 8))))
    assert key != compile_once.program_key(jax.jit(lambda x: jnp.tanh(x) @ x.T).lower(jnp.zeros((4, 4))))
    cache = str(tmp_path / "cache")
    assert not compile_once.cached(cache, key)
    compile_once.note_cached(cache, key)
    assert compile_once.cached(cache, key)
    # JAX's own cache reads and evicts only its "*-cache" entries: the notes are not among them.
    assert not any(p.name.endswith("-cache") for p in (tmp_path / "cache").rglob("*"))
    (tmp_path / "a-file").write_text("")
    compile_once.note_cached(str(tmp_path / "a-file" / "cache"), key)  # a cache it cannot write to: no error
    assert not compile_once.cached(str(tmp_path / "a-file" / "cache"), key)


def test_a_derived_program_s_key_depends_on_its_program_and_on_how_it_was_derived() -> None:
    from training.elastic.worker.compile_once import derived_key

    a, b = "a" * 64, "b" * 64
    assert derived_key(a, "ahead:2") == derived_key(a, "ahead:2")
    assert len({derived_key(a, "ahead:2"), derived_key(a, "ahead:1"), derived_key(b, "ahead:2"), a}) == 4


def test_the_others_wait_for_the_key_process_0_announces_and_not_once_it_passed_on_without_one(tmp_path) -> None:
    store = open_store(str(tmp_path / "run"))
    later = threading.Timer(0.3, compile_once.announce, (store, "j1", 1, "step", "k" * 64))
    later.start()
    assert compile_once.announced(store, "j1", 1, "step", wait_s=30) == "k" * 64  # waited for it
    later.join()
    compile_once.publish(store, "j1", 1, "init", None)  # process 0 had the program already: no key comes
    t0 = time.monotonic()
    assert compile_once.announced(store, "j1", 1, "init", wait_s=30) is None
    assert time.monotonic() - t0 < 5
    assert compile_once.announced(store, "j1", 2, "step", wait_s=0.3) is None  # process 0 never said anything


WHOLE = """
import json, pickle, sys, threading
import jax, jax.numpy as jnp
from jax import monitoring
from training.elastic.worker import compile_once
cache, out = sys.argv[1], sys.argv[2]
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
hits = [0]
monitoring.register_event_listener(lambda e, **_: hits.__setitem__(0, hits[0] + (e == "/jax/compilation_cache/cache_hits")))
compile_once.watch_cache_hits()
if out == "load":
    from jax.experimental import serialize_executable
    payload, in_tree, out_tree = pickle.load(open(cache + "/program.pkl", "rb"))
    got = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    print(json.dumps({"y": float(got(jnp.arange(64.0).reshape(8, 8)))}))
else:
    lowered = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3).lower(jnp.zeros((8, 8)))
    c = compile_once.compile_here(lowered, None, lambda: hits[0])
    program = c.whole(cache)
    if program is not None:
        pickle.dump(program, open(cache + "/program.pkl", "wb"))
    y = float(c.executable(jnp.arange(64.0).reshape(8, 8)))
    print(json.dumps({"hit": c.cache_hit, "whole": program is not None, "y": y}))
"""


def test_a_program_from_the_persistent_cache_is_serialized_whole_and_runs_where_it_is_loaded(tmp_path) -> None:
    """An executable loaded from the cache lacks its functions' code when serialized on CPU; serialized from the
    cache's entry, it loads in another process and runs, with the result of the program compiled anew."""

    def run(what: str) -> dict[str, float]:
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)
        out = subprocess.run(
            [sys.executable, "-c", WHOLE, str(tmp_path), what], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    cold = run("compile")
    assert cold["hit"] is False and cold["whole"] is True
    warm = run("compile")  # the same program: a hit, whose key JAX logged, and whose entry is read
    assert warm["hit"] is True and warm["whole"] is True
    loaded = run("load")
    assert loaded["y"] == cold["y"] == warm["y"]
