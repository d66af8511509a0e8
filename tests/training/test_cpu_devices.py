"""The settings of a process whose devices are CPU cores: its devices, no YNNPACK fusions, malloc's huge pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from training.config import load_config
from training.cpu_devices import HUGE_PAGES_TUNABLE, cpu_process_env, cpu_xla_flags
from training.elastic.host.workerproc import worker_env

COMPILE = """
import json, jax, jax.numpy as jnp
f = jax.jit(lambda a, b: jnp.tanh(a @ b).sum())
text = f.lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile().as_text()
print(json.dumps({"devices": jax.device_count(), "ynn_fusion": "__ynn_fusion" in text}))
"""


def _compiled_with(flags: str) -> dict[str, object]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cpu_process_has_its_devices_and_compiles_no_ynnpack_fusion() -> None:
    # XLA's default fuses into YNNPACK here, whose kernels are built on the executable's first run:
    # the flags turn that off (and an XLA that no longer knew the flag would refuse to start).
    assert _compiled_with("--xla_force_host_platform_device_count=3") == {"devices": 3, "ynn_fusion": True}
    assert _compiled_with(cpu_xla_flags(3)) == {"devices": 3, "ynn_fusion": False}


def test_the_local_slice_s_workers_run_with_them() -> None:
    cfg = load_config("tiny", None, {"devices_per_worker": 4})
    assert worker_env(cfg, "/tmp/run", "h0", "j1")["XLA_FLAGS"] == cpu_xla_flags(4)
    with pytest.raises(ValueError, match="at least one device"):
        cpu_xla_flags(0)


# A step's outputs are new buffers of XLA's (its allocator is malloc): here, 64 MiB of them, faulted in.
STEP_FAULTS = """
import json, resource, jax, jax.numpy as jnp
f = jax.jit(lambda x: x * 2.0)
x = jnp.ones((16 << 20,), jnp.float32)
f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ys = [f(x) for _ in range(4)]
jax.block_until_ready(ys)
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""


def _thp_on_advice() -> bool:
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    return "[never]" not in mode


def test_a_cpu_process_s_buffers_come_in_huge_pages_with_the_tunable_it_starts_with() -> None:
    if not _thp_on_advice():
        pytest.skip("this kernel gives no transparent huge pages")
    env = {**os.environ, **cpu_process_env(1, {})}
    assert env["GLIBC_TUNABLES"] == HUGE_PAGES_TUNABLE
    plain = {k: v for k, v in env.items() if k != "GLIBC_TUNABLES"}
    faults = {}
    for name, e in (("huge", env), ("plain", plain)):
        out = subprocess.run([sys.executable, "-c", STEP_FAULTS], env=e, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        faults[name] = json.loads(out.stdout.strip().splitlines()[-1])
    assert faults["plain"] > 4 * 16_000 > 10 * faults["huge"], faults  # 4 KiB pages: 16k faults per 64 MiB output


def test_a_tunable_already_set_is_kept_and_the_slice_s_workers_get_the_same() -> None:
    assert cpu_process_env(2, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == (
        f"glibc.malloc.arena_max=2:{HUGE_PAGES_TUNABLE}"
    )
    assert cpu_process_env(2, {"GLIBC_TUNABLES": HUGE_PAGES_TUNABLE})["GLIBC_TUNABLES"] == HUGE_PAGES_TUNABLE
    cfg = load_config("tiny", None, {"devices_per_worker": 4})
    assert HUGE_PAGES_TUNABLE in worker_env(cfg, "/tmp/run", "h0", "j1")["GLIBC_TUNABLES"].split(":")
