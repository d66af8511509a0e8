"""The bench's accelerator row: the built-in Llama trained through the engine's ``Trainer`` on this JAX backend.

On whatever backend JAX finds it compiles the step, times it (median, min and max over the
repeats), counts tokens/s and MFU against the device kind's peak bf16 FLOP/s (``unknown`` for a
kind not in :data:`PEAK_BF16_TFLOPS`), reads the device's peak memory against the compiled
step's own estimate, and times the save pause and the restore of the device-resident state to
and from local disk (the local checkpoint tier's code).  On a TPU the shapes fill one chip: our
own ~1B Llama 3, and the published Llama 3.2 1B as its preset gives it (``llama3.2-1b``: heads of
width 64, a 128,256-token vocabulary, tied embeddings), with the preset's own attention and remat
(``auto``: the remat policy is chosen on the chip from the compiled steps, and the row says which
and why); on CPU it runs a small shape and says it is CPU.  One process, no sockets: the figures
are the step's, not the elastic job's.

Run it alone: ``python -m benchmarks.accelerator [--shape NAME ...] [--repeats N] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from benchmarks.shapes import CPU_DEFAULT, SHAPES, TPU_DEFAULT, Shape, packed_batch
from benchmarks.table import Row, note, over, row
from training.memfit import accelerator_present

if TYPE_CHECKING:
    from training.config import Config

# Peak dense bf16 FLOP/s per chip (TPU) or per GPU, in TFLOP/s, by a piece of the device kind JAX reports
# (most specific first: "TPU v5 lite" is a v5e, "TPU v5" a v5p).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("tpu v6 lite", 918.0),
    ("tpu v6e", 918.0),
    ("tpu v5 lite", 197.0),
    ("tpu v5e", 197.0),
    ("tpu v5p", 459.0),
    ("tpu v5", 459.0),
    ("tpu v4", 275.0),
    ("gb200", 2500.0),
    ("b200", 2250.0),
    ("h200", 989.0),
    ("h100", 989.0),
    ("a100", 312.0),
    ("l40s", 362.0),
    ("l4", 121.0),
    ("a10g", 70.0),
)
MFU_TARGET = 0.60  # on a TPU v5e, a ~1B Llama 3 at seq 2048 and 8192 (issue 50)
GIB = 2**30
CHILD_TIMEOUT_S = 900.0


def peak_tflops(device_kind: str) -> float | None:
    """The device kind's peak bf16 TFLOP/s, or None where the table does not know it."""
    kind = device_kind.lower()
    return next((v for k, v in PEAK_BF16_TFLOPS if k in kind), None)


@dataclass
class Measured:
    """One shape's figures on this device (``error``: why it did not run, e.g. out of memory)."""

    shape: str
    platform: str
    device_kind: str
    params: int = 0
    flops_per_token: float = 0.0
    compile_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # one per repeat (mean over its steps)
    tokens_per_s: float = 0.0  # at the median step
    mfu: float | None = None  # at the median step; None: the device kind's peak is unknown
    peak_tflops: float | None = None
    # The device's own peak: buffers in use plus what the runtime reserved for the program's temporaries
    # (a TPU's runtime reports those apart); None: the device does not say.
    device_peak_gib: float | None = None
    # The compiled step's estimate: on an accelerator XLA's peak where reported, else arguments + outputs -
    # aliased + temporaries + code.
    compiled_gib: float = 0.0
    compiled_peak_gib: float = 0.0  # XLA's own peak of the compiled step, where it reports one
    estimate_error: float | None = None  # compiled estimate / device peak - 1
    save_pause_s: float | None = None  # the loop blocked while the state's host copy was dispatched
    save_write_s: float | None = None  # the copy written to local disk and finalised
    restore_s: float | None = None  # read back onto the device
    state_gib: float = 0.0
    device_stats: dict[str, int] = field(default_factory=dict)  # the device's memory_stats() after the steps
    remat: str = ""  # the policy the step ran with (a preset's auto: the one chosen on this device)
    attention: str = ""  # the kernel auto gave (or the one forced)
    remat_reason: str = ""  # remat auto: why that policy
    error: str = ""

    def median_step(self) -> float:
        return statistics.median(self.step_s) if self.step_s else 0.0


def _compiled_bytes(compiled: Any) -> int:
    stats = compiled.memory_analysis()
    if stats is None:
        return 0
    live = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    return int(live + stats.temp_size_in_bytes + stats.generated_code_size_in_bytes)


