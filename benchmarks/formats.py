"""The bench's format row: the persistent checkpoint formats side by side, ``lean`` against Orbax's OCDBT.

This row is the evidence lean was retired on (OCDBT commits and restores faster); no run's config
chooses lean now, so the row writes its lean steps through ``LeanManager`` itself.

Each repeat saves and restores one state per process of each given size (default 1 GiB and 4 GiB
of float32 arrays: large arrays the way a model's are, plus a model's share of small ones) in both
formats, interleaved (their order alternates between repeats), on a local disk and on gs:// (the
GCS emulator on 127.0.0.1), the way the worker saves:

- the save pause: the time the training loop is blocked (the host copy's dispatch);
- the commit: from the save's start until the step is committed (durable: each format's own commit);
- the restore: a fresh manager reading the step onto the same mesh (a local step's files evicted
  from the page cache first).

Orbax's fixed cost per save is measured apart, on a state of the same 65 arrays at a few KiB each.

On gs:// OCDBT is measured against the emulator, as ``checkpoint_format: auto`` writes there (the
emulator keeps GCS's object generations and preconditions, which OCDBT's manifest needs: before it
did, tensorstore refused some saves, "Malformed StorageGeneration").  A save that fails anyway is
left out of its repeat and named, and the rows pair only the repeats that measured both; the probe
row says how many tiny OCDBT saves to the emulator committed.  The emulator is one Python process:
its figures rank the formats' request patterns, not GCS's throughput.

Run it alone: ``python -m benchmarks.formats [--size-mib N ...] [--repeats N] [--quick]``.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypedDict

from benchmarks.table import Row, note, over, ratios, row

DEFAULT_SIZES_MIB = (1024, 4096)  # per process: the realistic 1-4 GB
QUICK_MIB = 64
LARGE_ARRAYS = 16
SMALL_ARRAYS = 48  # a model's norms, biases and counters: most of its arrays, almost none of its bytes
TINY_BYTES = 4096
FIXED_SAVES = 5  # saves of the tiny state per format and repeat (the median is the repeat's value)
CHILD_TIMEOUT_S = 3600.0
BUCKET = "rtrain-formats"
MEDIA = ("local", "gcs")
# The memory one size needs, in multiples of the state: the state, its host copy, the restored state
# and a restore's buffers in the measuring process (1.47 GB at most for 256 MiB, JAX's own ~0.5 GB
# included); on gs:// the emulator's copy of the object and its upload's parts too.
MEMORY_FACTOR = {"local": 4.0, "gcs": 6.0}

CHILD = "benchmarks.formats"


class Timing(TypedDict):
    """One save and restore, in seconds: the loop's pause, until committed, the restore; and the save's CPU."""

    pause_s: float
    commit_s: float
    restore_s: float
    cpu_s: float


class SizeResult(TypedDict):
    """One state size: each repeat's timings by ``medium:format``, Orbax's format on each medium, media skipped."""

    size_mib: int
    orbax: dict[str, list[str]]
    runs: list[dict[str, Timing]]
    skipped: dict[str, str]
    error: str
    failures: list[str]


class FormatsResult(TypedDict):
    """The row's result: each size's repeats, Orbax's fixed cost per save, and what OCDBT on the emulator said."""

    sizes: list[SizeResult]
    fixed: list[dict[str, Timing]]
    gcs_ocdbt: str
    error: str


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


def _evict(run_uri: str) -> None:
    """Drop a local run's files from the page cache, so a restore reads the disk (gs:// has nothing to drop)."""
    if run_uri.startswith("gs://"):
        return
    for p in Path(run_uri).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _saver(cfg: Any, fmt: str, step: int) -> tuple[Any, Callable[[Any], Any]]:
    """The manager a save in ``fmt`` goes through and the call that saves ``step`` with it: lean's own manager
    (no run's config chooses lean now), else the run's."""
    import jax

    from training.checkpoint import manager as ckpt
    from training.checkpoint.lean import LeanManager
    from training.checkpoint.resume import DataPosition

    data = DataPosition(next_batch=step)
    if fmt == "lean":
        lean = LeanManager(cfg.run_uri, jax.process_count(), jax.process_index(), cfg.model_dump(mode="json"))
        return lean, lambda s: lean.save(step, s, data)
    orbax = ckpt.checkpoint_manager(cfg, cfg.run_uri)
    return orbax, lambda s: ckpt.save(orbax, step, s, data, cfg)


