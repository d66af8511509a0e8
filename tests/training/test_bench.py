"""``rtrain bench`` as the README shows it: each figure a ratio of two measurements from the same run.

The bench writes under ``var/bench`` of its working directory, so each test runs it in its own
temporary directory.  The figures are measured, never asserted against a target: what is checked
is that a figure is what its JSON says it is (the ratio of the medians of its own repeats), and that
the table prints it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

RTRAIN = str(Path(sys.executable).parent / "rtrain")


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


def _ratio_of_medians(a: list[float], b: list[float]) -> float:
    return statistics.median(a) / statistics.median(b)


@pytest.mark.slow
def test_checkpoint_overhead_saves_in_the_default_format_beside_orbax_s(tmp_path: Path) -> None:
    proc, r = _bench(tmp_path, "--quick", "--only", "checkpoint_overhead")
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = r["checkpoint_overhead"]
    base = c["step_s_without"]
    for every in ("5", "20"):
        assert c["per_k"][every]["ratio"] == pytest.approx(_ratio_of_medians(c["per_k"][every]["step_s"], base))
    assert c["orbax"]["every"] == 5 and c["orbax"]["ratio"] == pytest.approx(
        _ratio_of_medians(c["orbax"]["step_s"], base)
    )
    # The figures' runs saved in the default (lean) format, the reference run in Orbax's.
    runs = tmp_path / "var" / "bench" / "runs"
    assert list((runs / "ckpt-5-0" / "checkpoints").glob("*/lean.json"))
    assert not list((runs / "ckpt-orbax-0" / "checkpoints").glob("*/lean.json"))
    assert list((runs / "ckpt-orbax-0" / "checkpoints").glob("*/state"))
    table = proc.stdout
    assert f"{c['per_k']['5']['ratio']:.3f}  <= 1.10" in table and f"{c['per_k']['20']['ratio']:.3f}  <= 1.03" in table
    assert "every 5 in Orbax's format / none" in table and f"{c['orbax']['ratio']:.3f}  (reported)" in table


@pytest.mark.slow
def test_restore_throughput_against_the_raw_read_and_tensorstore_alone(tmp_path: Path) -> None:
    proc, r = _bench(tmp_path, "--quick", "--only", "restore_throughput")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = r["restore_throughput"]
    assert r["repeats"] == 1 and s["bytes"] > 100e6  # the bench's model is ~200 MB with its optimiser state
    assert s["ratio"] == pytest.approx(_ratio_of_medians(s["restore_MBps"], s["raw_read_MBps"]))
    assert s["worker_ratio"] == pytest.approx(_ratio_of_medians(s["worker_restore_MBps"], s["raw_read_MBps"]))
    # Orbax's format beside it, on the same state: its restore and tensorstore alone, each against its own files.
    assert s["orbax_ratio"] == pytest.approx(_ratio_of_medians(s["orbax_restore_MBps"], s["orbax_raw_read_MBps"]))
    assert s["tensorstore_alone_ratio"] == pytest.approx(
        _ratio_of_medians(s["tensorstore_alone_MBps"], s["orbax_raw_read_MBps"])
    )
    assert 0.8 < s["orbax_bytes"] / s["bytes"] < 1.25, s  # the same arrays, whatever the format's overhead
    assert all(
        x > 0 for x in s["restore_MBps"] + s["raw_read_MBps"] + s["worker_restore_MBps"] + s["tensorstore_alone_MBps"]
    )
    table = proc.stdout
    assert "restore / raw read" in table and f"{s['ratio']:.3f}  >= 0.5" in table
    assert "a worker's restore / raw" in table and f"{s['worker_ratio']:.3f}  (reported)" in table
    assert "Orbax's format: restore / raw" in table and f"{s['orbax_ratio']:.3f}  (reported)" in table
    assert "tensorstore alone / raw" in table and f"{s['tensorstore_alone_ratio']:.3f}  (reported)" in table
    # The share of CPU time the machine's host gave to others while the figure was measured (Linux reports it).
    assert 0 <= s["cpu_steal"] < 1 and f"restore_throughput {s['cpu_steal']:.0%}" in table


@pytest.mark.slow
@pytest.mark.extended
def test_cost_of_resilience_against_a_plain_loop_with_and_without_saves(tmp_path: Path) -> None:
    proc, r = _bench(tmp_path, "--quick", "--only", "cost_of_resilience")
    assert proc.returncode == 0, proc.stderr[-3000:]
    k = r["cost_of_resilience"]
    plain = k["plain_tokens_per_s"]
    assert k["ratio"] == pytest.approx(_ratio_of_medians(k["engine_tokens_per_s"], plain))
    assert k["without_saves_ratio"] == pytest.approx(_ratio_of_medians(k["engine_without_saves_tokens_per_s"], plain))
    assert all(x > 0 for x in k["engine_tokens_per_s"] + k["engine_without_saves_tokens_per_s"] + plain)
    assert f"{k['ratio']:.3f}  >= 0.95" in proc.stdout and f"{k['without_saves_ratio']:.3f}  (reported)" in proc.stdout
    # The plain loop as a user writes it, gloo's transport threads at their default priority, reported beside.
    as_is = _ratio_of_medians(k["engine_tokens_per_s"], k["plain_as_is_tokens_per_s"])
    assert k["against_plain_as_is_ratio"] == pytest.approx(as_is)
    assert "gloo's threads as is" in proc.stdout and f"{as_is:.3f}  (reported)" in proc.stdout
    # The plain loop waiting for each step as the engine does (training.ready): the engine's own cost.
    polled = _ratio_of_medians(k["engine_tokens_per_s"], k["plain_polled_tokens_per_s"])
    assert k["against_plain_polled_ratio"] == pytest.approx(polled)
    assert "waiting as the engine does" in proc.stdout and f"{polled:.3f}  (reported)" in proc.stdout
    # A round's first steps (each host's next standby warming beside them), against the plain loop's same steps.
    first = _ratio_of_medians(k["engine_first_steps_tokens_per_s"], k["plain_first_steps_tokens_per_s"])
    assert k["first_steps_ratio"] == pytest.approx(first) and k["windows"]["first_steps"][1] < k["windows"]["steady"][0]
    assert "a round's first steps" in proc.stdout and f"{k['first_steps_ratio']:.3f}  (reported)" in proc.stdout
    # Model FLOPs utilisation: the engine's tokens/s x FLOPs per token against a large matmul's FLOP/s here.
    engine = statistics.median(k["engine_tokens_per_s"])
    assert k["mfu"] == pytest.approx(engine * k["model_flops_per_token"] / k["matmul_flops_per_s"])
    assert 0 < k["mfu"] < 1 and k["engine_tokens_per_s_per_device"] == pytest.approx(engine / 4)
    assert "model FLOPs utilisation" in proc.stdout and "Llama tok/s per device" in proc.stdout


@pytest.mark.slow
@pytest.mark.extended
def test_the_service_figure_measures_the_eta_and_the_hosts_moving(tmp_path: Path) -> None:
    proc, r = _bench(tmp_path, "--quick", "--only", "service", timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sv = r["service"]
    predicted, actual = sv["eta_predicted_s"], sv["eta_actual_s"]
    assert predicted > 0 and actual > 0 and sv["ratio"] == pytest.approx(abs(predicted - actual) / actual)
    assert any("host" in a for a in sv["eta_assumptions"]), sv["eta_assumptions"]
    assert 0 < sv["priority_to_hosts_freed_s"] < sv["priority_to_first_step_s"]
    assert sv["moved_ratio"] == pytest.approx(sv["priority_to_hosts_freed_s"] / sv["hosts_moved_bound_s"])
    assert f"{sv['ratio']:.3f}  <= 0.15" in proc.stdout and f"{sv['moved_ratio']:.3f}  <= 1.0" in proc.stdout


@pytest.mark.slow
@pytest.mark.extended
def test_the_control_plane_figure_counts_the_agents_requests_against_the_model(tmp_path: Path) -> None:
    proc, r = _bench(tmp_path, "--quick", "--only", "control_plane")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cp = r["control_plane"]
    for kind in ("local", "gcs"):
        m, model = cp[kind]["measured"], cp[kind]["model"]
        assert m["class_a"] > 0 and m["class_b"] > 0 and cp[kind]["window_s"] >= 10
        assert cp[kind]["ratio"] == pytest.approx((m["class_a"] + m["class_b"]) / (model["class_a"] + model["class_b"]))
        assert f"control plane, {kind} root" in proc.stdout
    assert cp["ratio"] == max(cp["local"]["ratio"], cp["gcs"]["ratio"])
    # gs:// looks are billed: fewer of them than on a local root, where the agents look as often as ever.
    assert cp["gcs"]["measured"]["class_a"] < cp["local"]["measured"]["class_a"]
    assert set(cp["budget"]) == {"64", "256"} and "budget, 256 hosts on gs://" in proc.stdout


@pytest.mark.slow
@pytest.mark.extended
def test_recovery_figures_and_the_compile_of_a_recovery_onto_an_unseen_mesh(tmp_path: Path) -> None:
    proc, r = _bench(tmp_path, "--quick", "--only", "recovery", timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = r["recovery"]
    f_s = [x["total_s"] for x in rec["follower"]]
    assert rec["ratio"] == pytest.approx(statistics.median(f_s) / statistics.median(rec["cold_starts_s"]))
    un = rec["unseen_mesh"]
    # The same lost follower onto a mesh neither job's cache held: compiled ahead, the recovery's step is a
    # cache hit; not compiled ahead, it is compiled there (a miss).
    assert un["ahead"]["compile_cached"] is True and un["not_ahead"]["compile_cached"] is False
    assert un["ratio"] == pytest.approx(un["compile_s"] / un["compile_s_not_ahead"])
    assert "recovery onto an unseen mesh" in proc.stdout and f"{un['ratio']:.3f}  compile < 0.2 s" in proc.stdout