def measure(shape: Shape, steps: int, repeats: int, save: bool = True) -> Measured:
    """Compile, run and time one shape on this process's first device; a failure is the row's ``error``."""
    import jax

    dev = jax.devices()[0]
    out = Measured(shape.name, dev.platform, dev.device_kind)
    try:
        _measure(shape, steps, repeats, save, out)
    except Exception as e:  # noqa: BLE001 - out of memory, a kernel that does not lower: the row says so
        out.error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
    return out


def _measure(shape: Shape, steps: int, repeats: int, save: bool, out: Measured) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from benchmarks.cost import model_flops_per_token
    from training.mesh import AXES
    from training.models.attention import resolve
    from training.tasks import load_task
    from training.trainer import Trainer

    dev = jax.devices()[0]
    cfg, out.remat_reason = resolve_remat(shape.config(), dev)
    out.remat = cfg.model.remat
    out.attention = resolve(cfg.model.attention, cfg.model.seq_len, cfg.model.head_dim)
    mesh = Mesh(np.array([dev]).reshape(1, 1, 1), AXES)
    trainer = Trainer(cfg.optimizer, mesh, load_task(cfg))
    out.flops_per_token = model_flops_per_token(cfg.model)
    out.peak_tflops = peak_tflops(dev.device_kind) if dev.platform != "cpu" else None
    t0 = time.perf_counter()
    compiled = trainer.compile()
    out.compile_s = time.perf_counter() - t0
    out.compiled_gib = _compiled_bytes(compiled) / GIB
    out.compiled_peak_gib = int(getattr(compiled.memory_analysis(), "peak_memory_in_bytes", 0) or 0) / GIB
    if dev.platform != "cpu" and out.compiled_peak_gib:  # XLA's own peak: what memfit uses on an accelerator
        out.compiled_gib = out.compiled_peak_gib
    state = trainer.init()
    out.params = sum(int(x.size) for x in jax.tree.leaves(state["params"]))
    out.state_gib = sum(int(x.nbytes) for x in jax.tree.leaves(state)) / GIB
    batch = trainer.global_batch(packed_batch(shape.batch, shape.seq_len, shape.vocab, shape.doc_len))
    for _ in range(2):  # warm-up
        state, metrics = trainer.step(state, batch)
    jax.block_until_ready(metrics["loss"])
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            state, metrics = trainer.step(state, batch)
        jax.block_until_ready((state, metrics["loss"]))
        out.step_s.append((time.perf_counter() - t0) / steps)
    if not np.isfinite(float(metrics["loss"])):
        raise FloatingPointError(f"the loss is {float(metrics['loss'])}")
    out.tokens_per_s = shape.batch * shape.seq_len / out.median_step()
    if out.peak_tflops:
        out.mfu = out.tokens_per_s * out.flops_per_token / (out.peak_tflops * 1e12)
    stats = dev.memory_stats() or {}
    out.device_stats = {k: int(v) for k, v in stats.items() if isinstance(v, int)}
    if stats.get("peak_bytes_in_use"):
        out.device_peak_gib = (stats["peak_bytes_in_use"] + stats.get("peak_bytes_reserved", 0)) / GIB
        out.estimate_error = out.compiled_gib / out.device_peak_gib - 1.0
    if save:
        _save_restore(trainer, state, steps * repeats + 2, out)


def resolve_remat(cfg: Config, dev: Any) -> tuple[Config, str]:
    """``remat: auto`` chosen on ``dev`` itself (this process holds it): the policy with the fewest FLOPs whose
    compiled step fits 90% of the device's own memory (the config's ``device_memory_gib`` where it reports none);
    its reason too.  Any other policy as it is, with no reason."""
    from training.rematfit import walk

    if cfg.model.remat != "auto":
        return cfg, ""
    limit = int((dev.memory_stats() or {}).get("bytes_limit", 0)) if dev.platform != "cpu" else 0
    if limit:
        cfg = cfg.model_copy(update={"placement.device_memory_gib": limit / GIB})
    choice = walk(cfg, 1, device=dev.platform != "cpu")
    return cfg.model_copy(update={"model.remat": choice.policy}), choice.reason()


