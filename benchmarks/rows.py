"""Each figure's rows, from the measurements its run recorded (one value per repeat, or per run)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from benchmarks import accelerator, at_scale, formats
from benchmarks.recovery import PHASES
from benchmarks.table import Row, note, over, ratios, row

Result = dict[str, Any]


def recovery_rows(rec: Result) -> list[Row]:
    """Lost follower and leader against a cold start; the phases; an unseen mesh; the first step; Ray's trainer."""
    f_s = [x["total_s"] for x in rec["follower"]]
    l_s = [x["total_s"] for x in rec["leader"]]
    colds = rec["cold_starts_s"]
    rows = [
        row(
            "recovery",
            "recovery: lost follower host",
            f"{over(f_s)} s vs cold start {over(colds)} s",
            ratios(f_s, colds),
            "<= 0.5",
        ),
        row(
            "leader",
            "recovery: lost leader host",
            f"{over(l_s)} s vs lost follower {over(f_s)} s",
            ratios(l_s, f_s),
            "<= 1.5",
        ),
    ]
    b = {k: statistics.median(r[k] for r in rec["follower"]) for k in PHASES}
    rows.append(
        note(
            "breakdown",
            "  follower breakdown (median)",
            ", ".join(f"{label} {b[k]:.2f}" for k, label in PHASES.items()) + " s",
        )
    )
    un = rec.get("unseen_mesh")
    if un and "error" in un:
        rows.append(note("unseen_mesh", "recovery onto an unseen mesh", f"not measured: {un['error'][:120]}"))
    elif un:
        ahead = [x["ahead"]["compile_s"] for x in un["runs"]]
        not_ahead = [x["not_ahead"]["compile_s"] for x in un["runs"]]
        hits = sum(bool(x["ahead"]["compile_cached"]) for x in un["runs"])
        rows.append(
            row(
                "unseen_mesh",
                "recovery onto an unseen mesh",
                f"compile {over(ahead)} s (compiled ahead; {hits}/{len(ahead)} cache hits) vs {over(not_ahead)} s (not)",
                ratios(ahead, not_ahead),
                "compile < 0.2 s",
            )
        )
    runs = rec["follower"] + rec["leader"]
    first, steady = [r["first_step_s"] for r in runs], [r["steady_step_s"] for r in runs]
    rows.append(
        row(
            "first_step",
            "first step after a restore",
            f"{over(first)} s vs steady {over(steady, digits=3)} s/step",
            ratios(first, steady),
            "<= 3",
        )
    )
    ray = rec.get("ray")
    if ray and "error" in ray:
        rows.append(note("ray", "recovery vs Ray Train v2", f"not measured: {ray['error'][:120]}"))
    elif ray:
        theirs = [x["recovery_s"] for x in ray["runs"]]
        ours = f_s[: len(theirs)]
        rows.append(
            row(
                "ray",
                "recovery vs Ray Train v2",
                f"{over(ours)} s vs {over(theirs)} s ({ray['runs'][0].get('trainer')})",
                ratios(ours, theirs),
                "< 1",
            )
        )
    return rows


def checkpoint_rows(c: Result) -> list[Row]:
    """Step time with saves every K against none (the default format; in results from before lean's retirement,
    the other format beside it); a save's pause against its copy's bound; each format's fixed cost per save."""
    base, fmt = c["step_s_without"], c.get("format", "lean")
    at = f"{c.get('preset', 'tiny')}, {over(base, 1e3, 0)} ms/step"
    rows = [
        row(
            f"every_{every}",
            f"checkpoint every {every} ({fmt}) / none",
            f"{over(v['step_s'], 1e3)} vs {over(base, 1e3)} ms/step ({at})",
            ratios(v["step_s"], base),
            "<= 1.03" if int(every) >= 20 else "<= 1.10",
        )
        for every, v in c["per_k"].items()
    ]
    o = c.get("other") or ({**c["orbax"], "format": "ocdbt"} if c.get("orbax") else None)  # (earlier results)
    if o:
        rows.append(
            row(
                "other_format",
                f"  every {o['every']} in {o['format']} / none",
                f"{over(o['step_s'], 1e3)} vs {over(base, 1e3)} ms/step",
                ratios(o["step_s"], base),
                "(reported)",
            )
        )
    if min(base) < c.get("realistic_step_s", 0.0):
        rows.append(
            note("short_step", "  step time", f"{over(base, 1e3, 0)} ms: below {c['realistic_step_s'] * 1e3:.0f} ms")
        )
    if c.get("save_pause_s"):
        p, b = c["save_pause_s"], c["copy_bound_s"]
        rows.append(
            row(
                "save_pause",
                "  save pause / copy bound",
                f"{over(p, 1e3)} vs {over(b, 1e3)} ms per save",
                ratios(p, b),
                "(reported)",
            )
        )
    if c.get("fixed"):
        rows.append(formats.fixed_row(c["fixed"], "orbax_fixed"))
    elif c.get("fixed_error"):
        rows.append(note("orbax_fixed", "  fixed cost per save", f"not measured: {c['fixed_error'][:150]}"))
    return rows


