"""The accelerator row's recovery sequence: a state's floor, a local save with the steps during it, and a restore
with its first step in a fresh process and in a warm standby; one process on the device at a time.

Three processes in turn, as one accelerator host allows (its device belongs to one process at a time):

1. ``train``: trains a few steps of a shape, then measures the floor of moving its state, each part
   at full parallelism: device to host (a leaf a thread), writing it to host memory (a tmpfs,
   one file a thread), reading it back, and host to device (a leaf a thread).  Then saves it
   through the local tier while it keeps training, timing each step during the save against the
   steps before it.  The copy stays for the next two.
   Its agent's check of the copy, in the background between saves, is timed after it.
2. ``fresh``: a new process, as a replacement host's worker started cold: imports, the runtime,
   the step compiled (from the persistent cache the first one filled), the copy checked (its
   agent's verdict, the file unchanged since) and restored, the first step.  Timed from the
   moment it was started.
3. ``standby``: the same, but with imports, the runtime and the compiled step made ready before it
   is told to resume (a byte on its standard input); timed from that moment to its first step.

Run it alone: ``python -m benchmarks.chip_recovery --shape NAME [--dir DIR]``.  On CPU it runs the
shape given (the tests use ``cpu-small``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.table import Row, note, row

STEPS_BEFORE = 5  # steps timed before the save
CHILD_TIMEOUT_S = 900.0


def _setup(shape_name: str, cache: str) -> tuple[Any, Any, dict[str, float]]:
    """The shape's trainer with its step compiled (the persistent cache shared by the sequence); phase times."""
    t0 = time.time()
    from training.elastic.worker.warmup import import_libraries

    import_libraries()  # what a worker imports before it has a round
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from benchmarks.shapes import SHAPES, packed_batch
    from training.checkpoint import local  # noqa: F401 - the restore's own
    from training.mesh import AXES
    from training.tasks import load_task
    from training.trainer import Trainer

    t1 = time.time()
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    dev = jax.devices()[0]
    t2 = time.time()
    shape = SHAPES[shape_name]
    cfg = shape.config()
    if cfg.model.remat == "auto":  # the same policy in every process of the sequence
        cfg = cfg.model_copy(update={"model.remat": "full"})
    trainer = Trainer(cfg.optimizer, Mesh(np.array([dev]).reshape(1, 1, 1), AXES), load_task(cfg))
    trainer.compile()
    batch = trainer.global_batch(packed_batch(shape.batch, shape.seq_len, shape.vocab, shape.doc_len))
    t3 = time.time()
    return trainer, batch, {"imports_s": t1 - t0, "runtime_s": t2 - t1, "compile_s": t3 - t2}


def _timed_steps(trainer: Any, state: Any, batch: Any, n: int) -> tuple[Any, list[float]]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        float(metrics["loss"])
        times.append(time.perf_counter() - t)
    return state, times


