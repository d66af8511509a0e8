"""On a CPU slice, the collectives' transport threads are lowered and nothing else is.

Two real processes joined by JAX's coordination service mark their threads, start the
backend and lower the threads started since the mark; then they run collectives over gloo
and report which thread did the polling and every thread's priority.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.conftest import free_port

PROCESS = """
import json, os, sys, threading
import jax, jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from training.elastic.worker.cpu_slice import TransportThreads, unnamed_threads

def cpu(tid):
    return sum(int(x) for x in open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[11:13])

jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
transport = TransportThreads()  # the coordination client's threads exist; the backend's do not yet
before = {int(t) for t in os.listdir("/proc/self/task")}
helper = threading.Thread(target=threading.Event().wait, args=(60,), daemon=True)
helper.start()  # a Python thread started after the mark: never lowered
mesh = Mesh(np.array(jax.devices()), ("d",))
lowered = transport.lower()
x = jax.make_array_from_callback((4,), NamedSharding(mesh, P("d")), lambda i: np.ones(len(range(*i[0].indices(4)))))
total = jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(mesh, P()))
s = float(total(x))
start = {t: cpu(t) for t in unnamed_threads()}
for _ in range(300):  # all-reduces over gloo: its event loop is the busiest unnamed thread meanwhile
    s = float(total(x))
busiest = max(start, key=lambda t: cpu(t) - start[t])
nice = {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}
print(json.dumps({
    "total": s,
    "busiest": busiest,
    "busy_ticks": cpu(busiest) - start[busiest],
    "lowered": lowered,
    "nice": nice,
    "before": sorted(before),
    "python": [t.native_id for t in threading.enumerate()],
    "unnamed_now": sorted(unnamed_threads()),
}))
"""


def test_the_collectives_threads_are_lowered_and_the_others_are_not() -> None:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    coord = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(PROCESS), coord, str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    for out, _ in outs:
        r = json.loads(out.strip().splitlines()[-1])
        assert r["total"] == 4.0
        nice = {int(k): v for k, v in r["nice"].items()}
        # The backend started the transport's threads after the mark: they, and only they, are lowered; the
        # thread that does the collectives' polling is one of them.
        assert r["busy_ticks"] > 0 and r["busiest"] in r["lowered"], r
        assert set(r["lowered"]) <= set(r["unnamed_now"])
        assert not set(r["lowered"]) & set(r["before"])
        assert all(nice[t] == 19 for t in r["lowered"] if t in nice)
        # The main thread, Python's threads and every thread that existed before keep their priority.
        untouched = set(r["python"]) | set(r["before"])
        assert all(nice[t] == 0 for t in untouched if t in nice), {t: nice[t] for t in untouched if t in nice}