def cost_rows(k: Result) -> list[Row]:
    """The engine against the plain loop given the same wait (the figure); the weaker baselines beneath it."""
    engine, polled = k["engine_tokens_per_s"], k["plain_polled_tokens_per_s"]

    def against(key: str, figure: str, mine: list[float], theirs: list[float], target: str = "(reported)") -> Row:
        return row(
            key, figure, f"{over(mine, digits=0)} vs {over(theirs, digits=0)} tok/s", ratios(mine, theirs), target
        )

    flops, peak = k["model_flops_per_token"], k["matmul_flops_per_s"]
    devices = k["devices"]
    judged = (
        [
            note(
                "judged_at",
                "  judged at",
                f"the {k['preset']} preset: {statistics.median(k['step_s']) * 1e3:.0f} ms/step "
                f"(>= {k['realistic_step_s'] * 1e3:.0f} ms), a save every 10",
            )
        ]
        if k.get("step_s")
        else []
    )
    tiny = (
        [
            against(
                "tiny",
                "  the tiny model (~65 ms steps)",
                k["tiny_engine_tokens_per_s"],
                k["tiny_plain_polled_tokens_per_s"],
            )
        ]
        if k.get("tiny_engine_tokens_per_s")
        else []
    )
    return [
        against("cost", "cost of resilience", engine, polled, ">= 0.95"),
        *judged,
        *tiny,
        against("without_saves", "  engine without saves", k["engine_without_saves_tokens_per_s"], polled),
        against(
            "first_steps",
            "  a round's first steps",
            k["engine_first_steps_tokens_per_s"],
            k["plain_first_steps_tokens_per_s"],
        ),
        against("jax_wait", "  weaker baseline: JAX's wait", engine, k["plain_tokens_per_s"], "(weaker baseline)"),
        against("as_is", "  weaker baseline: gloo as is", engine, k["plain_as_is_tokens_per_s"], "(weaker baseline)"),
        row(
            "per_device",
            "  Llama tok/s per device",
            f"{over([x / devices for x in engine], digits=0)} vs plain loop {over([x / devices for x in polled], digits=0)}",
            ratios(engine, polled),
            ">= 0.95",
        ),
        row(
            "mfu",
            "  model FLOPs utilisation",
            f"{flops / 1e6:.2f} MFLOP/token vs matmul {peak / 1e9:.1f} GFLOP/s",
            [x * flops / peak for x in engine],
            "(reported)",
        ),
    ]


def restore_rows(s: Result) -> list[Row]:
    """Restore against a raw read of the same files: onto one device, a worker's, tensorstore alone (in results from
    before lean's retirement the figure is lean's, Orbax's format beside it)."""
    raw = s["raw_read_MBps"]
    pairs = [
        ("restore", "restore / raw read", s["restore_MBps"], raw, s["target"]),
        ("worker", "  a worker's restore / raw", s["worker_restore_MBps"], raw, "(reported)"),
    ]
    ts = s["tensorstore_alone_MBps"]
    if "orbax_restore_MBps" in s:
        oraw = s["orbax_raw_read_MBps"]
        pairs.append(("orbax", "  Orbax's format: restore / raw", s["orbax_restore_MBps"], oraw, "(reported)"))
        pairs.append(("tensorstore", "  Orbax's format: tensorstore alone / raw", ts, oraw, "(reported)"))
    else:
        pairs.append(("tensorstore", "  tensorstore alone / raw", ts, raw, "(reported)"))
    return [row(key, fig, f"{over(a)} vs {over(b)} MB/s", ratios(a, b), t) for key, fig, a, b, t in pairs]


