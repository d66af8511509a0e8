"""``rtrain bench`` as the README shows it: each figure a ratio of two measurements from the same run.

The bench writes under ``var/bench`` of its working directory, so each test runs it in its own
temporary directory.  The figures are measured, never asserted against a target: what is checked
is that a figure is what its JSON says it is (the ratio of the medians of its own repeats), and that
the table prints it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench, jobs
from benchmarks.rows import ROWS, generic_rows
from benchmarks.table import Row, Spread, find, format_row, note, ratios, spread

RTRAIN = str(Path(sys.executable).parent / "rtrain")


def _median_ratio(a: list[float], b: list[float]) -> float:
    """The figure's ratio: the median of each repeat's own ratio."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _line(table: str, figure: str) -> str:
    """The table's line of ``figure`` (its name starts the line)."""
    return next(line for line in table.splitlines() if line.strip().startswith(figure.strip()))


def _ratio(rows: list[Row], key: str) -> Spread:
    """Row ``key``'s ratio (a row with one)."""
    ratio = find(rows, key)["ratio"]
    assert ratio is not None, key
    return ratio


def _spread_text(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}..{max(values):.3f}]"


def test_each_row_s_ratio_is_the_median_minimum_and_maximum_of_its_repeats() -> None:
    engine, polled = [1000.0, 900.0, 1100.0], [1000.0, 1000.0, 1050.0]
    plain, as_is = [800.0, 850.0, 900.0], [700.0, 650.0, 900.0]
    result = {
        "devices": 4,
        "model_flops_per_token": 1e6,
        "matmul_flops_per_s": 2e10,
        "engine_tokens_per_s": engine,
        "engine_without_saves_tokens_per_s": [1010.0, 920.0, 1090.0],
        "plain_polled_tokens_per_s": polled,
        "plain_tokens_per_s": plain,
        "plain_as_is_tokens_per_s": as_is,
        "engine_first_steps_tokens_per_s": [500.0, 600.0, 700.0],
        "plain_first_steps_tokens_per_s": [550.0, 560.0, 570.0],
        "preset": "small",
        "step_s": [0.31, 0.3, 0.29],
        "realistic_step_s": 0.25,
        "tiny_engine_tokens_per_s": [800.0, 810.0, 790.0],
        "tiny_plain_polled_tokens_per_s": [1000.0, 1000.0, 1000.0],
    }
    r = bench.summarise("cost_of_resilience", result, steal=0.02)
    each = [e / p for e, p in zip(engine, polled, strict=True)]
    # The headline: the engine against the plain loop given the same wait, each repeat's ratio summarised.
    assert r["table_rows"][0]["key"] == "cost" and r["target"] == ">= 0.95"
    assert r["ratio"] == {"median": statistics.median(each), "min": min(each), "max": max(each), "values": each}
    # The weaker baselines come beneath it, marked as such.
    weaker = [x for x in r["table_rows"] if x["target"] == "(weaker baseline)"]
    assert [x["key"] for x in weaker] == ["jax_wait", "as_is"] and r["table_rows"].index(weaker[0]) > 0
    assert _ratio(r["table_rows"], "jax_wait")["max"] == max(e / p for e, p in zip(engine, plain, strict=True))
    assert _ratio(r["table_rows"], "mfu")["min"] == pytest.approx(min(engine) * 1e6 / 2e10)
    table = bench.format_table({"repeats": 3, "cost_of_resilience": json.loads(json.dumps(r))})
    assert "repeats: 3" in table and "cost_of_resilience 2%" in table
    assert f"{_spread_text(each)}  >= 0.95" in _line(table, "cost of resilience")
    # The measured column: each side's median [min..max] over the repeats.
    assert "1000 [900..1100] vs 1000 [1000..1050] tok/s" in _line(table, "cost of resilience")
    # Judged at a realistic step, which the figure names; the tiny model's shorter steps reported beneath it.
    assert "the small preset: 300 ms/step (>= 250 ms), a save every 10" in _line(table, "judged at")
    assert _ratio(r["table_rows"], "tiny")["median"] == 0.8 and r["table_rows"][2]["target"] == "(reported)"