def _save_restore(trainer: Any, state: Any, step: int, out: Measured) -> None:
    """Save the state through the local tier to a local temporary directory, drop it, and restore it."""
    import jax

    from training.checkpoint.local import LocalTier

    data = {"next_batch": step, "examples_consumed": 0, "global_batch": 1, "seed": 0, "dataset": "-", "lr_scale": 1.0}
    with tempfile.TemporaryDirectory(prefix="rtrain-accel-") as tmp:
        tier = LocalTier(Path(tmp), 1, trainer.mesh, trainer.abstract)
        if not tier.enabled:
            out.error = f"local tier off: {tier.reason}"
            return
        t0 = time.perf_counter()
        out.save_pause_s = tier.save(step, state, data)  # type: ignore[arg-type]
        tier.release(step)
        tier.wait()
        out.save_write_s = time.perf_counter() - t0
        jax.tree.map(lambda x: x.delete(), state)  # the restore needs the device memory the state held
        t0 = time.perf_counter()
        restored, _ = tier.restore(step)
        jax.block_until_ready(restored)
        out.restore_s = time.perf_counter() - t0
        tier.close()


def _child(name: str, repeats: int, quick: bool, save: bool) -> dict[str, Any]:
    """One shape measured in a process of its own (its peak memory is its own); its row as a dict."""
    cmd = [sys.executable, "-m", "benchmarks.accelerator", "--child", name, "--repeats", str(repeats)]
    cmd += ["--quick"] * quick + ["--save"] * save
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    lines = proc.stdout.strip().splitlines()
    try:
        return cast(dict[str, Any], json.loads(lines[-1]))
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return asdict(Measured(name, "?", "?", error=f"the measuring process failed: {tail[:300]}"))


def bench_accelerator(
    repeats: int, quick: bool = False, names: tuple[str, ...] = (), out: Path | None = None, recovery: bool = True
) -> dict[str, Any]:
    """The bench's row: each shape measured in a process of its own (the device's default shapes when none
    are named), the first one's save and restore too, and (``recovery``) its recovery sequence; written to
    ``out`` after each shape when given."""
    names = names or (TPU_DEFAULT if accelerator_present() else CPU_DEFAULT)
    result: dict[str, Any] = {"platform": "?", "device_kind": "?", "rows": [], "ratio": 0.0, "target": ""}
    for i, name in enumerate(names):
        row = _child(name, repeats, quick, save=i == 0)
        result["rows"].append(row)
        if row["platform"] != "?":
            result["platform"], result["device_kind"] = row["platform"], row["device_kind"]
        mfus = [r["mfu"] for r in result["rows"] if r["mfu"] is not None]
        result["ratio"] = max(mfus, default=0.0)
        on_tpu = result["platform"] == "tpu"
        result["target"] = f">= {MFU_TARGET:.2f} MFU on a TPU v5e" if on_tpu else "none off a TPU (a smoke run)"
        if out is not None:
            out.write_text(json.dumps(result, indent=2))
    if recovery:
        result["recovery"] = _recovery(names[0])
        if out is not None:
            out.write_text(json.dumps(result, indent=2))
    return result


def _recovery(shape: str) -> dict[str, Any]:
    """The recovery sequence (``benchmarks/chip_recovery.py``) on ``shape``; its error, where it failed."""
    from benchmarks.chip_recovery import sequence

    try:
        return sequence(shape)
    except Exception as e:  # noqa: BLE001 - out of memory, a failed child: the row says so
        return {"shape": shape, "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"}


