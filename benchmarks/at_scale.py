"""The recovery-at-scale figure: a lost host's recovery at 1 GiB of state a process, against a cold start and the floor;
and the steps while a save of that state is written.

Every recovery figure of the ``recovery`` row is of a state of a few MB.  Here the model is big
enough that each process holds at least 1 GiB of state (parameters and AdamW's moments, a whole
replica per host), on the local slice's 2 hosts.  In each repeat:

1. A job saving a local copy every few steps loses its follower host once both hosts hold a copy
   newer than the newest persistent checkpoint: the time from the kill to the first step on the
   host that is left, by phase (the job's own events).
2. A cold start: a fresh ``rtrain train`` of the same job from its persistent checkpoint, on the
   mesh the recovery ended on, to its first step.
3. The floor, measured on this machine after the job: the detection the run measured, plus
   reading the copy's bytes from host memory, plus copying them to the devices (both at full
   parallelism, in a fresh process), plus one steady step on the new mesh.
4. Steps while a save is written: a job whose hosts save a local copy whenever the previous one
   is done (one is always being written), and a job saving persistent (Orbax) checkpoints, each
   against a job that does not save, over the same steps.

``scale``: ``"gib"`` (the figure) or ``"ci"`` (the same run at a few MB, for the tests).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.jobs import WORKERS, bench_cfg, run_job
from benchmarks.recovery import PHASES, cold_start, lose_host
from benchmarks.table import Row, note, over, ratios, row
from training.config import Config
from training.events import Event


@dataclass(frozen=True)
class Scale:
    """A size of the figure: the model's keys, and the jobs' lengths (the lost-host job's, the save-cost jobs')."""

    model: dict[str, Any]
    lose_steps: int  # long enough for a few steady steps on the host left after the recovery
    save_steps: int
    save_window: tuple[int, int]  # the save-cost jobs' steps compared (after the round's first steps)


SCALES: dict[str, Scale] = {
    # d 768, 13 layers, d_ff 2048, a byte vocabulary: 92.5M parameters, 1.03 GiB with AdamW's moments (float32).
    "gib": Scale(
        {"d_model": 768, "n_layers": 13, "n_heads": 12, "d_ff": 2048, "global_batch": 4, "device_memory_gib": 8},
        lose_steps=24,
        save_steps=26,
        save_window=(6, 24),
    ),
    # The same jobs at 7 MB, for the tests: 60 ms steps.
    "ci": Scale({"d_model": 128, "n_layers": 2, "n_heads": 4, "d_ff": 512, "global_batch": 4}, 120, 40, (10, 38)),
}
LOCAL_EVERY, PERSISTENT_EVERY = 2, 6  # the lost-host job's saves
SAVE_PERSISTENT_EVERY = 6  # the persistent save-cost job's


def _local_ahead(cfg: Config) -> bool:
    """A persistent checkpoint is committed (a cold start's), and every host holds a local copy newer than it."""
    from training import api
    from training.elastic.rendezvous import Rendezvous
    from training.storage import open_store

    newest = max(api.committed_steps(cfg.run_uri), default=None)
    if newest is None:
        return False
    hosts = Rendezvous(open_store(cfg.run_uri)).hosts()
    return len(hosts) == WORKERS and all(any(s > newest for s, _ in h.local) for h in hosts.values())


def lose_follower(ws: Path, scale: str, i: int) -> dict[str, Any]:
    """A lost follower host, resumed from the local tier: the time to the first step, by phase."""
    return lose_host(
        ws,
        f"scale-{scale}-lose-{i}",
        "follower",
        ready=_local_ahead,
        steady_s=0.0,
        steps=SCALES[scale].lose_steps,
        checkpoint_every=PERSISTENT_EVERY,
        local_checkpoint_every=LOCAL_EVERY,
        **SCALES[scale].model,
    )


# The floor's read and transfer, in a process of their own: the copy's bytes read from host memory (a tmpfs file)
# by 8 threads into buffers, then put on 2 CPU devices by as many threads (each buffer copied: it is writable).
FLOOR = """
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
import jax
path, nbytes, chunk = sys.argv[1], int(sys.argv[2]), 16 << 20
block = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8).tobytes()
with open(path, "wb") as f:  # real bytes (a hole would read as the zero page)
    for o in range(0, nbytes, chunk):
        f.write(block[: min(chunk, nbytes - o)])
buf = np.empty(nbytes, np.uint8); buf[:] = 1  # its pages in: the read measures the copy, not page faults
devices = jax.devices(); jax.device_put(np.zeros(4), devices[0]).block_until_ready()
spans = [(o, min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)]
fd = os.open(path, os.O_RDONLY)
with ThreadPoolExecutor(8) as pool:
    t = time.perf_counter()
    list(pool.map(lambda s: os.preadv(fd, [memoryview(buf)[s[0]:s[0] + s[1]]], s[0]), spans))
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    out = list(pool.map(lambda i: jax.device_put(buf[spans[i][0]:spans[i][0] + spans[i][1]], devices[i % len(devices)]).block_until_ready(), range(len(spans))))
    h2d_s = time.perf_counter() - t
os.close(fd); os.unlink(path)
print(json.dumps({"read_s": read_s, "h2d_s": h2d_s}))
"""


def floor_io(nbytes: int) -> dict[str, float]:
    """Reading ``nbytes`` from a tmpfs file and putting them on 2 CPU devices, each at full parallelism (fresh process)."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run(
        [sys.executable, "-c", FLOOR, str(shm / f"rtrain-floor-{os.getpid()}"), str(nbytes)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=600,
    )
    return {k: float(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def _state_bytes(cfg: Config) -> int:
    """Bytes of the job's train state (one whole replica: what each host's copy holds)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from training.mesh import AXES
    from training.tasks import load_task
    from training.trainer import Trainer

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), AXES)
    abstract = Trainer(cfg.optimizer, mesh, load_task(cfg)).abstract
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(abstract))