def floor(state: Any, directory: Path) -> dict[str, float]:
    """Device to host, write, read and host to device of ``state``, each at full parallelism (seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import numpy as np

    from training.checkpoint.bulk import THREADS

    leaves = jax.tree.leaves(state)
    devices = [next(iter(x.devices())) for x in leaves]
    # An accelerator's transfers run several at a time only from several threads (one call: 7.5 s to the host and
    # 4.7 s back for 6.4 GiB on a TPU v5e host; 8 threads: 5.4 and 0.58 s).
    with ThreadPoolExecutor(THREADS) as pool:
        t = time.perf_counter()
        host = list(pool.map(np.asarray, leaves))
        d2h = time.perf_counter() - t
    groups = [list(range(i, len(host), THREADS)) for i in range(THREADS)]
    files = [directory / f"floor-{i}.bin" for i in range(THREADS)]

    def write(i: int) -> None:
        with open(files[i], "wb") as f:
            for j in groups[i]:
                f.write(host[j].reshape(-1).view(np.uint8).data)

    back = [np.empty_like(h) for h in host]
    for b in back:
        b.reshape(-1).view(np.uint8)[::4096] = 0  # its pages in: the read measures the copy

    def read(i: int) -> None:
        with open(files[i], "rb") as f:
            for j in groups[i]:
                f.readinto(back[j].reshape(-1).view(np.uint8).data)

    with ThreadPoolExecutor(THREADS) as pool:
        t = time.perf_counter()
        list(pool.map(write, range(THREADS)))
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        list(pool.map(read, range(THREADS)))
        read_s = time.perf_counter() - t
    for f in files:
        f.unlink()
    with ThreadPoolExecutor(THREADS) as pool:
        t = time.perf_counter()
        list(pool.map(lambda b, d: jax.block_until_ready(jax.device_put(b, d)), back, devices))
        h2d = time.perf_counter() - t
    return {"d2h_s": d2h, "write_s": write_s, "read_s": read_s, "h2d_s": h2d}


def train(shape: str, directory: Path, cache: str) -> dict[str, Any]:
    """The first process: steady steps, the floor, a local save with the steps during it (its copy left behind)."""
    import jax

    from training.checkpoint import local

    trainer, batch, _ = _setup(shape, cache)
    state = trainer.init()
    state, _ = _timed_steps(trainer, state, batch, 2)  # warm-up
    state, before = _timed_steps(trainer, state, batch, STEPS_BEFORE)
    out: dict[str, Any] = {"state_gib": sum(int(x.nbytes) for x in jax.tree.leaves(state)) / 2**30}
    out.update(floor(state, directory))
    tier = local.LocalTier(directory, 1, trainer.mesh, trainer.abstract)
    if not tier.enabled:
        raise RuntimeError(f"the local tier is off: {tier.reason}")
    tier.prepare_ahead()
    step = STEPS_BEFORE + 2
    data = {"next_batch": step, "global_batch": 1}
    t0 = time.perf_counter()
    pause = tier.save(step, state, data)  # type: ignore[arg-type]
    tier.release(step)
    during: list[float] = []
    while tier.busy() or not during:
        state, times = _timed_steps(trainer, state, batch, 1)
        during += times
    written = time.perf_counter() - t0
    tier.wait()
    tier.close()
    local.describe_new(directory, 1)  # as its agent would, then it checks the copy whole in the background
    t = time.perf_counter()
    problem = local.check_ahead(directory, step)
    if problem:
        raise RuntimeError(problem)
    out["checked_ahead_s"] = time.perf_counter() - t
    out.update(step=step, steps_before_s=before, steps_during_s=during, save_pause_s=pause, save_written_s=written)
    return out


def resume(shape: str, directory: Path, cache: str, step: int, wait: bool) -> dict[str, Any]:
    """A fresh process's (or, ``wait``: a standby's) restore of local copy ``step`` and first step, by phase."""
    started = time.time()
    trainer, batch, phases = _setup(shape, cache)
    import jax

    from training.checkpoint import local

    if wait:  # ready: imports, runtime, compiled step; told to resume by a byte on stdin
        print("ready", flush=True)
        sys.stdin.read(1)
    told = time.time()
    tier = local.LocalTier(directory, 1, trainer.mesh, trainer.abstract)
    problem = tier.check(step)
    if problem:
        raise RuntimeError(problem)
    checked = time.time()
    state, _ = tier.restore(step)
    jax.block_until_ready(state)
    restored = time.time()
    state, metrics = trainer.step(state, batch)
    float(metrics["loss"])
    done = time.time()
    tier.close()
    return {
        **phases,
        "started": started,
        "told": told,
        "check_s": checked - told,
        "restore_s": restored - told,
        "first_step_s": done - restored,
        "done": done,
        "checked_ahead": step in tier.ahead,
    }


def _child(args: list[str], stdin: bool = False) -> tuple[dict[str, Any], float | None]:
    """Run one process of the sequence: its JSON, and (``stdin``: a standby) when it was told to resume."""
    cmd = [sys.executable, "-m", "benchmarks.chip_recovery", *args]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    told = None
    if stdin:
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.kill()
            raise RuntimeError(f"the standby did not get ready: {line!r} {proc.communicate()[1][-500:]}")
        told = time.time()
        proc.stdin.write("x")
        proc.stdin.flush()
    out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{args[0]} failed: {(err.strip().splitlines() or ['?'])[-1][:300]}")
    return json.loads(out.strip().splitlines()[-1]), told


def sequence(shape: str, directory: Path | None = None) -> dict[str, Any]:
    """The three processes in turn on ``shape``; the copy in ``directory`` (default: a tmpfs), removed after."""
    base = directory or (Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir()))
    work = Path(tempfile.mkdtemp(prefix="rtrain-chip-", dir=base))
    cache = str(work / "jax-cache")
    try:
        common = ["--shape", shape, "--dir", str(work / "copy"), "--cache", cache]
        (work / "copy").mkdir()
        trained, _ = _child(["train", *common])
        where = [*common, "--step", str(trained["step"])]
        spawned = time.time()
        fresh, _ = _child(["fresh", *where])
        fresh["total_s"], fresh["python_s"] = fresh["done"] - spawned, fresh["started"] - spawned
        standby, told = _child(["standby", *where], stdin=True)
        assert told is not None
        standby["total_s"] = standby["done"] - told
        return {"shape": shape, "train": trained, "fresh": fresh, "standby": standby}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def rows(r: dict[str, Any]) -> list[Row]:
    """The sequence's rows: the standby's restore against the floor, its time to the first step, the steps while the
    local copy was written; the fresh process's phases."""
    key = f"accelerator:{r['shape']}:recovery"
    if "error" in r:
        return [note(key, "  recovery sequence", f"not measured: {r['error'][:150]}")]
    t, fresh, standby = r["train"], r["fresh"], r["standby"]
    floor_s = t["read_s"] + t["h2d_s"]
    before = statistics.median(t["steps_before_s"])
    during = (t["save_pause_s"] + sum(t["steps_during_s"])) / len(t["steps_during_s"])  # the loop's time, its pause too
    phases = ("python_s", "imports_s", "runtime_s", "compile_s", "restore_s", "first_step_s")
    return [
        row(
            f"{key}:restore",
            "  restore from the local tier / floor",
            f"{standby['restore_s']:.2f} s vs read {t['read_s']:.2f} + to the device {t['h2d_s']:.2f} s "
            f"({t['state_gib']:.2f} GiB)",
            [standby["restore_s"] / floor_s],
            "<= 2",
        ),
        row(
            f"{key}:standby",
            "  warm standby: resume to first step",
            f"{standby['total_s']:.2f} s (restore {standby['restore_s']:.2f}, first step {standby['first_step_s']:.2f})",
            [standby["total_s"]],
            "<= 5 s",
        ),
        row(
            f"{key}:save",
            "  steps while a local copy is written",
            f"{during * 1e3:.0f} vs {before * 1e3:.0f} ms/step before it, the save's pause counted "
            f"({len(t['steps_during_s'])} steps, written in {t['save_written_s']:.1f} s, pause "
            f"{t['save_pause_s'] * 1e3:.0f} ms, the longest step {max(t['steps_during_s']) * 1e3:.0f} ms)",
            [during / before],
            "<= 1.05",
        ),
        note(
            f"{key}:fresh",
            "  a fresh process instead",
            f"{fresh['total_s']:.2f} s: "
            + ", ".join(f"{k[:-2].replace('_', ' ')} {fresh[k]:.2f}" for k in phases)
            + f"; floor: device to host {t['d2h_s']:.2f}, write {t['write_s']:.2f} s; the copy checked ahead by its "
            + f"agent in {t.get('checked_ahead_s', 0.0):.2f} s (restores took its verdict: {standby.get('checked_ahead')})",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chip_recovery", description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="sequence", choices=["sequence", "train", "fresh", "standby"])
    ap.add_argument("--shape", default="", help="a shape of benchmarks.accelerator (default: the device's first)")
    ap.add_argument("--dir", default="", help="where the local copy goes (default: a tmpfs)")
    ap.add_argument("--cache", default="", help=argparse.SUPPRESS)
    ap.add_argument("--step", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.what == "sequence":
        from benchmarks.shapes import CPU_DEFAULT, TPU_DEFAULT
        from training.memfit import accelerator_present

        shape = args.shape or (TPU_DEFAULT if accelerator_present() else CPU_DEFAULT)[0]
        print(json.dumps(sequence(shape, Path(args.dir) if args.dir else None)), flush=True)
        return 0
    directory = Path(args.dir)
    if args.what == "train":
        result = train(args.shape, directory, args.cache)
    else:
        result = resume(args.shape, directory, args.cache, args.step, wait=args.what == "standby")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