def local_tier_rows(lt: Result) -> list[Row]:
    """Steps lost to a lost host with local copies and without (the figure); their step-time cost; a preemption notice."""
    with_local, without = lt["step_s_with_local"], lt["step_s_without"]
    lost, persistent = lt["steps_lost_with_local"], lt["steps_lost_persistent_only"]
    n = lt["notice"]
    return [
        row(
            "steps_lost",
            "steps lost / local interval",
            f"{over(lost)} steps (every 2); persistent only (every 10) {over(persistent)}",
            [x / 2 for x in lost],
            lt["target"],
        ),
        row(
            "overhead",
            "local copies every 2 / none",
            f"{over(with_local, 1e3)} vs {over(without, 1e3)} ms/step",
            ratios(with_local, without),
            lt["overhead_target"],
        ),
        note(
            "notice",
            "  preemption notice",
            f"steps lost {[x['steps_lost'] for x in n]}, committed {over([x['commit_s'] for x in n])} s after the SIGTERM",
        ),
    ]


def service_rows(sv: Result) -> list[Row]:
    """The ETA of a job shrunk and grown back against its real end; a priority change to the hosts freed."""
    runs = sv["runs"]
    predicted, actual = [x["eta_predicted_s"] for x in runs], [x["eta_actual_s"] for x in runs]
    freed, bound = [x["priority_to_hosts_freed_s"] for x in runs], [x["hosts_moved_bound_s"] for x in runs]
    first = [x["priority_to_first_step_s"] for x in runs]
    return [
        row(
            "eta",
            "service: ETA error (shrunk, grown)",
            f"predicted {over(predicted, digits=1)} s vs actual {over(actual, digits=1)} s after the change",
            [x["eta_error"] for x in runs],
            sv["target"],
        ),
        row(
            "moved",
            "  priority change -> hosts freed",
            f"{over(freed)} s vs interval + commit {over(bound)} s (other job's first step {over(first, digits=1)} s)",
            ratios(freed, bound),
            sv["moved_target"],
        ),
        *_cold_service_row(sv.get("cold")),
    ]


def _cold_service_row(cold: Result | None) -> list[Row]:
    """The uncounted first run's ETA error (an empty compile cache), where the result has one."""
    if cold is None:
        return []
    return [
        row(
            "eta_cold",
            "  ETA error, first run (fills the compile cache)",
            f"predicted {cold['eta_predicted_s']:.1f} s vs actual {cold['eta_actual_s']:.1f} s",
            [cold["eta_error"]],
            "(not counted)",
        )
    ]


def control_plane_rows(cp: Result) -> list[Row]:
    """Storage requests per host per minute, counted against the cadence's model, on each root; the budget."""
    rows = []
    for kind in ("local", "gcs"):
        runs = [x[kind] for x in cp["runs"]]
        a, b = [x["measured"]["class_a"] for x in runs], [x["measured"]["class_b"] for x in runs]
        mod = runs[0]["model"]
        rows.append(
            row(
                f"control_plane_{kind}",
                f"control plane, {kind} root",
                f"{over(a, digits=0)} A + {over(b, digits=0)} B vs model {mod['class_a']:.0f} A + "
                f"{mod['class_b']:.0f} B req/host/min",
                [x["ratio"] for x in runs],
                cp["target"],
            )
        )
    for n, b in cp["budget"].items():
        rows.append(
            note(
                f"budget_{n}",
                f"  budget, {n} hosts on gs://",
                f"{b['class_a']:.0f} A + {b['class_b']:.0f} B req/host/min (heartbeat {b['heartbeat_s']:.0f} s; "
                f"{b['class_a_per_day'] / 1e6:.1f} M class A a day)",
            )
        )
    return rows


def generic_rows(name: str, r: Result) -> list[Row]:
    """A figure with no rows of its own in :data:`ROWS`: its ``ratios`` (one per repeat; else its one
    ``ratio``) against its ``target``."""
    values = r.get("ratios") or [float(r["ratio"])]
    return [row(name, name, str(r.get("measured", "")), values, str(r.get("target", "")))]


# Each figure's rows, by the figure's name in ``bench.FIGURES`` (a figure registers its builder here).
ROWS: dict[str, Callable[[Result], list[Row]]] = {
    "recovery": recovery_rows,
    "checkpoint_overhead": checkpoint_rows,
    "cost_of_resilience": cost_rows,
    "restore_throughput": restore_rows,
    "local_tier": local_tier_rows,
    "service": service_rows,
    "control_plane": control_plane_rows,
    "accelerator": accelerator.rows,
    "formats": formats.rows,
    "recovery_at_scale": at_scale.rows,
}


def rows_of(name: str, r: Result) -> list[Row]:
    """The rows of figure ``name`` from its result (a figure not in :data:`ROWS` gives its ``ratios``)."""
    build = ROWS.get(name)
    return build(r) if build is not None else generic_rows(name, r)
