"""The XLA flags of a process whose devices are CPU cores: its devices, and no YNNPACK fusions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from training.config import load_config
from training.cpu_devices import cpu_xla_flags
from training.elastic.workerproc import worker_env

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