def check_kernel(seq_len: int = 1024, head_dim: int = 128) -> dict[str, float | str]:
    """The largest differences of the kernel ``auto`` picks from the reference einsums, forward and gradients,
    on packed documents with grouped-query heads of width ``head_dim`` (fp32, highest matmul precision)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from training.models.attention import attention, resolve

    b, h, kv, d = 2, 8, 4, head_dim
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, seq_len, n, d)), jnp.float32) for n in (h, kv, kv))
    seg = jnp.asarray(packed_batch(b, seq_len, 8, seq_len // 5)["segment_ids"])
    w = jnp.asarray(rng.normal(size=(d,)), jnp.float32)

    def run(impl: str) -> Any:
        def f(q: Any, k: Any, v: Any) -> Any:
            return (attention(q, k, v, seg, impl=impl) * w).sum()

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)

    with jax.default_matmul_precision("highest"):
        (y1, g1), (y2, g2) = run("auto"), run("reference")
    out: dict[str, float | str] = {"kernel": resolve("auto", seq_len, d), "head_dim": d, "loss": float(abs(y1 - y2))}
    out.update({f"d{n}": float(jnp.max(jnp.abs(a - r))) for n, a, r in zip("qkv", g1, g2, strict=True)})
    return out


def rows(result: dict[str, Any]) -> list[Row]:
    """The bench's rows: per shape, its MFU over the repeats against the target (where the device kind's peak is
    known; on CPU or an unknown kind each repeat's step time over the median), then its memory and save figures."""
    out: list[Row] = []
    for r in result["rows"]:
        key, fig = f"accelerator:{r['shape']}", f"accelerator {r['shape']}"
        if not r["step_s"]:
            out.append(note(key, fig, f"not run: {r['error'][:150]}"))
            continue
        st, med = r["step_s"], statistics.median(r["step_s"])
        measured = f"{over(st, digits=3)} s/step, {r['tokens_per_s']:,.0f} tok/s"
        if r["mfu"] is not None:
            mfus = [r["flops_per_token"] * r["tokens_per_s"] * med / s / (r["peak_tflops"] * 1e12) for s in st]
            out.append(row(key, fig, f"{measured}, MFU", mfus, f">= {MFU_TARGET:.2f} MFU (TPU v5e, ~1B)"))
        else:
            kind = "CPU: no MFU" if r["platform"] == "cpu" else f"{r['device_kind']}: peak unknown, no MFU"
            out.append(row(key, fig, f"{measured} ({kind})", [s / med for s in st], "step / median step"))
        mem = f"{r['device_peak_gib']:.2f}" if r["device_peak_gib"] is not None else "?"
        text = f"memory {mem} GiB (device) vs {r['compiled_gib']:.2f} GiB (compiled)"
        if r["restore_s"] is not None:
            text += (
                f"; save pause {r['save_pause_s']:.3f} s, written {r['save_write_s']:.1f} s, "
                f"restore {r['restore_s']:.1f} s ({r['state_gib']:.2f} GiB)"
            )
        out.append(note(f"{key}:memory", "", text))
        if r.get("remat_reason"):
            out.append(note(f"{key}:remat", "", r["remat_reason"]))
    if result.get("recovery"):
        from benchmarks.chip_recovery import rows as recovery_rows

        out += recovery_rows(result["recovery"])
    return out or [note("accelerator", "accelerator", "no shape measured")]


def table_lines(result: dict[str, Any]) -> list[str]:
    """The row's lines for the bench's table: one per shape."""
    lines = [f"accelerator: {result['platform']} ({result['device_kind']}); step s median [min..max]"]
    for r in result["rows"]:
        if r["error"] and not r["step_s"]:
            lines.append(f"  {r['shape']:<24} not run: {r['error'][:110]}")
            continue
        st = r["step_s"]
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "unknown peak" if r["platform"] != "cpu" else "n/a (CPU)"
        mem = f"{r['device_peak_gib']:.2f}" if r["device_peak_gib"] is not None else "?"
        kernels = f" ({r['attention']}, remat {r['remat']})" if r.get("remat") else ""
        line = (
            f"  {r['shape']:<24} {statistics.median(st):.3f} [{min(st):.3f}..{max(st):.3f}] s{kernels}, "
            f"{r['tokens_per_s']:,.0f} tok/s, MFU {mfu}; memory {mem} GiB vs compiled {r['compiled_gib']:.2f} GiB"
        )
        if r["restore_s"] is not None:
            line += f"; save pause {r['save_pause_s']:.3f} s, write {r['save_write_s']:.1f} s, "
            line += f"restore {r['restore_s']:.1f} s ({r['state_gib']:.2f} GiB)"
        lines.append(line)
        if r.get("remat_reason"):
            lines.append(f"    {r['remat_reason']}")
    if result.get("recovery"):
        from benchmarks.chip_recovery import rows as recovery_rows

        lines += [f"  {x['figure'].strip()}: {x['measured']}" for x in recovery_rows(result["recovery"])]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.accelerator", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=[], choices=sorted(SHAPES), help="shapes (repeatable)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="", help="write the row's JSON here (after each shape)")
    ap.add_argument("--child", default="", choices=["", *sorted(SHAPES)], help=argparse.SUPPRESS)
    ap.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--check-kernel", action="store_true", help="compare the attention kernel with the reference")
    ap.add_argument("--no-recovery", action="store_true", help="leave out the recovery sequence (chip_recovery)")
    args = ap.parse_args(argv)
    if args.check_kernel:  # Llama 3 8B's heads (128) and Llama 3.2 1B's (64)
        print(json.dumps([check_kernel(head_dim=d) for d in (128, 64)]), flush=True)
        return 0
    if args.child:  # one shape, in this process: its row as one line of JSON
        import jax

        steps = 3 if args.quick or jax.devices()[0].platform == "cpu" else 10
        print(json.dumps(asdict(measure(SHAPES[args.child], steps, args.repeats, args.save))), flush=True)
        return 0
    out = Path(args.out) if args.out else None
    result = bench_accelerator(args.repeats, args.quick, tuple(args.shape), out, recovery=not args.no_recovery)
    print("\n".join(table_lines(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