def _one(root: str, fmt: str, state: Any, step: int) -> Timing:
    """Save ``state`` as ``step`` in ``fmt`` under ``root`` as the worker does, then restore it: seconds of each part.

    The step is deleted afterwards: a few GiB a step, on disk or in the emulator's memory.
    """
    import jax

    from training.checkpoint import manager as ckpt
    from training.config import load_config
    from training.storage import open_store

    orbax = "auto" if fmt == "lean" else fmt  # a lean step is restored by the run's (Orbax's) manager
    cfg = load_config("tiny", None, {"root": root, "run_name": f"fmt-{fmt}", "checkpoint_format": orbax})
    mngr, write = _saver(cfg, fmt, step)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    bg = ckpt.BackgroundSave(abstract, "bench-save")
    bg.snapshot.prepare()
    cpu0, t0 = time.process_time(), time.perf_counter()
    bg.start(write, state)
    pause = time.perf_counter() - t0
    bg.collect()
    ckpt.wait_saved(mngr)
    commit, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    bg.close()
    _evict(cfg.run_uri)
    fresh = ckpt.checkpoint_manager(cfg, cfg.run_uri)
    t1 = time.perf_counter()
    back, _ = ckpt.restore(fresh, step, abstract)
    jax.block_until_ready(back)
    restore = time.perf_counter() - t1
    del back
    open_store(cfg.run_uri).delete("checkpoints")
    return {"pause_s": pause, "commit_s": commit, "restore_s": restore, "cpu_s": cpu}


def orbax_formats(root: str) -> list[str]:
    """The Orbax formats measured against lean under ``root``: OCDBT, and plain zarr too where
    ``checkpoint_format: auto`` writes that (on no root now)."""
    from training.checkpoint.manager import use_ocdbt
    from training.config import load_config

    auto = "ocdbt" if use_ocdbt(load_config("tiny", None, {"root": root, "checkpoint_format": "auto"})) else "zarr"
    return ["ocdbt"] if auto == "ocdbt" else ["ocdbt", auto]


def _attempt(root: str, fmt: str, state: Any, step: int) -> Timing | str:
    """:func:`_one`, or its error's first line where an OCDBT save to the emulator fails (its step removed)."""
    if not root.startswith("gs://") or fmt != "ocdbt":
        return _one(root, fmt, state, step)
    from training.storage import open_store

    try:
        return _one(root, fmt, state, step)
    except Exception as e:  # noqa: BLE001 - reported in the row
        open_store(f"{root}/fmt-{fmt}").delete("checkpoints")
        text = str(e)
        return "Malformed StorageGeneration" if "Malformed StorageGeneration" in text else text.splitlines()[0][:200]


def measure_size(size_mib: int, repeats: int, roots: dict[str, str]) -> SizeResult:
    """Each repeat's timings of each format on each root, at ``size_mib`` per process (after a warm-up save each)."""
    state = _state(size_mib << 20)
    names = {medium: orbax_formats(root) for medium, root in roots.items()}
    result: SizeResult = {"size_mib": size_mib, "orbax": names, "runs": [], "skipped": {}, "error": "", "failures": []}
    step = 0
    for medium, root in roots.items():  # a first save of each kind pays for imports and compiles: not measured
        for fmt in ("lean", *names[medium]):
            step += 1
            _attempt(root, fmt, _state(0, TINY_BYTES), step)
    for r in range(repeats):
        run: dict[str, Timing] = {}
        for medium, root in roots.items():
            order = ["lean", *names[medium]]
            for fmt in order if r % 2 == 0 else order[::-1]:  # drift falls on all
                step += 1
                got = _attempt(root, fmt, state, step)
                if isinstance(got, str):
                    result["failures"].append(f"{medium}:{fmt} repeat {r + 1}: {got}")
                else:
                    run[f"{medium}:{fmt}"] = got
        result["runs"].append(run)
    return result