def test_a_figure_measured_once_a_repeat_reports_each_repeat_and_unpaired_repeats_are_refused() -> None:
    runs = [
        {
            "eta_error": e,
            "eta_predicted_s": p,
            "eta_actual_s": a,
            "priority_to_hosts_freed_s": f,
            "hosts_moved_bound_s": 2.0,
            "priority_to_first_step_s": 6.0,
        }
        for e, p, a, f in ((0.05, 21.0, 20.0, 1.0), (0.2, 24.0, 20.0, 1.5), (0.1, 22.0, 20.0, 0.5))
    ]
    r = bench.summarise("service", {"runs": runs, "target": "<= 0.15", "moved_target": "<= 1.0"}, steal=None)
    assert r["ratio"]["values"] == [0.05, 0.2, 0.1] and r["ratio"]["median"] == 0.1 and r["ratio"]["max"] == 0.2
    assert _ratio(r["table_rows"], "moved")["values"] == [0.5, 0.75, 0.25]
    line = _line(bench.format_table({"repeats": 3, "service": r}), "service: ETA error")
    assert "predicted 22.0 [21.0..24.0] s" in line and "0.100 [0.050..0.200]  <= 0.15" in line
    assert "CPU steal" not in bench.format_table({"repeats": 3, "service": r})  # unknown: not printed
    with pytest.raises(ValueError, match="unpaired repeats: 2 against 3"):
        ratios([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="at least one value"):
        spread([])
    with pytest.raises(KeyError, match="no row 'nope'; rows: eta, moved"):
        find(r["table_rows"], "nope")


def test_a_figure_without_rows_of_its_own_reports_its_ratios() -> None:
    assert "a_new_figure" not in ROWS
    r = bench.summarise("a_new_figure", {"ratios": [0.9, 1.2, 1.0], "target": ">= 0.9", "measured": "x vs y"}, 0.0)
    assert r["ratio"]["median"] == 1.0 and r["ratio"]["min"] == 0.9 and r["ratio"]["max"] == 1.2
    assert format_row(r["table_rows"][0]).endswith("1.000 [0.900..1.200]  >= 0.9")
    # A figure's own keys stay as it wrote them beside its table rows; one ratio is a repeat of one.
    one = bench.summarise("a_new_figure", {"ratio": 0.4, "target": ">= 0.5", "rows": [{"shape": "a"}]}, None)
    assert one["rows"] == [{"shape": "a"}] and one["ratio"]["values"] == [0.4] and one["target"] == ">= 0.5"


def _bench(tmp_path: Path, *args: str, timeout: int = 900) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [RTRAIN, "bench", *args, "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=timeout
    )
    return proc, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--only", "restore"], "--only: unknown figure(s) ['restore']; known: recovery, checkpoint_overhead"),
        (["--repeats", "0"], "--repeats must be at least 1, not 0"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path: Path, args: list[str], message: str) -> None:
    proc, results = _bench(tmp_path, *args, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr
    assert not results and not (tmp_path / "var").exists(), "nothing prepared, nothing run"


def _row(figure: dict[str, Any], key: str) -> dict[str, Any]:
    return dict(find(figure["table_rows"], key))


def _check(figure: dict[str, Any], key: str, a: list[float], b: list[float], table: str, target: str) -> float:
    """Row ``key``'s ratio is each repeat's a/b summarised, and the table prints it against ``target``."""
    r = _row(figure, key)
    each = [x / y for x, y in zip(a, b, strict=True)]
    assert r["ratio"]["values"] == pytest.approx(each) and r["ratio"]["median"] == pytest.approx(_median_ratio(a, b))
    assert r["target"] == target and f"{_spread_text(each)}  {target}" in _line(table, r["figure"])
    return float(r["ratio"]["median"])


@pytest.mark.slow
@pytest.mark.extended
def test_checkpoint_overhead_runs_the_small_preset_in_the_default_format(tmp_path: Path) -> None:
    proc, r = _bench(tmp_path, "--quick", "--only", "checkpoint_overhead")
    assert proc.returncode == 0, proc.stderr[-3000:]
    c, table = r["checkpoint_overhead"], proc.stdout
    base = c["step_s_without"]
    assert _check(c, "every_20", c["per_k"]["20"]["step_s"], base, table, "<= 1.03") == c["ratio"]["median"]
    _check(c, "every_5", c["per_k"]["5"]["step_s"], base, table, "<= 1.10")
    assert c["preset"] == "small" and c["format"] == "auto"
    # Lean is retired: no run in another format (the format row compares them); its fixed cost still reported.
    assert "other" not in c and "other_format" not in [x["key"] for x in c["table_rows"]]
    fixed = [run["ocdbt"]["commit_s"] / run["lean"]["commit_s"] for run in c["fixed"]]
    assert len(fixed) == 1 and _row(c, "orbax_fixed")["ratio"]["values"] == pytest.approx(fixed)
    # The figure's runs saved in Orbax's format; the model is the small preset.
    runs = tmp_path / "var" / "bench" / "runs"
    assert sorted(p.name for p in runs.glob("ckpt-*")) == ["ckpt-20-0", "ckpt-5-0", "ckpt-none-0"]
    assert list((runs / "ckpt-5-0" / "checkpoints").glob("*/state"))
    assert not list((runs / "ckpt-5-0" / "checkpoints").glob("*/lean.json"))
    saved = json.loads((runs / "ckpt-none-0" / "config.json").read_text())
    assert json.dumps(saved).count('"d_model": 128') == 1 and json.dumps(saved).count('"seq_len": 128') == 1


def test_the_checkpoint_rows_name_the_formats_and_report_orbax_s_fixed_cost_apart() -> None:
    c = {
        "preset": "small",
        "format": "ocdbt",
        "step_s_without": [0.30, 0.40],
        "realistic_step_s": 0.25,
        "save_pause_s": [0.002, 0.004],
        "copy_bound_s": [0.001, 0.001],
        "per_k": {"20": {"step_s": [0.31, 0.40]}, "5": {"step_s": [0.33, 0.44]}},
        "other": {"format": "lean", "every": 5, "step_s": [0.30, 0.42]},
        "fixed": [{"lean": _timing(0.01, 0.01), "ocdbt": _timing(0.12, 0.05)}] * 2,
        "fixed_error": "",
    }
    r = bench.summarise("checkpoint_overhead", c, None)
    assert r["ratio"]["values"] == pytest.approx([0.31 / 0.30, 1.0]) and r["target"] == "<= 1.03"
    rows = r["table_rows"]
    assert find(rows, "every_5")["figure"] == "checkpoint every 5 (ocdbt) / none"
    assert "small, 350 [300..400] ms/step" in find(rows, "every_5")["measured"]
    assert find(rows, "other_format")["figure"].strip() == "every 5 in lean / none"  # a result from before
    assert _ratio(rows, "orbax_fixed")["values"] == pytest.approx([12.0, 12.0])
    assert "short_step" not in [x["key"] for x in rows]
    now = bench.summarise("checkpoint_overhead", {k: v for k, v in c.items() if k != "other"}, None)
    assert "other_format" not in [x["key"] for x in now["table_rows"]]  # lean retired: no other format run
    short = bench.summarise("checkpoint_overhead", {**c, "step_s_without": [0.06, 0.07]}, None)
    assert "below 250 ms" in find(short["table_rows"], "short_step")["measured"]


@pytest.mark.slow
@pytest.mark.extended
def test_restore_throughput_against_the_raw_read_and_tensorstore_alone(tmp_path: Path) -> None:
    proc, r = _bench(tmp_path, "--only", "restore_throughput", "--repeats", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s, table = r["restore_throughput"], proc.stdout
    assert r["repeats"] == 2 and s["bytes"] > 100e6  # the bench's model is ~200 MB with its optimiser state
    raw = s["raw_read_MBps"]
    assert len(raw) == 2 and _check(s, "restore", s["restore_MBps"], raw, table, ">= 0.5") == s["ratio"]["median"]
    _check(s, "worker", s["worker_restore_MBps"], raw, table, "(reported)")
    _check(s, "tensorstore", s["tensorstore_alone_MBps"], raw, table, "(reported)")
    # The default format's step (Orbax's OCDBT), lean retired: no lean step is written or read.
    step = tmp_path / "var" / "bench" / "runs" / "restore-default" / "checkpoints" / "1"
    assert s["format"] == "auto" and (step / "state" / "manifest.ocdbt").exists() and not (step / "lean.json").exists()
    assert all(x > 0 for x in s["restore_MBps"] + raw + s["worker_restore_MBps"] + s["tensorstore_alone_MBps"])
    # The share of CPU time the machine's host gave to others while the figure was measured (Linux reports it).
    assert 0 <= s["cpu_steal"] < 1 and f"restore_throughput {s['cpu_steal']:.0%}" in table


@pytest.mark.slow
@pytest.mark.extended
def test_cost_of_resilience_against_a_plain_loop_waiting_as_the_engine_does(tmp_path: Path) -> None:
    proc, r = _bench(tmp_path, "--quick", "--only", "cost_of_resilience")
    assert proc.returncode == 0, proc.stderr[-3000:]
    k, table = r["cost_of_resilience"], proc.stdout
    engine, polled = k["engine_tokens_per_s"], k["plain_polled_tokens_per_s"]
    # The figure: the engine against the plain loop waiting for each step as the engine does (training.ready).
    assert _check(k, "cost", engine, polled, table, ">= 0.95") == k["ratio"]["median"]
    _check(k, "without_saves", k["engine_without_saves_tokens_per_s"], polled, table, "(reported)")
    # Beneath it, weaker baselines: the plain loop in JAX's blocking wait, and with gloo's threads as is.
    _check(k, "jax_wait", engine, k["plain_tokens_per_s"], table, "(weaker baseline)")
    _check(k, "as_is", engine, k["plain_as_is_tokens_per_s"], table, "(weaker baseline)")
    keys = [x["key"] for x in k["table_rows"]]
    assert keys.index("cost") < keys.index("jax_wait") < keys.index("as_is")
    # Judged at a realistic step (the small preset); the tiny model at the same cadence beneath it.
    assert k["preset"] == "small" and min(k["step_s"]) > 0
    _check(k, "tiny", k["tiny_engine_tokens_per_s"], k["tiny_plain_polled_tokens_per_s"], table, "(reported)")
    assert all(x > 0 for x in engine + k["engine_without_saves_tokens_per_s"] + polled + k["plain_tokens_per_s"])
    # A round's first steps (each host's next standby warming beside them), against the plain loop's same steps.
    _check(
        k, "first_steps", k["engine_first_steps_tokens_per_s"], k["plain_first_steps_tokens_per_s"], table, "(reported)"
    )
    assert k["windows"]["first_steps"][1] < k["windows"]["steady"][0]
    # Model FLOPs utilisation: the engine's tokens/s x FLOPs per token against a large matmul's FLOP/s here.
    mfu = _row(k, "mfu")["ratio"]["median"]
    assert mfu == pytest.approx(statistics.median(engine) * k["model_flops_per_token"] / k["matmul_flops_per_s"])
    assert 0 < mfu < 1 and "model FLOPs utilisation" in table and "Llama tok/s per device" in table


@pytest.mark.slow
@pytest.mark.extended
def test_the_service_figure_measures_the_eta_and_the_hosts_moving_in_each_repeat(tmp_path: Path) -> None:
    proc, r = _bench(tmp_path, "--quick", "--only", "service", "--repeats", "2", timeout=2400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sv, table = r["service"], proc.stdout
    assert len(sv["runs"]) == 2
    for run in sv["runs"]:
        predicted, actual = run["eta_predicted_s"], run["eta_actual_s"]
        assert predicted > 0 and actual > 0 and run["eta_error"] == pytest.approx(abs(predicted - actual) / actual)
        assert any("host" in a for a in run["eta_assumptions"]), run["eta_assumptions"]
        assert 0 < run["priority_to_hosts_freed_s"] < run["priority_to_first_step_s"]
    errors = [x["eta_error"] for x in sv["runs"]]
    assert sv["ratio"]["values"] == errors and f"{_spread_text(errors)}  <= 0.15" in _line(table, "service: ETA")
    freed = [x["priority_to_hosts_freed_s"] for x in sv["runs"]]
    _check(sv, "moved", freed, [x["hosts_moved_bound_s"] for x in sv["runs"]], table, "<= 1.0")
    # The first run, which fills the compile cache, is measured too but not counted: its own row says so.
    cold = sv["cold"]["eta_error"]
    assert cold not in errors and f"{cold:.3f}" in _line(table, "first run (fills the compile cache)")


@pytest.mark.slow
@pytest.mark.extended
def test_the_control_plane_figure_counts_the_agents_requests_against_the_model(tmp_path: Path) -> None:
    proc, r = _bench(tmp_path, "--quick", "--only", "control_plane")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cp = r["control_plane"]
    (run,) = cp["runs"]
    for kind in ("local", "gcs"):
        m, model = run[kind]["measured"], run[kind]["model"]
        assert m["class_a"] > 0 and m["class_b"] > 0 and run[kind]["window_s"] >= 10
        ratio = (m["class_a"] + m["class_b"]) / (model["class_a"] + model["class_b"])
        assert run[kind]["ratio"] == pytest.approx(ratio)
        assert _row(cp, f"control_plane_{kind}")["ratio"]["values"] == [run[kind]["ratio"]]
        assert f"control plane, {kind} root" in proc.stdout
    # gs:// looks are billed: fewer of them than on a local root, where the agents look as often as ever.
    assert run["gcs"]["measured"]["class_a"] < run["local"]["measured"]["class_a"]
    assert set(cp["budget"]) == {"64", "256"} and "budget, 256 hosts on gs://" in proc.stdout


@pytest.mark.slow
@pytest.mark.extended
def test_recovery_figures_and_the_compile_of_a_recovery_onto_an_unseen_mesh(tmp_path: Path) -> None:
    proc, r = _bench(tmp_path, "--quick", "--only", "recovery", timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec, table = r["recovery"], proc.stdout
    f_s = [x["total_s"] for x in rec["follower"]]
    assert _check(rec, "recovery", f_s, rec["cold_starts_s"], table, "<= 0.5") == rec["ratio"]["median"]
    (un,) = rec["unseen_mesh"]["runs"]
    # The same lost follower onto a mesh neither job's cache held: compiled ahead, the recovery's step is a
    # cache hit; not compiled ahead, it is compiled there (a miss).
    assert un["ahead"]["compile_cached"] is True and un["not_ahead"]["compile_cached"] is False
    _check(rec, "unseen_mesh", [un["ahead"]["compile_s"]], [un["not_ahead"]["compile_s"]], table, "compile < 0.2 s")


def test_the_cost_figure_s_windows_end_on_steps_the_engine_reports_at_its_default_log_every() -> None:
    from training.config import load_config

    assert (
        jobs.LOG_EVERY == load_config("tiny", None, {}).observability.log_every
    )  # no preset sets it: the engine's default
    assert all(step % jobs.LOG_EVERY == 0 for step in (*jobs.STEADY, *jobs.FIRST_STEPS))


def test_a_figure_s_headline_is_its_first_row_with_a_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    skipped = note("skipped", "a shape", "not run: no device")
    monkeypatch.setitem(ROWS, "service", lambda res: [skipped, *generic_rows("b", res)])
    s = bench.summarise("service", {"ratios": [2.0, 4.0], "target": "<= 3"}, None)
    assert s["ratio"] is not None and s["ratio"]["median"] == 3.0 and s["target"] == "<= 3"
    monkeypatch.setitem(ROWS, "service", lambda res: [skipped])
    s = bench.summarise("service", {}, None)
    assert s["ratio"] is None and s["target"] == ""
    assert "not run: no device" in bench.format_table({"repeats": 1, "service": s})


def test_the_accelerator_row_s_peak_table_and_its_mfu_for_each_repeat() -> None:
    from benchmarks.accelerator import Measured, peak_tflops, rows

    assert peak_tflops("TPU v5 lite") == 197.0 and peak_tflops("TPU v5") == 459.0 and peak_tflops("TPU v4") == 275.0
    assert peak_tflops("TPU v6 lite") == 918.0 and peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("a kind nobody listed") is None
    m = Measured("1b", "tpu", "TPU v5 lite", flops_per_token=8e9, step_s=[0.5, 0.4, 0.6], peak_tflops=197.0)
    m.tokens_per_s, m.device_peak_gib, m.compiled_gib = 8192 / 0.5, 14.75, 14.72
    m.mfu = m.tokens_per_s * 8e9 / 197e12
    got = rows({"rows": [m.__dict__]})
    want = [8192 / s * 8e9 / 197e12 for s in (0.5, 0.4, 0.6)]
    assert got[0]["ratio"] is not None and got[0]["ratio"]["values"] == pytest.approx(want)
    assert "14.75 GiB (device) vs 14.72 GiB (compiled)" in got[1]["measured"]
    failed = rows({"rows": [Measured("big", "tpu", "TPU v5 lite", error="RESOURCE_EXHAUSTED: out of HBM").__dict__]})
    assert failed[0]["ratio"] is None and "not run: RESOURCE_EXHAUSTED" in failed[0]["measured"]


@pytest.mark.slow
@pytest.mark.extended
def test_the_accelerator_row_on_cpu_runs_a_small_shape_and_says_it_is_cpu(tmp_path: Path) -> None:
    proc, results = _bench(tmp_path, "--only", "accelerator", "--repeats", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    acc = results["accelerator"]
    assert acc["platform"] == "cpu" and [r["shape"] for r in acc["rows"]] == ["cpu-small"]
    r = acc["rows"][0]
    assert not r["error"] and len(r["step_s"]) == 2 and r["mfu"] is None and r["tokens_per_s"] > 0
    assert r["save_pause_s"] is not None and r["restore_s"] is not None and r["state_gib"] > 0
    med = statistics.median(r["step_s"])
    assert _row(acc, "accelerator:cpu-small")["ratio"]["values"] == pytest.approx([s / med for s in r["step_s"]])
    assert "(CPU: no MFU)" in _line(proc.stdout, "accelerator cpu-small")
    # The recovery sequence on the first shape: the standby's restore against the floor, its resume, the save.
    rec = acc["recovery"]
    assert rec["shape"] == "cpu-small" and "error" not in rec, rec
    floor = rec["train"]["read_s"] + rec["train"]["h2d_s"]
    assert _row(acc, "accelerator:cpu-small:recovery:restore")["ratio"]["values"] == [
        pytest.approx(rec["standby"]["restore_s"] / floor)
    ]
    assert _row(acc, "accelerator:cpu-small:recovery:standby")["target"] == "<= 5 s"
    assert "a fresh process instead" in proc.stdout


def test_the_local_tier_recovery_and_control_plane_rows_pair_each_repeat_s_own_measurements() -> None:
    lt = {
        "step_s_with_local": [0.06, 0.05],
        "step_s_without": [0.05, 0.05],
        "overhead_target": "<= 1.10",
        "steps_lost_with_local": [0, 2],
        "steps_lost_persistent_only": [6, 7],
        "target": "<= 1",
        "notice": [{"steps_lost": 0, "commit_s": 0.3}, {"steps_lost": 0, "commit_s": 0.5}],
    }
    r = bench.summarise("local_tier", lt, None)
    assert r["ratio"]["values"] == [0.0, 1.0] and r["target"] == "<= 1"
    assert _ratio(r["table_rows"], "overhead")["values"] == pytest.approx([1.2, 1.0])
    phases = dict.fromkeys(("detect_s", "form_round_s", "worker_init_s", "setup_s", "restore_s", "compile_s"), 0.1)
    runs = [{**phases, "total_s": t, "first_step_s": 0.2, "steady_step_s": 0.05} for t in (1.0, 2.0, 3.0, 4.0)]
    rec = {
        "follower": runs[:2],
        "leader": runs[2:],
        "cold_starts_s": [4.0, 5.0],
        "unseen_mesh": {
            "runs": [{"ahead": {"compile_s": 0.1, "compile_cached": True}, "not_ahead": {"compile_s": 2.0}}]
        },
        "ray": {"runs": [{"recovery_s": 50.0, "trainer": "JaxTrainer"}]},
    }
    r = bench.summarise("recovery", rec, None)
    assert r["ratio"]["values"] == [0.25, 0.4] and _ratio(r["table_rows"], "leader")["values"] == [3.0, 2.0]
    assert _ratio(r["table_rows"], "first_step")["values"] == [4.0] * 4
    assert _ratio(r["table_rows"], "ray")["values"] == [1.0 / 50.0]  # paired with the first follower
    assert _ratio(r["table_rows"], "unseen_mesh")["values"] == [0.05]
    budget = {"64": {"class_a": 70, "class_b": 330, "heartbeat_s": 5, "class_a_per_day": 6.4e6}}
    kinds = [
        {
            k: {"ratio": x, "measured": {"class_a": 1, "class_b": 2}, "model": {"class_a": 1, "class_b": 2}}
            for k, x in (("local", a), ("gcs", g))
        }
        for a, g in ((0.9, 0.8), (1.1, 0.7))
    ]
    r = bench.summarise("control_plane", {"runs": kinds, "target": "<= 1.10", "budget": budget}, None)
    assert r["ratio"]["values"] == [0.9, 1.1] and _ratio(r["table_rows"], "control_plane_gcs")["max"] == 0.8
    assert "budget, 64 hosts on gs://" in bench.format_table({"repeats": 2, "control_plane": r})


def _timing(commit: float, restore: float, pause: float = 0.01) -> dict[str, float]:
    return {"pause_s": pause, "commit_s": commit, "restore_s": restore, "cpu_s": commit / 2}


def test_the_formats_rows_pair_each_repeat_and_the_verdict_says_which_format_wins_by_how_much() -> None:

    size = {
        "size_mib": 1024,
        "orbax": {"local": "ocdbt", "gcs": "zarr"},
        "skipped": {},
        "error": "",
        "runs": [
            {
                "local:lean": _timing(1.0, 0.5),
                "local:ocdbt": _timing(2.0, 2.0),
                "gcs:lean": _timing(3.0, 1.0),
                "gcs:zarr": _timing(2.0, 2.0),
            },
            {
                "local:lean": _timing(1.5, 0.5),
                "local:ocdbt": _timing(2.0, 1.0),
                "gcs:lean": _timing(4.0, 1.0),
                "gcs:zarr": _timing(2.0, 4.0),
            },
        ],
    }
    big = {"size_mib": 4096, "orbax": {}, "runs": [], "error": "", "skipped": {"gcs": "needs about 24.0 GiB"}}
    fixed = [{"lean": _timing(0.01, 0.01), "ocdbt": _timing(0.15, 0.05)}] * 2
    r = bench.summarise("formats", {"sizes": [size, big], "fixed": fixed, "gcs_ocdbt": "failed: x", "error": ""}, None)
    assert r["ratio"]["values"] == [0.5, 0.75] and r["target"] == "< 1: lean faster"
    rows = r["table_rows"]
    assert _ratio(rows, "formats:local:1024:restore")["values"] == [0.25, 0.5]
    assert _ratio(rows, "formats:gcs:1024")["values"] == [1.5, 2.0]
    assert _ratio(rows, "formats:fixed")["values"] == pytest.approx([15.0, 15.0])
    local, gcs = find(rows, "formats:verdict:local")["measured"], find(rows, "formats:verdict:gcs")["measured"]
    assert local.startswith("lean beats OCDBT") and "commit 1.6x faster, restore 2.7x faster" in local
    assert gcs.startswith("mixed") and "commit 1.8x slower, restore 2.7x faster" in gcs
    assert "not run: needs about 24.0 GiB" in find(rows, "formats:gcs:4096")["measured"]
    table = bench.format_table({"repeats": 2, "formats": r})
    assert "0.625 [0.500..0.750]  < 1: lean faster" in _line(table, "lean/OCDBT commit, local 1024 MiB")


def test_the_formats_figure_runs_a_size_only_where_it_fits_in_memory() -> None:
    from benchmarks import formats

    gib = 1 << 30
    assert formats.media_that_fit(1024, 10 * gib) == (["local", "gcs"], {})
    fit, skipped = formats.media_that_fit(4096, 20 * gib)
    assert fit == ["local"] and skipped["gcs"] == "needs about 24.0 GiB of memory, 20.0 GiB available"
    assert formats.media_that_fit(4096, gib)[0] == []


LEAN_SAVE = """
import json, sys
from benchmarks import formats
from training.checkpoint import lean, manager as ckpt
from training.config import load_config
from training.layout import step_uri

cfg = load_config("tiny", None, {"root": sys.argv[1], "run_name": "fmt-lean"})
state = formats._state(0, formats.TINY_BYTES)
mngr, write = formats._saver(cfg, "lean", 1)
write(state)
back, pos = ckpt.restore(ckpt.checkpoint_manager(cfg, cfg.run_uri), 1, state)
print(json.dumps({"lean": lean.is_lean(step_uri(cfg.run_uri, 1)), "pos": pos}))
"""


def test_the_formats_figure_still_writes_lean_steps_though_no_config_chooses_lean(tmp_path: Path) -> None:
    # The format row is the evidence lean was retired on: its lean side must be lean, not what lean now reads as.
    out = subprocess.run(
        [sys.executable, "-c", LEAN_SAVE, str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"lean": True, "pos": {"next_batch": 1}}


@pytest.mark.slow
@pytest.mark.extended
def test_the_formats_figure_saves_and_restores_both_formats_locally_and_on_the_emulator(tmp_path: Path) -> None:
    proc, results = _bench(tmp_path, "--only", "formats", "--repeats", "2", "--formats-mib", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    f = results["formats"]
    [size] = f["sizes"]
    # OCDBT, what checkpoint_format auto writes on either root, saves on the emulator in every repeat.
    assert size["size_mib"] == 16 and size["orbax"] == {"local": ["ocdbt"], "gcs": ["ocdbt"]}
    assert not size["skipped"] and not size["failures"], size["failures"]
    for run in size["runs"]:
        assert sorted(run) == ["gcs:lean", "gcs:ocdbt", "local:lean", "local:ocdbt"]
    for run in size["runs"]:
        for t in run.values():
            assert 0 < t["pause_s"] < t["commit_s"] and t["restore_s"] > 0 and t["cpu_s"] > 0
    lean, ocdbt = ([run[f"local:{k}"]["commit_s"] for run in size["runs"]] for k in ("lean", "ocdbt"))
    _check(f, "formats:local:16", lean, ocdbt, proc.stdout, "< 1: lean faster")
    assert len(f["fixed"]) == 2 and f["gcs_ocdbt"] == "3/3 tiny saves committed and restored"
    assert (
        _line(proc.stdout, "verdict, local").split("verdict, local")[1].strip().startswith(("lean", "OCDBT", "mixed"))
    )
    assert "fixed cost per save" in proc.stdout


@pytest.mark.slow
@pytest.mark.extended
def test_the_recovery_at_scale_figure_in_its_ci_size_recovers_from_the_local_tier_and_times_its_saves(
    tmp_path: Path,
) -> None:
    # --quick runs the figure's jobs at a few MB a process (the figure itself is at 1 GiB: `rtrain bench`).
    proc, r = _bench(tmp_path, "--quick", "--only", "recovery_at_scale")
    assert proc.returncode == 0, proc.stderr[-3000:]
    f, table = r["recovery_at_scale"], proc.stdout
    assert f["scale"] == "ci" and 1 << 20 < f["state_bytes"] < 64 << 20
    [run] = f["runs"]
    assert run["lost"] == "follower" and run["restored_tier"] == "local", run
    floor = run["detect_s"] + run["read_s"] + run["h2d_s"] + run["steady_step_s"]
    assert min(run[k] for k in ("read_s", "h2d_s", "steady_step_s", "total_s", "cold_start_s", "restore_s")) > 0
    _check(f, "at_scale", [run["total_s"]], [run["cold_start_s"]], table, "<= 0.5")
    _check(f, "at_scale_floor", [run["total_s"]], [floor], table, "<= 2")
    _check(f, "save_local", [run["local_step_s"]], [run["local_none_step_s"]], table, "<= 1.05")
    _check(f, "save_persistent", [run["persistent_step_s"]], [run["persistent_none_step_s"]], table, "<= 1.05")
    assert run["persistent_steps"] > 0 and "breakdown (median)" in table and "floor: read" in table