def step_times(evs: list[Event], attempt: int = 1) -> dict[int, float]:
    """Each step's time (from the step before it) in round ``attempt``, from its progress events (one a step)."""
    t = sorted(
        (int(e["step"]), float(e["time"])) for e in evs if e["type"] == "progress" and e.get("attempt") == attempt
    )
    return {s1: t1 - t0 for (s0, t0), (s1, t1) in zip(t, t[1:], strict=False) if s1 == s0 + 1}


def persistent_saves(evs: list[Event]) -> list[tuple[float, float]]:
    """Each committed persistent save's span: (its start, its commit), as rank 0 reported them."""
    return [
        (float(e["time"]) - float(e["write_s"]), float(e["time"]))
        for e in evs
        if e["type"] == "checkpoint" and e.get("committed") and e.get("write_s") is not None
    ]


def steps_during(evs: list[Event], spans: list[tuple[float, float]], window: tuple[int, int]) -> list[int]:
    """The steps of ``window`` that ran, at least in part, while a save of ``spans`` was in flight."""
    ends = {int(e["step"]): float(e["time"]) for e in evs if e["type"] == "progress" and e.get("attempt") == 1}
    lo, hi = window
    return [
        s
        for s in range(lo + 1, hi + 1)
        if s - 1 in ends and s in ends and any(a < ends[s] and ends[s - 1] < b for a, b in spans)
    ]


