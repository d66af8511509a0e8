"""``rtrain bench``: the engine's figures, each a ratio of two things measured side by side in one run.

1. Recovery from a lost follower or leader host (agent and worker SIGKILLed) to the first step on the
   new mesh, by phase, against a cold start from the same checkpoint and against Ray Train v2's
   elastic trainer on the same model, data and kill (``benchmarks/ray_baseline.py``).
2. Checkpoint overhead: step time with async checkpoints every K steps / without.
3. Cost of resilience: tokens/s of the engine / of a hand-written ``jit`` loop; and MFU.
4. Restore throughput / raw sequential read throughput of the same files.
5. The local tier: its step-time cost; steps trained again after a lost host with it / without;
   steps lost to a preemption notice (should be none).
6. The service: a queued job's priority raised on a shared pool: time to free hosts, ETA vs end.
7. The control plane: storage requests per host per minute, against the cadence's model.
8. The accelerator row: the built-in Llama through the Trainer on this JAX backend.
9. The checkpoint formats: lean against Orbax's, at 1 and 4 GiB per process, locally and on gs://.
10. Recovery at scale: a lost host at 1 GiB of state a process against a cold start and against its
    floor (detect + read + transfer + a step); the steps while a local or persistent save is written.

Each figure's measurement lives in a module of its own (``recovery``, ``checkpoints``, ``cost``,
``service``, ``control_plane``, ``accelerator``, ``formats``, ``at_scale``; the jobs they run in ``jobs``); this
module runs the ones asked for and prints the table (``rows``, ``table``).  Timings come from the runs' own event records (process clocks), not log lines.  Each figure prints
its repeats and their spread; then a table, and JSON.  Measurements, not tests: machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.at_scale import bench_at_scale
from benchmarks.checkpoints import bench_checkpoint_overhead, bench_local_tier, bench_restore
from benchmarks.control_plane import OPS_WINDOW_S, bench_control_plane
from benchmarks.cost import bench_cost
from benchmarks.jobs import WORKERS
from benchmarks.recovery import bench_recovery
from benchmarks.rows import rows_of
from benchmarks.service import bench_service
from benchmarks.table import format_rows, ratio_text

FIGURES = (
    "recovery",
    "checkpoint_overhead",
    "cost_of_resilience",
    "restore_throughput",
    "local_tier",
    "service",
    "control_plane",
    "accelerator",
    "formats",
    "recovery_at_scale",
)


def cpu_counters() -> tuple[int, int] | None:
    """(steal, all) CPU time of this machine so far, in clock ticks (Linux); None where unknown."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time a virtual machine's host gave to others between two readings (None: unknown).

    A figure measured while it was high is a figure of a busy neighbour as much as of this code.
    """
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def figure_runs(
    ws: Path, repeats: int, quick: bool, formats_mib: list[int] | None = None
) -> dict[str, Callable[[], dict[str, Any]]]:
    """Each figure's measurement, by name, every one repeated ``repeats`` times (``formats_mib``: the formats
    figure's state sizes)."""
    return {
        "recovery": lambda: bench_recovery(ws, repeats, ray=not quick),
        "checkpoint_overhead": lambda: bench_checkpoint_overhead(ws, repeats, quick=quick),
        "cost_of_resilience": lambda: bench_cost(ws, repeats),
        "restore_throughput": lambda: bench_restore(ws, repeats),
        "local_tier": lambda: bench_local_tier(ws, repeats),
        "service": lambda: bench_service(ws, repeats),
        "control_plane": lambda: bench_control_plane(ws, repeats, 10.0 if quick else OPS_WINDOW_S),
        "accelerator": lambda: _accelerator(repeats, quick),
        "formats": lambda: _formats(repeats, quick, formats_mib),
        "recovery_at_scale": lambda: bench_at_scale(ws, repeats, "ci" if quick else "gib"),
    }


def _accelerator(repeats: int, quick: bool) -> dict[str, Any]:
    """The accelerator row (``benchmarks/accelerator.py``): the built-in Llama on this JAX backend."""
    from benchmarks.accelerator import bench_accelerator

    return bench_accelerator(repeats, quick)


def _formats(repeats: int, quick: bool, sizes_mib: list[int] | None) -> dict[str, Any]:
    """The format row (``benchmarks/formats.py``): lean against Orbax's OCDBT, locally and on gs:// (the emulator)."""
    from benchmarks.formats import bench_formats

    return bench_formats(repeats, quick, sizes_mib)


def main(args: argparse.Namespace) -> int:
    from training import data

    repeats = args.repeats if args.repeats is not None else 1 if args.quick else 3
    only = set(args.only or FIGURES)
    unknown = only - set(FIGURES)
    if unknown:
        raise ValueError(f"--only: unknown figure(s) {sorted(unknown)}; known: {', '.join(FIGURES)}")
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, not {repeats}")
    formats_mib = getattr(args, "formats_mib", None)
    if formats_mib and min(formats_mib) < 1:
        raise ValueError(f"--formats-mib must be at least 1, not {min(formats_mib)}")
    ws = Path("var/bench").resolve()
    ws.mkdir(parents=True, exist_ok=True)
    data.prepare(None, str(ws / "data"), 64, max_bytes=2_000_000)
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "workers": WORKERS, "devices_per_worker": 2},
        "repeats": repeats,
        "time": time.time(),
    }
    runs = figure_runs(ws, repeats, args.quick, formats_mib)
    for name in FIGURES:
        if name not in only:
            continue
        print(f"[bench] {name} ...", flush=True)
        before = cpu_counters()
        results[name] = summarise(name, runs[name](), steal_fraction(before, cpu_counters()))
        ratio, target = results[name]["ratio"], results[name]["target"]
        said = f"ratio {ratio_text(ratio).strip()} (target {target})" if ratio is not None else "not measured"
        print(f"[bench] {name}: {said}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(format_table(results))
    print(f"wrote {out}")
    return 0


def summarise(name: str, result: dict[str, Any], steal: float | None) -> dict[str, Any]:
    """A figure's result with its rows (each ratio's median, minimum and maximum over the repeats), its
    headline ratio and target (its first row with a ratio; None where no row has one), and the CPU steal
    while it was measured."""
    rows = rows_of(name, result)
    head = next((r for r in rows if r["ratio"] is not None), None)
    ratio, target = (head["ratio"], head["target"]) if head is not None else (None, "")
    return {**result, "ratio": ratio, "target": target, "table_rows": rows, "cpu_steal": steal}


def format_table(r: dict[str, Any]) -> str:
    """The table of every figure in ``r`` (as :func:`main` writes it), in the order of :data:`FIGURES`."""
    names = [name for name in FIGURES if name in r]
    rows = [row for name in names for row in r[name]["table_rows"]]
    return format_rows(r["repeats"], rows, {name: r[name].get("cpu_steal") for name in names})
