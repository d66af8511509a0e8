"""The settings of a JAX process whose devices are CPU cores: a simulated host, an emulated pod, the bench's loops."""

from __future__ import annotations

import os

# YNNPACK's fusions build their kernels' pipelines on an executable's first run and run no faster after it
# on these models (measured: the tiny model's first step 93 ms against 56 ms without them, the small one's
# 454 against 275 ms; steady steps the same, 21.6 and 191 ms).  A round's first step is on the recovery's
# path: they stay off.
NO_YNN_FUSIONS = "--xla_cpu_experimental_ynn_fusion_type="


def cpu_xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a process that plays ``devices`` devices on its CPU cores."""
    if devices < 1:
        raise ValueError(f"a process needs at least one device, not {devices}")
    return f"--xla_force_host_platform_device_count={devices} {NO_YNN_FUSIONS}"


# XLA's CPU client allocates its buffers anew for every step's outputs (donated inputs included): a state of
# 1 GiB is 270k page faults a step in 4 KiB pages, about 0.46 s of CPU here, which 2 MiB pages spare (a
# step of the 1 GiB model on 2 CPU devices: 3.29 -> 2.81 CPU-s, 1.74 -> 1.45 s).  glibc advises huge pages
# for what its malloc maps when this tunable is set at the process's start (the kernel's default,
# transparent huge pages on advice only, does the rest).
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def cpu_process_env(devices: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables a process that plays ``devices`` devices on its CPU cores starts with: XLA's flags, gloo
    collectives, and glibc's huge pages for its buffers (added to ``environ``'s own tunables, default this
    process's)."""
    tunables = (os.environ if environ is None else environ).get("GLIBC_TUNABLES", "")
    if HUGE_PAGES_TUNABLE not in tunables.split(":"):
        tunables = ":".join(t for t in (tunables, HUGE_PAGES_TUNABLE) if t)
    return {
        "JAX_PLATFORMS": "cpu",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "XLA_FLAGS": cpu_xla_flags(devices),
        "GLIBC_TUNABLES": tunables,
    }
