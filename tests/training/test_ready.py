"""Waiting for device arrays: the waiting thread sleeps between looks, and returns once they are ready."""

from __future__ import annotations

import time
from typing import Any

from training.ready import wait_ready


def test_a_wait_returns_once_the_arrays_are_ready_and_the_waiting_thread_sleeps_meanwhile() -> None:
    import jax
    import jax.numpy as jnp

    work = jax.jit(lambda x: jax.lax.fori_loop(0, 400, lambda _, y: jnp.tanh(y @ y), x))
    x = jnp.full((256, 256), 0.01, jnp.float32)
    work(x).block_until_ready()  # compiled
    small = x + 1
    small.block_until_ready()
    arrays: list[Any] = [small, work(x)]  # the second dispatched: it runs in the backend's threads
    wall, cpu = time.perf_counter(), time.thread_time()
    wait_ready(arrays)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert all(a.is_ready() for a in arrays)
    assert wall > 0.02, f"the step took {wall:.3f} s: too short to tell how the thread waited"
    assert cpu < 0.5 * wall, f"the waiting thread used {cpu:.3f} s of CPU in a {wall:.3f} s wait"
    wait_ready([])  # nothing to wait for
