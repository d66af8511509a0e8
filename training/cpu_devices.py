"""XLA's flags for a JAX process whose devices are CPU cores: a simulated host, an emulated pod, the bench's loop."""

from __future__ import annotations

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
