"""Process 0 alone compiles a round's programs when every process is on this machine.

Two real processes joined by JAX's coordination service compile one program over both processes'
devices, from an empty persistent cache; JAX's compiler log says which compiled it and which waited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port

COMPILE = """
import json, logging, sys
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from training.elastic.worker import compile_once_on_one_machine, share_cpu_compilation_cache

coord, pid, cache, named = sys.argv[1:5]
jax.distributed.initialize(coord, 2, int(pid))
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
share_cpu_compilation_cache()
compile_once_on_one_machine(named)  # the coordinator as the round names it
said = []  # what JAX's compiler says it does with a program: compile it here, or wait for process 0's
handler = logging.Handler(logging.DEBUG)
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger("jax._src.compiler").addHandler(handler)
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
mesh = Mesh(np.array(jax.devices()), ("x",))
x = jax.make_array_from_callback((8, 4), NamedSharding(mesh, P("x")), lambda ix: np.ones((8, 4), np.float32)[ix])
total = jax.jit(lambda a: (a * 3).sum())(x)
print(json.dumps({"total": float(total), "shared": sum("compiling and sharing module" in m for m in said),
                  "waited": sum(m.startswith("Waiting for module") for m in said)}))
"""


def run_pair(tmp_path: Path, named: str) -> list[dict[str, float]]:
    coord = f"127.0.0.1:{free_port()}"
    cache = tmp_path / f"cache-{named.split(':')[0]}"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", COMPILE, coord, str(pid), str(cache), named.replace("COORD", coord)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_process_0_alone_compiles_when_every_process_is_on_this_machine(tmp_path: Path) -> None:
    first, second = run_pair(tmp_path, "COORD")
    assert first["total"] == second["total"] == 96.0
    assert first["shared"] >= 1 and first["waited"] == 0
    assert second["waited"] >= 1 and second["shared"] == 0, "process 1 compiled the program itself"


def test_processes_on_their_own_hosts_each_compile(tmp_path: Path) -> None:
    # A coordinator on another host: each process has its own cores and its own cache, and compiles for itself.
    first, second = run_pair(tmp_path, "10.1.2.3:8476")
    assert first["total"] == second["total"] == 96.0
    assert first["shared"] == second["shared"] == first["waited"] == second["waited"] == 0
