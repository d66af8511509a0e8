"""What the task logs say: one sentence for every event type the engine writes, the validate task's table,
the report task's rounded story, the plan in words.  No Python dict or list is printed to a person."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from rtrain_airflow.hooks.training import RTrainHook, format_validations, plan_text, readable

from training.api import describe
from training.event_text import SENTENCES
from training.events import REQUIRED, EventType

REPO = Path(__file__).resolve().parents[2]
# Types the brief names that the engine may not write (yet): their sentences are ready.
NEW_TYPES = {
    "local_checkpoint": {"step": 120, "host": "h1", "seconds": 0.41},
}
# A plausible value for every field an event type must carry (REQUIRED): a new required field needs one here.
SAMPLES: dict[str, Any] = {
    "attempt": 2,
    "workers": 4,
    "mesh": {"data": 4, "fsdp": 2, "tensor": 1},
    "process_id": 0,
    "step": 120,
    "seconds": 1.234,
    "next_batch": 121,
    "lr_scale": 0.5,
    "old": "a1b2c3d4e5f6a7b8",
    "new": "0f0e0d0c0b0a0908",
    "metric": "loss",
    "value": 9.87654321,
    "reason": "host h1 lost: no heartbeat",
    "loss": 2.31412345,
    "committed": True,
    "old_workers": 4,
    "new_workers": 3,
    "old_mesh": {"data": 4, "fsdp": 2, "tensor": 1},
    "new_mesh": {"data": 3, "fsdp": 2, "tensor": 1},
    "available": 3,
    "min_workers": 2,
    "action": "preempt",
    "verdict": "validated",
    "metrics": {"loss": 2.31412345, "accuracy": 0.4567, "perplexity": 10.1172},
    "from_step": 120,
    "to_step": 100,
    "deleted": [10, 20],
    "kept": [100, 120],
    "owner": "agent h0",
    "host": "h0",
    "job": "j1",
    "by": "airflow",
    "cause": "host h1 lost: no heartbeat",
    "steps_lost": 5,
    "lost_s": {"detect": 1.2, "relaunch": 3.0, "restore": 1.5, "compile": 2.0, "first_step": 0.5, "replay": 2.5},
}
PYTHON_REPR = re.compile(r"[{}\[\]]|\bNone\b|'\w+':|\d\.\d{5,}")


def emitted_types() -> set[str]:
    """Every event type written anywhere in training/ (``emit("...")``, the lock's ``on_event("lock")``)."""
    found: set[str] = set()
    for path in (REPO / "training").rglob("*.py"):
        found |= set(re.findall(r"""(?:\.emit|\bemit_later|\bon_event)\(\s*["']([a-z_]+)["']""", path.read_text()))
    return found


def test_every_event_type_has_a_sentence() -> None:
    """A type added to EventType, or written by a new emit() in training/, fails here until describe() has a
    sentence for it."""
    emitted = emitted_types()
    assert {"launch", "failure", "validation", "prune", "lock", "config"} <= emitted  # the scan finds them
    missing = sorted(({t.value for t in EventType} | emitted | set(NEW_TYPES)) - set(SENTENCES))
    assert missing == [], f"event types without a sentence in training.event_text.describe: {missing}"


@pytest.mark.parametrize("kind", sorted({t.value for t in EventType} | set(NEW_TYPES)))
def test_each_sentence_reads_without_python_reprs(kind: str) -> None:
    """The sentence of an event with only its required fields: words and rounded numbers."""
    try:
        required = REQUIRED[EventType(kind)]
    except ValueError:
        fields = NEW_TYPES[kind]
    else:
        lacking = [f for f in required if f not in SAMPLES]
        assert not lacking, f"add a sample value for {lacking} ({kind}) to SAMPLES"
        fields = {f: SAMPLES[f] for f in required}
    sentence = describe({"type": kind, "time": 1.0, "source": "h0-agent", **fields})
    assert sentence.strip(), kind
    assert not PYTHON_REPR.search(sentence), sentence


def test_sentences_of_note() -> None:
    def say(kind: str, **fields: Any) -> str:
        return describe({"type": kind, "time": 1.0, "source": "s", **fields})

    mesh = {"data": 4, "fsdp": 2, "tensor": 1}
    assert (
        say("progress", step=120, steps_total=300, loss=2.314123, tokens_per_s=5400.4, eta_s=192, workers=4, mesh=mesh)
        == "step 120/300 (40%), loss 2.3141, 5400 tok/s, ETA 3m12s, 4 workers, mesh data4 x fsdp2"
    )
    assert say("progress", step=7, loss=3.0, tokens_per_s=100.0) == "step 7, loss 3.0000, 100 tok/s"
    assert say("resumed", step=1, seconds=14.2) == "training started: step 1 done, 14.2s into the round"
    assert say("resumed", step=41, seconds=3.0) == "training resumed: step 41 done, 3.00s into the round"
    assert say("launch", attempt=3, round=3, workers=3, mesh={"data": 3}, resume="latest", reason="recovery") == (
        "round 3 (recovery): 3 hosts, mesh data3, from the newest committed checkpoint (if any)"
    )
    assert (
        say("failure", attempt=1, reason="host h1 lost", detect_s=1.23456)
        == "failure: host h1 lost (detected in 1.23s)"
    )
    assert (
        say("failure", attempt=1, reason="host h1 lost", detect_s=0.25, detected_by="peer watch")
        == "failure: host h1 lost (detected in 0.25s by the peer watch)"
    )
    assert say(
        "failure",
        attempt=1,
        reason="host h1 lost",
        detect_s=1.2,
        steps_lost=5,
        lost_s={"detect": 1.2, "relaunch": 3.0, "restore": 1.5, "compile": 2.0, "replay": 7.5},
    ) == (
        "failure: host h1 lost (detected in 1.20s); 5 steps lost, 15.2s out of training (detect 1.20s, "
        "relaunch 3.00s, restore 1.50s, compile 2.00s, replay 7.50s)"
    )
    notice = {"step": 120, "seconds": 3.2, "host": "h1", "committed": True}
    assert say("preemption_notice", **notice) == (
        "host h1 got a preemption notice: stopped at step 120 and committed it 3.20s after the notice"
    )
    assert say("preemption_notice", **{**notice, "committed": False, "reason": "the grace period ran out"}) == (
        "host h1 got a preemption notice at step 120: no checkpoint committed (the grace period ran out)"
    )
    assert say("local_checkpoint", **NEW_TYPES["local_checkpoint"]) == "host h1 saved local checkpoint 120 in 0.41s"
    assert say("local_checkpoint_skipped", step=120, host="h1", reason="checksum mismatch") == (
        "host h1 skipped local checkpoint 120: checksum mismatch"
    )
    assert say("local_tier_off", host="h1", reason="the mesh shards across hosts") == (
        "local checkpoint tier off on host h1: the mesh shards across hosts"
    )
    assert say(
        "recovered",
        cause="host h1 lost",
        step=41,
        tier="local",
        resume_step=40,
        steps_lost=0,
        lost_s={"detect": 1.2, "relaunch": 3.0, "restore": 0.4, "compile": 2.0, "first_step": 0.5, "replay": 0.0},
        seconds=7.1,
    ) == (
        "recovered from host h1 lost: training again at step 41 (from the local checkpoint 40); 0 steps lost, "
        "7.10s out of training (detect 1.20s, relaunch 3.00s, restore 0.40s, compile 2.00s, first step 0.50s, "
        "replay 0.00s)"
    )
    assert say("validation", step=40, verdict="rejected", metrics={"loss": 2.5161802172660828}, reason="worse") == (
        "validation of step 40: rejected (loss 2.5162): worse"
    )
    assert (
        say("prune", deleted=[10, 20], kept=[30], bytes_freed=3 * 2**20)
        == "pruned steps 10, 20; kept 30 (3.0 MiB freed)"
    )
    # A type describe() does not know (an older or newer engine) is still words, not a dict.
    assert say("mystery", sizes={"a": 1.23456789}, hosts=["h0", "h1"]) == "mystery: sizes a 1.235; hosts h0, h1"


def test_the_validation_table_is_aligned_and_rounded() -> None:
    results = [
        {
            "step": 40,
            "verdict": "validated",
            "metrics": {"loss": 2.5161802172660828, "perplexity": 12.380341231, "accuracy": 0.41234567},
            "reason": "",
        },
        {
            "step": 120,
            "verdict": "rejected",
            "metrics": {"loss": 5.386712, "perplexity": 218.4519, "accuracy": 0.1},
            "reason": "loss 5.3867 is worse than the best validated 2.5162 (step 40) by more than 5%",
        },
        {
            "step": 130,
            "verdict": "rejected",
            "metrics": {"loss": "nan", "perplexity": "nan", "accuracy": 0.0},
            "reason": "parameters are not all finite",
        },
    ]
    table = format_validations(results)
    assert table.splitlines() == [
        "    step  verdict        loss  perplexity  accuracy  reason",
        "      40  validated    2.5162       12.38     0.412",
        "     120  rejected     5.3867      218.45     0.100  loss 5.3867 is worse than the best validated 2.5162 "
        "(step 40) by more than 5%",
        "     130  rejected        nan         nan     0.000  parameters are not all finite",
    ]
    assert format_validations([]) == "no checkpoint waits for a verdict"


def test_the_report_is_rounded_with_readable_meshes(tmp_path: Path) -> None:
    import fake_runs

    hook = RTrainHook()
    report = hook.report(fake_runs.write_run(tmp_path, "rep"))
    report["final_loss"] = 2.5161802172660828  # as an older report, or a status' loss, may carry it
    report["recoveries"][0]["recovery_s"] = 5.309999942779541
    text = hook.format_report(report)
    assert "final loss 2.5162" in text and "training again after 5.3s" in text
    assert not re.search(r"\d\.\d{5,}", text), text
    assert "#1: 3 workers (data3)" in text and "resize       4 -> 3 workers: data4 -> data3" in text
    assert "tensor1" not in text and "{" not in text


def test_plan_and_results_read_as_words() -> None:
    hook = RTrainHook()
    text = plan_text(hook.plan(hook.build_config({"preset": "small"})))
    assert text.startswith("feasible worker counts 1, 2, 4; 1 worker: mesh data1 x fsdp2 (2 devices), ")
    assert "4 workers: mesh data4 x fsdp2 (8 devices); 1.31M parameters; memory per device" in text
    assert not PYTHON_REPR.search(text), text
    auto = plan_text(hook.plan(hook.build_config({"preset": "small", "model.remat": "auto"})))
    assert auto.endswith(
        "; remat auto: chosen from the compiled step when a job is launched (rtrain plan --compiled "
        "shows the choice); the formula counts full"
    ), auto
    assert readable({"backend": "local", "stopped_pids": [7, 9], "released": True, "wall_s": 1.23456789}) == (
        "backend local; stopped pids 7, 9; released True; wall s 1.235"
    )