def measure_fixed(repeats: int, root: str) -> list[dict[str, Timing]]:
    """Orbax's fixed cost per save: the tiny state saved FIXED_SAVES times a repeat in each format (medians)."""
    tiny, step, out = _state(0, TINY_BYTES), 0, []
    for fmt in ("lean", "ocdbt"):  # warm-up
        step += 1
        _one(root, fmt, tiny, step)
    for _ in range(repeats):
        run: dict[str, Timing] = {}
        for fmt in ("lean", "ocdbt"):
            each = []
            for _ in range(FIXED_SAVES):
                step += 1
                each.append(_one(root, fmt, tiny, step))
            med = {
                k: statistics.median(float(t[k]) for t in each) for k in ("pause_s", "commit_s", "restore_s", "cpu_s")
            }
            run[fmt] = {
                "pause_s": med["pause_s"],
                "commit_s": med["commit_s"],
                "restore_s": med["restore_s"],
                "cpu_s": med["cpu_s"],
            }
        out.append(run)
    return out


PROBES = 3


def probe_gcs_ocdbt(root: str) -> str:
    """What saves in OCDBT to the emulator said: how many of PROBES saved and restored, and the first error."""
    errors = []
    for i in range(PROBES):
        try:
            _one(f"{root}-{i}", "ocdbt", _state(0, TINY_BYTES), 1)
        except Exception as e:  # noqa: BLE001 - the answer is the error
            text = str(e)
            errors.append("Malformed StorageGeneration" if "Malformed StorageGeneration" in text else text[:200])
    said = f"{PROBES - len(errors)}/{PROBES} tiny saves committed and restored"
    return said + (f"; the others failed: {errors[0]}" if errors else "")


def child(mode: str, size_mib: int, repeats: int, roots: dict[str, str], out: Path) -> None:
    """The measurement, in a process of its own (its JAX and its memory): JSON written to ``out``."""
    if mode == "fixed":
        doc: Any = {"fixed": measure_fixed(repeats, roots["local"])}
        if "gcs" in roots:
            doc["gcs_ocdbt"] = probe_gcs_ocdbt(roots["gcs"].rstrip("/") + "-probe")
    else:
        doc = measure_size(size_mib, repeats, roots)
    out.write_text(json.dumps(doc))


def available_bytes() -> int:
    """The memory the kernel says is available now (MemAvailable), or 0 where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def media_that_fit(size_mib: int, available: int) -> tuple[list[str], dict[str, str]]:
    """The media a state of ``size_mib`` fits in memory on (:data:`MEMORY_FACTOR`), and why the others are skipped."""
    fit, skipped = [], {}
    for medium in MEDIA:
        need = int(MEMORY_FACTOR[medium] * (size_mib << 20))
        if need <= available:
            fit.append(medium)
        else:
            skipped[medium] = f"needs about {need / 2**30:.1f} GiB of memory, {available / 2**30:.1f} GiB available"
    return fit, skipped


def _run_child(mode: str, size: int, repeats: int, roots: dict[str, str], tmp: Path) -> tuple[Any, str]:
    out = tmp / f"{mode}-{size}.json"
    args = [sys.executable, "-m", CHILD, "--child", mode, str(out), "--size-mib", str(size), "--repeats", str(repeats)]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    try:
        proc = subprocess.run(
            [*args, "--roots", json.dumps(roots)], env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {CHILD_TIMEOUT_S:.0f} s"
    if proc.returncode != 0 or not out.exists():
        lines = [x for x in (proc.stderr or proc.stdout).splitlines() if x.strip()]
        return None, (lines[-1] if lines else f"exit status {proc.returncode}")[:300]
    return json.loads(out.read_text()), ""


def bench_formats(repeats: int, quick: bool = False, sizes_mib: Sequence[int] | None = None) -> dict[str, Any]:
    """The row's result (:class:`FormatsResult`): each size measured in a process of its own, on the media it fits."""
    from training.emulator import gcs_emulator

    sizes = list(sizes_mib or ((QUICK_MIB,) if quick else DEFAULT_SIZES_MIB))
    result: FormatsResult = {"sizes": [], "fixed": [], "gcs_ocdbt": "", "error": ""}
    with tempfile.TemporaryDirectory(prefix="rtrain-formats-") as tmp, gcs_emulator(BUCKET):
        roots = {"local": str(Path(tmp) / "runs"), "gcs": f"gs://{BUCKET}/runs"}
        for size in sizes:
            fit, skipped = media_that_fit(size, available_bytes())
            doc, error = _run_child("size", size, repeats, {m: roots[m] for m in fit}, Path(tmp)) if fit else (None, "")
            empty: SizeResult = {
                "size_mib": size,
                "orbax": {},
                "runs": [],
                "skipped": {},
                "error": error,
                "failures": [],
            }
            got: SizeResult = doc if doc is not None else empty
            got["skipped"] = skipped
            result["sizes"].append(got)
        doc, error = _run_child("fixed", 0, repeats, roots, Path(tmp))
        if doc is None:
            result["error"] = f"fixed cost: {error}"
        else:
            result["fixed"], result["gcs_ocdbt"] = doc["fixed"], doc.get("gcs_ocdbt", "")
    return dict(result)