def save_costs(ws: Path, scale: str, i: int) -> dict[str, Any]:
    """Mean step time while saves are written (local: always one in flight; persistent: the steps its saves
    overlap), each against a job without saves over the same steps."""
    size = SCALES[scale]
    kw: dict[str, Any] = {"steps": size.save_steps, **size.model}
    jobs: dict[str, dict[str, Any]] = {
        "none": {"checkpoint_every": 10_000},
        "local": {"checkpoint_every": 10_000, "local_checkpoint_every": 1},
        "orbax": {"checkpoint_every": SAVE_PERSISTENT_EVERY},
    }
    # In a new order each repeat: the first job after the lost-host one runs on memory the machine had just
    # freed (on this VM, pages faulted in again at several times the cost), and it is not always the same one.
    order = list(jobs)[i % 3 :] + list(jobs)[: i % 3]
    evs = {name: run_job(bench_cfg(ws, f"scale-{scale}-{name}-{i}", **jobs[name], **kw)) for name in order}
    none, local, orbax = (step_times(evs[name]) for name in ("none", "local", "orbax"))
    lo, hi = size.save_window
    window = [s for s in range(lo + 1, hi + 1) if s in none and s in local]
    during = [s for s in steps_during(evs["orbax"], persistent_saves(evs["orbax"]), size.save_window) if s in none]

    def mean(times: dict[int, float], steps: list[int]) -> float:
        return sum(times[s] for s in steps) / len(steps) if steps else float("nan")

    return {
        "local_step_s": mean(local, window),
        "local_none_step_s": mean(none, window),
        "persistent_step_s": mean(orbax, during),
        "persistent_none_step_s": mean(none, during),
        "persistent_steps": len(during),
    }


def bench_at_scale(ws: Path, repeats: int, scale: str = "gib") -> dict[str, Any]:
    """The figure: per repeat, a lost follower (local tier), a cold start, the floor, and the saves' cost."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}, not {scale!r}")
    runs: list[dict[str, Any]] = []
    nbytes = 0
    for i in range(repeats):
        lost = lose_follower(ws, scale, i)
        cfg: Config = lost.pop("bench_cfg")
        nbytes = nbytes or _state_bytes(cfg)
        from training import api

        # From the newest persistent checkpoint the recovery could have taken (the job saved more later).
        persistent = max(s for s in api.committed_steps(cfg.run_uri) if s <= lost["restored_step"])
        cold = cold_start(ws, cfg, persistent, i)
        floor = floor_io(nbytes)
        runs.append({**lost, "cold_start_s": cold, **floor, **save_costs(ws, scale, i)})
    return {"scale": scale, "state_bytes": nbytes, "runs": runs}


def rows(r: dict[str, Any]) -> list[Row]:
    """Recovery against a cold start (the figure) and against its floor; the phases; the steps while saves are written."""
    runs, gib = r["runs"], r["state_bytes"] / 2**30
    rec, cold = [x["total_s"] for x in runs], [x["cold_start_s"] for x in runs]
    floor = [x["detect_s"] + x["read_s"] + x["h2d_s"] + x["steady_step_s"] for x in runs]
    med = {k: statistics.median(float(x[k]) for x in runs) for k in (*PHASES, "read_s", "h2d_s", "steady_step_s")}
    local, local_none = [x["local_step_s"] for x in runs], [x["local_none_step_s"] for x in runs]
    orbax, orbax_none = [x["persistent_step_s"] for x in runs], [x["persistent_none_step_s"] for x in runs]
    return [
        row(
            "at_scale",
            f"recovery at {gib:.2f} GiB a process / cold start",
            f"{over(rec)} s vs cold start {over(cold)} s (lost follower, local tier)",
            ratios(rec, cold),
            "<= 0.5",
        ),
        row(
            "at_scale_floor",
            "  the same recovery / its floor",
            f"{over(rec)} s vs {over(floor)} s (detect + read + transfer + a step)",
            ratios(rec, floor),
            "<= 2",
        ),
        note(
            "at_scale_breakdown",
            "  breakdown (median)",
            ", ".join(f"{label} {med[k]:.2f}" for k, label in PHASES.items())
            + f" s; floor: read {med['read_s']:.2f}, transfer {med['h2d_s']:.2f}, step {med['steady_step_s']:.2f} s",
        ),
        row(
            "save_local",
            "steps while a local copy is written / none",
            f"{over(local, 1e3, 0)} vs {over(local_none, 1e3, 0)} ms/step (one always in flight)",
            ratios(local, local_none),
            "<= 1.05",
        ),
        row(
            "save_persistent",
            "  while a persistent save is written / none",
            f"{over(orbax, 1e3, 0)} vs {over(orbax_none, 1e3, 0)} ms/step (OCDBT, the steps its saves overlap)",
            ratios(orbax, orbax_none),
            "<= 1.05",
        ),
    ]
