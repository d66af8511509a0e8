"""The bench's format row: the persistent checkpoint formats side by side, ``lean`` against Orbax's OCDBT.

Each repeat saves and restores one state of a given size per process (default 1 GiB of float32
arrays, as large arrays the way a model's are, plus a model's share of small ones) in both
formats, interleaved, on a local disk and on gs:// (the GCS emulator on 127.0.0.1), the way the
worker saves: the loop's pause (the host copy's dispatch), the time until the step is committed,
then the time a fresh manager takes to restore it onto the same mesh.  Orbax's fixed cost per save
is measured apart, on a state of the same arrays at a few KiB each.

On the emulator Orbax's format is what ``checkpoint_format: auto`` picks there (plain zarr: OCDBT's
manifest needs object generations the emulator gets wrong); the row says which ran.  The emulator is
a single Python process: its figures rank the formats' request patterns, not GCS's throughput.

Run it alone: ``python -m benchmarks.formats [--size-mib N] [--repeats N] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.table import Row, note, over, ratios, row

DEFAULT_MIB = 1024  # per process: the realistic 1-4 GB
QUICK_MIB = 64
LARGE_ARRAYS = 16
SMALL_ARRAYS = 48  # a model's norms, biases and counters: most of its arrays, almost none of its bytes
TINY_BYTES = 4096
CHILD_TIMEOUT_S = 1800.0

CHILD = "benchmarks.formats"


def _state(total_bytes: int, large_bytes: int | None = None) -> Any:
    """A state of LARGE_ARRAYS float32 arrays sharing ``total_bytes`` (or ``large_bytes`` each) and SMALL_ARRAYS small ones."""
    import jax
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    each = large_bytes if large_bytes is not None else total_bytes // LARGE_ARRAYS
    rows = max(1, each // 4 // 1024)
    params = {f"w{i:02d}": jax.device_put(np.full((rows, 1024), i, np.float32), rep) for i in range(LARGE_ARRAYS)}
    params.update({f"norm{i:02d}": jax.device_put(np.full((256,), i, np.float32), rep) for i in range(SMALL_ARRAYS)})
    return {"params": params, "step": jax.device_put(np.int32(1), rep)}


def _one(root: str, fmt: str, state: Any, step: int) -> dict[str, float]:
    """Save ``state`` as ``step`` in ``fmt`` under ``root`` as the worker does, then restore it: seconds of each part."""
    import jax

    from training.checkpoint import manager as ckpt
    from training.config import load_config

    cfg = load_config("tiny", None, {"root": root, "run_name": f"fmt-{fmt}", "checkpoint_format": fmt})
    mngr = ckpt.checkpoint_manager(cfg, cfg.run_uri)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    bg = ckpt.BackgroundSave(abstract, "bench-save", gather_small=ckpt.packs_small(mngr))
    bg.snapshot.prepare()
    t0 = time.perf_counter()
    bg.start(lambda s: ckpt.save(mngr, step, s, {"next_batch": step}, cfg), state)
    pause = time.perf_counter() - t0
    bg.collect()
    ckpt.wait_saved(mngr)
    commit = time.perf_counter() - t0
    bg.close()
    fresh = ckpt.checkpoint_manager(cfg, cfg.run_uri)
    t1 = time.perf_counter()
    back, _ = ckpt.restore(fresh, step, abstract)
    jax.block_until_ready(back)
    restore = time.perf_counter() - t1
    return {"pause_s": pause, "commit_s": commit, "restore_s": restore}


def child(size_mib: int, repeats: int, roots: dict[str, str], out: Path) -> None:
    """The measurement, in a process of its own (JAX's flags are its own): JSON written to ``out``."""
    state = _state(size_mib << 20)
    tiny = _state(0, TINY_BYTES)
    formats = {"local": ("lean", "ocdbt"), "gcs": ("lean", "auto")}
    result: dict[str, Any] = {"size_mib": size_mib, "runs": []}
    step = 0
    for _ in range(repeats):
        run: dict[str, Any] = {}
        for where, root in roots.items():
            for fmt in formats[where]:
                step += 1
                run[f"{where}:{fmt}"] = _one(root, fmt, state, step)
        for fmt in ("lean", "ocdbt"):
            step += 1
            run[f"fixed:{fmt}"] = _one(roots["local"], fmt, tiny, step)
        result["runs"].append(run)
        out.write_text(json.dumps(result))


def bench_formats(repeats: int, quick: bool = False, size_mib: int | None = None) -> dict[str, Any]:
    """The row's result: each repeat's pause, commit and restore seconds per root and format."""
    from training.emulator import gcs_emulator

    size = size_mib or (QUICK_MIB if quick else DEFAULT_MIB)
    with tempfile.TemporaryDirectory(prefix="rtrain-formats-") as tmp, gcs_emulator("rtrain-formats"):
        out = Path(tmp) / "result.json"
        roots = {"local": str(Path(tmp) / "runs"), "gcs": "gs://rtrain-formats/runs"}
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        args = [sys.executable, "-m", CHILD, "--child", str(out), "--size-mib", str(size), "--repeats", str(repeats)]
        proc = subprocess.run(
            [*args, "--roots", json.dumps(roots)], env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
        )
        if proc.returncode != 0 or not out.exists():
            return {"size_mib": size, "runs": [], "error": (proc.stderr or proc.stdout)[-400:]}
        result: dict[str, Any] = json.loads(out.read_text())
    commit = [r["local:lean"]["commit_s"] / r["local:ocdbt"]["commit_s"] for r in result["runs"]]
    result["ratio"] = statistics.median(commit) if commit else 0.0
    result["target"] = "lean/OCDBT commit: lean stays only if < 1 at 1-4 GiB"
    return result


def _med(runs: list[dict[str, Any]], key: str, part: str) -> list[float]:
    return [float(r[key][part]) for r in runs]


def rows(result: dict[str, Any]) -> list[Row]:
    """Per root: lean's commit over Orbax's, per repeat, with each format's pause, commit and restore; then
    Orbax's fixed cost per save."""
    runs = result.get("runs") or []
    if not runs:
        return [note("formats", "checkpoint formats", f"not run: {str(result.get('error', ''))[:150]}")]
    out: list[Row] = []
    size = f"{result['size_mib']} MiB"
    for where, orbax in (("local", "ocdbt"), ("gcs", "auto")):
        lean, theirs = f"{where}:lean", f"{where}:{orbax}"
        name = "OCDBT" if orbax == "ocdbt" else "zarr (auto on the emulator)"
        parts = []
        for label, key in (("lean", lean), (name, theirs)):
            parts.append(
                f"{label}: pause {over(_med(runs, key, 'pause_s'), 1e3, 1)} ms, "
                f"commit {over(_med(runs, key, 'commit_s'))} s, restore {over(_med(runs, key, 'restore_s'))} s"
            )
        values = ratios(_med(runs, lean, "commit_s"), _med(runs, theirs, "commit_s"))
        out.append(
            row(
                f"formats:{where}",
                f"lean/Orbax commit, {where} {size}",
                parts[0],
                values,
                "< 1 keeps lean",
            )
        )
        out.append(note(f"formats:{where}:orbax", "", parts[1]))
    fixed = (
        f"Orbax (OCDBT) commit {over(_med(runs, 'fixed:ocdbt', 'commit_s'), 1e3, 1)} ms against lean "
        f"{over(_med(runs, 'fixed:lean', 'commit_s'), 1e3, 1)} ms per save of {LARGE_ARRAYS + SMALL_ARRAYS + 1} "
        f"arrays of a few KiB (local)"
    )
    out.append(note("formats:fixed", "  fixed cost per save", fixed))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.formats", description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=None, help=f"state per process (default {DEFAULT_MIB})")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help=f"a {QUICK_MIB} MiB state")
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--roots", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        child(a.size_mib or DEFAULT_MIB, a.repeats, json.loads(a.roots), a.child)
        return 0
    result = bench_formats(a.repeats, a.quick, a.size_mib)
    print(json.dumps(result, indent=2))
    from benchmarks.table import format_row

    for r in rows(result):
        print(format_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