def bench_fixed(repeats: int) -> tuple[list[dict[str, Timing]], str]:
    """Each format's fixed cost per save on a local disk (:func:`measure_fixed`, in a process of its own); an error."""
    with tempfile.TemporaryDirectory(prefix="rtrain-fixed-") as tmp:
        doc, error = _run_child("fixed", 0, repeats, {"local": str(Path(tmp) / "runs")}, Path(tmp))
    return (list(doc["fixed"]) if doc is not None else []), error


# --- the rows -----------------------------------------------------------------------------------

NAMES = {"lean": "lean", "ocdbt": "OCDBT", "zarr": "zarr"}


def _of(runs: list[dict[str, Any]], key: str, part: str) -> list[float]:
    return [float(r[key][part]) for r in runs]


def _paired(runs: list[dict[str, Any]], a: str, b: str) -> list[dict[str, Any]]:
    """The repeats that measured both ``a`` and ``b`` (a save that failed left its format out of its repeat)."""
    return [r for r in runs if a in r and b in r]


def _theirs(s: dict[str, Any], medium: str) -> list[str]:
    got = s.get("orbax", {}).get(medium, [])
    return [got] if isinstance(got, str) else list(got)


def size_rows(s: dict[str, Any]) -> list[Row]:
    """One size's rows on each medium: lean's commit, restore and pause over each Orbax format's, per repeat."""
    size, out = s["size_mib"], []
    for medium in MEDIA:
        if medium in s.get("skipped", {}):
            out.append(
                note(f"formats:{medium}:{size}", f"formats, {medium} {size} MiB", f"not run: {s['skipped'][medium]}")
            )
            continue
        for n, theirs in enumerate(_theirs(s, medium)):
            lean, other, name = f"{medium}:lean", f"{medium}:{theirs}", NAMES[theirs]
            key = f"formats:{medium}:{size}" + ("" if n == 0 else f":{theirs}")
            runs = _paired(s["runs"], lean, other)
            if not runs:
                failed = [f for f in s.get("failures", []) if f.startswith(other + " ")]
                said = f"not measured: {failed[0]}" if failed else "not measured"
                out.append(note(key, f"lean/{name}, {medium} {size} MiB", said[:200]))
                continue
            for part, label, target in (
                ("commit_s", f"lean/{name} commit, {medium} {size} MiB", "< 1: lean faster"),
                ("restore_s", f"  lean/{name} restore", "< 1: lean faster"),
                ("pause_s", f"  lean/{name} save pause", "(reported)"),
            ):
                scale, unit, digits = (1e3, "ms", 1) if part == "pause_s" else (1.0, "s", 2)
                mine, them = _of(runs, lean, part), _of(runs, other, part)
                text = f"{over(mine, scale, digits)} vs {over(them, scale, digits)} {unit}"
                if part == "commit_s" and len(runs) < len(s["runs"]):
                    text += f" ({len(runs)} of {len(s['runs'])} repeats)"
                out.append(
                    row(key + ("" if part == "commit_s" else f":{part[:-2]}"), label, text, ratios(mine, them), target)
                )
    return out


