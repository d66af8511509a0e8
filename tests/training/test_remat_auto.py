"""``remat: auto``: the policy whose compiled step recomputes least among those that fit the device with a margin,
chosen when a job is launched and shown by ``rtrain plan --compiled``.

The choice itself is checked on a table of figures; then on the small preset's real compiled steps (CPU backend):
with ample memory auto takes a policy cheaper than ``full``, and with a device that only ``full`` fits, ``full``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.config import load_config
from training.mesh import PlanError
from training.rematfit import choose, order

GIB = 2**30
ONE_DEVICE = {"placement.devices_per_worker": 1, "elastic.min_workers": 1, "elastic.max_workers": 1}
# Each policy's step FLOPs and bytes, shaped like the small preset's (the fewer saved, the more recomputed).
FLOPS = {"none": 8.00, "dots": 8.26, "attn_mlp": 8.54, "attn": 8.54, "qkv_proj": 8.57, "full": 8.62}
BYTES = {"none": 46, "dots": 17, "attn_mlp": 15.6, "attn": 14.6, "qkv_proj": 14.4, "full": 14.0}


def test_policies_are_tried_fewest_flops_first_and_of_equal_flops_the_one_that_keeps_less() -> None:
    assert order(FLOPS) == ["none", "dots", "attn", "attn_mlp", "qkv_proj", "full"]
    assert order({"full": 2.0, "attn": 1.0, "dots": 1.0000001}) == ["attn", "dots", "full"]


def test_where_the_backend_counts_no_flops_the_policy_that_recomputes_least_is_tried_first() -> None:
    """A TPU's lowered step answers no FLOPs before it is compiled (seen on a v5e: every policy 0, so auto took
    full, the slowest, by the tie rule): then the policies go from the one that keeps most."""
    unknown = dict.fromkeys(FLOPS, 0.0)
    assert order(unknown) == ["none", "dots", "attn_mlp", "attn", "qkv_proj", "full"]
    choice = choose(unknown, lambda p: int(BYTES[p] * GIB), int(15 * GIB))
    assert choice.policy == "attn"
    assert choice.reason().startswith("remat auto: attn, the one that recomputes least (this backend counts no FLOPs")
    assert "FLOP)" not in choice.reason()


@pytest.mark.parametrize(
    ("usable", "chosen", "compiled"),
    [
        (100, "none", ["none"]),  # ample: no recomputation at all, the only step compiled
        (20, "dots", ["none", "dots"]),
        (14.5, "qkv_proj", ["none", "dots", "attn", "attn_mlp", "qkv_proj"]),
        (14.0, "full", ["none", "dots", "attn", "attn_mlp", "qkv_proj", "full"]),
    ],
)
def test_the_fastest_policy_that_fits_is_chosen_compiling_only_the_faster_ones(
    usable: float, chosen: str, compiled: list[str]
) -> None:
    measured: list[str] = []

    def measure(policy: str) -> int:
        measured.append(policy)
        return int(BYTES[policy] * GIB)

    choice = choose(FLOPS, measure, int(usable * GIB))
    assert (choice.policy, measured) == (chosen, compiled)
    assert [t.policy for t in choice.tried] == order(FLOPS)
    assert choice.reason().startswith(f"remat auto: {chosen}, the fewest FLOPs a step")
    if chosen != "none":
        assert "faster but over it: none 46.00 GiB" in choice.reason()


def test_nothing_that_fits_is_a_refusal_naming_each_policy_s_memory() -> None:
    with pytest.raises(PlanError, match=r"no policy's compiled step fits 10.00 GiB .*none 46.00 GiB .*full 14.00 GiB"):
        choose(FLOPS, lambda p: int(BYTES[p] * GIB), 10 * GIB)
    # A device that refuses a step at compile (out of memory) has not fitted it.
    choice = choose(FLOPS, lambda p: None if p == "none" else int(BYTES[p] * GIB), 20 * GIB)
    assert choice.policy == "dots" and choice.tried[0].error == "out of memory at compile"


# The small preset's model, scanned, 8 sequences on one device: its policies' compiled memory differs (the tiny
# model's activations are too few for that), full's the least.
SMALL = ["--preset", "small", "model.remat=auto", "model.scan_layers=true", "optimizer.global_batch=8"]
SMALL += [f"{k}={v}" for k, v in ONE_DEVICE.items()]


def test_on_the_compiled_steps_ample_memory_takes_a_cheaper_policy_and_a_tight_device_full(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``rtrain plan --compiled``: each policy's step compiled in a child process on the CPU backend."""
    from training.cli import main
    from training.memfit import compiled_memory

    assert main(["plan", *SMALL, "--compiled", "--json"]) == 0  # 2 GiB a device: ample
    remat = json.loads(capsys.readouterr().out)["remat"]
    flops = {t["policy"]: t["flops"] for t in remat["tried"]}
    assert remat["policy"] == "none" and flops["none"] < flops["full"]  # no recomputation: the fewest FLOPs
    assert [t["gib"] is not None for t in remat["tried"]] == [True] + [False] * 5  # only the fastest compiled

    full = compiled_memory(load_config("small", None, [*SMALL[2:], "model.remat=full"]), 1)
    tight_gib = full.total_bytes * 1.001 / 0.9 / GIB  # full fits 90% of it, and no other policy does
    assert main(["plan", *SMALL, f"placement.device_memory_gib={tight_gib}", "--compiled"]) == 0
    out = capsys.readouterr().out
    assert f"memory per device at the minimum: {full.total_bytes / GIB:.2f} GiB from the compiled step" in out
    line = next(x for x in out.splitlines() if x.startswith("remat auto: "))
    assert line.startswith("remat auto: full, the fewest FLOPs a step") and "(90% of device_memory_gib)" in line
    over = line.partition("faster but over it: ")[2]
    assert [p.split()[0] for p in over.split("), ")] == [p for p in order(flops) if p != "full"], line
    assert main(["plan", *SMALL]) == 0  # without --compiled: not chosen yet, and it says so
    assert "remat auto: chosen from the compiled step when a job is launched" in capsys.readouterr().out


def test_a_launched_job_s_config_holds_the_chosen_policy(tmp_path: Path, tiny_dataset: str) -> None:
    """The workers read the run's config.json: the concrete policy, not auto; the launcher says why."""
    from training.api import begin_job
    from training.config import config_from_json

    cfg = load_config("tiny", None, {"model.remat": "auto", "root": str(tmp_path), "data.dataset": tiny_dataset})
    said: list[str] = []
    begin_job(cfg, on_line=said.append)
    stored = config_from_json((tmp_path / cfg.run_name / "config.json").read_text())
    assert stored.model.remat == "none" and cfg.model.remat == "auto"
    assert len(said) == 1 and said[0].startswith("remat auto: none, the fewest FLOPs a step")


def test_the_dag_s_resolve_config_chooses_before_any_capacity_is_provisioned(tmp_path: Path) -> None:
    """The run spec every later task reads (provision, launch) holds the chosen policy: a GKE run whose model no
    policy fits is refused before a node pool exists."""
    from rtrain_airflow.operators.training import RTrainResolveRunConfigOperator

    params = {"run_name": "r", "preset": "tiny", "storage_root": str(tmp_path), "overrides": {"model.remat": "auto"}}
    spec = RTrainResolveRunConfigOperator(task_id="resolve_config").execute({"params": params})  # type: ignore[arg-type]
    assert spec["config"]["model"]["remat"] == "none"
    assert not (tmp_path / "r").exists()