def _factor(r: float) -> str:
    return f"{1 / r:.1f}x faster" if r < 1 else f"{r:.1f}x slower"


def verdict(sizes: list[dict[str, Any]], medium: str) -> Row | None:
    """Whether lean beats OCDBT on ``medium`` (else the Orbax format measured there): faster to commit and to
    restore at every size measured."""
    parts, wins, name = [], [], ""
    for s in sizes:
        measured = [t for t in _theirs(s, medium) if _paired(s["runs"], f"{medium}:lean", f"{medium}:{t}")]
        if not measured:
            continue
        theirs = measured[0]
        name = NAMES[theirs]
        runs = _paired(s["runs"], f"{medium}:lean", f"{medium}:{theirs}")
        c, r = (
            statistics.median(ratios(_of(runs, f"{medium}:lean", part), _of(runs, f"{medium}:{theirs}", part)))
            for part in ("commit_s", "restore_s")
        )
        wins.append((c < 1, r < 1))
        parts.append(f"{s['size_mib']} MiB against {name}: commit {_factor(c)}, restore {_factor(r)}")
    if not wins:
        return None
    if all(c and r for c, r in wins):
        said = f"lean beats {name}"
    elif not any(c or r for c, r in wins):
        said = f"{name} beats lean"
    else:
        said = f"mixed: neither lean nor {name} wins both at every size"
    return note(f"formats:verdict:{medium}", f"  verdict, {medium}", f"{said} (lean at {'; '.join(parts)})")


def fixed_row(fixed: list[dict[str, Any]], key: str = "formats:fixed") -> Row:
    """Orbax's fixed cost per save: a tiny state's commit in OCDBT against lean's, per repeat."""
    o, lean = _of(fixed, "ocdbt", "commit_s"), _of(fixed, "lean", "commit_s")
    text = (
        f"{over(o, 1e3, 1)} vs lean {over(lean, 1e3, 1)} ms ({over(_of(fixed, 'ocdbt', 'cpu_s'), 1e3, 1)} vs "
        f"{over(_of(fixed, 'lean', 'cpu_s'), 1e3, 1)} ms CPU), {LARGE_ARRAYS + SMALL_ARRAYS + 1} arrays of a few KiB"
    )
    return row(key, "  OCDBT/lean fixed cost per save", text, ratios(o, lean), "(reported)")


def rows(result: dict[str, Any]) -> list[Row]:
    """Each size's rows, then per medium the verdict, then Orbax's fixed cost per save and OCDBT on the emulator."""
    out: list[Row] = []
    for s in result.get("sizes") or []:
        if s.get("error"):
            out.append(
                note(f"formats:{s['size_mib']}", f"formats, {s['size_mib']} MiB", f"not run: {s['error'][:150]}")
            )
        out.extend(size_rows(s))
    for medium in MEDIA:
        v = verdict(result.get("sizes") or [], medium)
        if v is not None:
            out.append(v)
    if result.get("fixed"):
        out.append(fixed_row(result["fixed"]))
    elif result.get("error"):
        out.append(note("formats:fixed", "  fixed cost per save", f"not run: {result['error'][:150]}"))
    if result.get("gcs_ocdbt"):
        out.append(note("formats:gcs_ocdbt", "  OCDBT on the GCS emulator", result["gcs_ocdbt"]))
    if not out:
        out.append(note("formats", "checkpoint formats", "not run"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.formats", description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, action="append", default=None, help="state per process (repeatable)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help=f"a {QUICK_MIB} MiB state")
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument("--roots", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        mode, out = a.child
        child(mode, (a.size_mib or [QUICK_MIB])[0], a.repeats, json.loads(a.roots), Path(out))
        return 0
    if a.repeats < 1 or any(s < 1 for s in a.size_mib or []):
        p.error("--repeats and --size-mib must be at least 1")
    result = bench_formats(a.repeats, a.quick, a.size_mib)
    print(json.dumps(result, indent=2))
    from benchmarks.table import format_row

    for r in rows(result):
        print(format_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
