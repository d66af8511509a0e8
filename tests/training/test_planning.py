"""Config layering, mesh planning, the memory-fit check and refusals before any worker starts."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from training import sections
from training.cli import main
from training.config import ConfigError, config_from_json, load_config
from training.faults import ChaosError, parse_chaos
from training.mesh import PlanError, check_batch, check_fit, feasible_sizes, plan_mesh


def test_layers_apply_in_order_and_overrides_are_typed():
    cfg = load_config("small", None, ["steps=7", "learning_rate=1e-4", "chaos=[]"])
    assert (cfg.preset, cfg.optimizer.steps, cfg.optimizer.learning_rate, cfg.model.d_model) == ("small", 7, 1e-4, 128)


@pytest.mark.parametrize(
    "override, message",
    [
        ("nope=1", "nope: unknown key"),
        ("steps=abc", "steps:"),
        ("min_workers=0", "min_workers:"),
        ("run_name=../etc", "run_name"),
        ("preset=huge", "preset: unknown preset 'huge'"),
        ("resume_from=yesterday", "resume_from"),
        ("chaos=[explode:step=1]", "unknown action 'explode'"),
    ],
)
def test_bad_config_is_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config("tiny", None, [override])


@pytest.mark.parametrize(
    "workers, devices, knobs, shape",
    [
        (4, 2, {}, {"data": 4, "fsdp": 2, "tensor": 1}),
        (2, 2, {}, {"data": 2, "fsdp": 2, "tensor": 1}),
        (1, 4, {"ici_tensor": 2}, {"data": 1, "fsdp": 2, "tensor": 2}),
        (4, 4, {"dcn_data": 1, "dcn_fsdp": -1}, {"data": 1, "fsdp": 16, "tensor": 1}),
    ],
)
def test_the_mesh_is_planned_from_hosts_and_knobs(workers, devices, knobs, shape):
    cfg = load_config("tiny", None, {"devices_per_worker": devices, **knobs})
    assert plan_mesh(cfg.placement, workers).shape == shape


def test_the_global_batch_stays_constant_and_the_per_device_batch_adapts():
    cfg = load_config("tiny", None, {"global_batch": 16, "min_workers": 1, "max_workers": 4})
    assert [check_batch(cfg.optimizer, cfg.checkpoint, plan_mesh(cfg.placement, n)) for n in (1, 2, 4)] == [8, 4, 2]
    assert feasible_sizes(cfg) == [1, 2, 4]  # 3 hosts x 2 devices cannot split 16 sequences


def test_memory_fit_refusal_shows_the_numbers_before_any_worker_starts(tmp_path, capsys):
    rc = main(["train", "--preset", "llama3-70b", "min_workers=2", f"root={tmp_path}", "run_name=big"])
    err = capsys.readouterr().err
    assert rc == 3  # a config that cannot run (exit code 3), before anything starts
    assert "does not fit at the minimum topology (2 workers x 4 devices" in err
    assert "optimizer (AdamW mu, nu)" in err and "GiB" in err and "70.55B parameters" in err
    assert not (tmp_path / "big").exists(), "nothing may be written for a refused run"


@pytest.mark.parametrize(
    ("remat", "says"),
    [
        ("none", "set remat (full keeps the least; dots, qkv_proj, attn, attn_mlp keep more), "),
        ("dots", "set remat: full (it keeps the least; dots keeps more), "),
        ("full", "shard more (ici_fsdp / ici_tensor), or lower"),
    ],
)
def test_a_memory_fit_refusal_names_the_remat_setting_to_change(remat, says):
    with pytest.raises(PlanError) as e:
        check_fit(load_config("llama3-70b", None, {"min_workers": 2, "remat": remat}))
    assert says in str(e.value) and "activation_checkpointing" not in str(e.value), str(e.value)


def test_indivisible_global_batch_is_refused_before_launch(tmp_path, capsys):
    rc = main(["train", "global_batch=6", "min_workers=4", "max_workers=4", f"root={tmp_path}", "run_name=odd"])
    assert rc == 3
    assert "global_batch=6 cannot be split over 4 workers x 2 devices" in capsys.readouterr().err
    assert not (tmp_path / "odd").exists()
    cfg = load_config("tiny", None, {"global_batch": 6})
    with pytest.raises(PlanError):
        check_batch(cfg.optimizer, cfg.checkpoint, plan_mesh(cfg.placement, 4))


def test_real_model_presets_fit_at_their_minimum_topology(capsys):
    for preset in ("llama3-8b", "llama3-70b"):
        assert main(["plan", "--preset", preset]) == 0
    assert "feasible worker counts: [4, 8]" in capsys.readouterr().out
    assert main(["plan", "--preset", "llama3-8b", "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["feasible_workers"] == [4, 8]


@pytest.mark.parametrize("overrides", [{"n_kv_heads": 2}, {"tie_embeddings": True}])
def test_param_count_matches_the_flax_model(overrides):
    import jax

    from training.mesh import param_count
    from training.tasks import load_task

    cfg = load_config("tiny", None, overrides)
    params = jax.eval_shape(load_task(cfg).init, jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(params))
    assert n == param_count(cfg.model)


@pytest.mark.parametrize(("preset", "published"), [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)])
def test_the_llama3_presets_have_the_published_parameter_counts(preset, published):
    import jax

    from training.mesh import param_count
    from training.tasks import load_task

    cfg = load_config(preset)
    assert param_count(cfg.model) == published
    params = jax.eval_shape(load_task(cfg).init, jax.random.key(0))  # the model itself, from shapes alone
    assert sum(x.size for x in jax.tree.leaves(params)) == published


@pytest.mark.parametrize("spec", ["preempt:worker=1", "capacity:to=2", "crash:worker=x,step=1", "nan:step=1,oops=2"])
def test_bad_chaos_specs_are_refused(spec):
    with pytest.raises(ChaosError):
        parse_chaos(spec)


def test_the_largest_round_a_capacity_allows_splits_the_batch_and_takes_whole_slices():
    from training.elastic.host.membership import largest_round

    cfg = load_config("tiny", None, {"min_workers": 1, "max_workers": 4})
    assert [largest_round(cfg, n) for n in (1, 2, 3, 4, 9)] == [1, 2, 2, 4, 4]
    assert largest_round(cfg, None) == largest_round(cfg, 0) == 4  # not known: what the job may grow to
    slices = load_config("tiny", None, {"min_workers": 2, "max_workers": 4, "hosts_per_slice": 2})
    assert [largest_round(slices, n) for n in (1, 3, 4)] == [0, 2, 4]


def test_capacity_faults_due_at_one_look_fire_one_at_a_time_so_the_pool_acts_on_each(tmp_path):
    """The step the leader sees jumped past two capacity faults: the second waits, the pool sees the first."""
    from training.elastic.capacity import LocalCapacity
    from training.elastic.chaos import CAPACITY_SPACING_S, JobChaos
    from training.events import EventLog
    from training.storage import open_store

    store = open_store(str(tmp_path))
    events = EventLog(store, source="test")
    pool = LocalCapacity(store, default=2)
    chaos = JobChaos(["capacity:to=1,step=5", "capacity:to=2,step=9"], events, events.emit, pool)
    chaos.capacity_due(9, elapsed=10.0)
    assert pool.available() == 1
    chaos.capacity_due(9, elapsed=10.0 + CAPACITY_SPACING_S / 2)
    assert pool.available() == 1, "the second waits: the pool acts on the first"
    chaos.capacity_due(9, elapsed=10.0 + CAPACITY_SPACING_S)
    assert pool.available() == 2
    assert [e["spec"] for e in events.read(types=("chaos",))] == ["capacity:to=1,step=5", "capacity:to=2,step=9"]
    # Each fires once, by this leader or the next (they are on record).
    again = JobChaos(chaos.specs, events, events.emit, pool)
    pool.set(2)
    again.capacity_due(30, elapsed=60.0)
    assert pool.available() == 2 and len(events.read(types=("chaos",))) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "/nonexistent/run.yml"], "--config /nonexistent/run.yml: no such file"),
        (["steps=[1"], "override steps: '[1' is not a value"),
        (["nosuchkey=1"], "nosuchkey: unknown key"),
        (["min_workers=4", "max_workers=2"], "min_workers (4) > max_workers (2)"),
    ],
)
def test_bad_config_input_is_one_line_with_the_config_exit_code(tmp_path, capsys, argv, message):
    rc = main(["plan", *argv])
    err = capsys.readouterr().err
    assert rc == 3
    assert err.count("\n") == 1 and err.startswith("rtrain: error: ") and message in err
    assert "Traceback" not in err and "{" not in err  # no stack trace, no dump of the whole config


def test_a_config_file_that_is_not_yaml_names_the_line(tmp_path, capsys):
    bad = tmp_path / "run.yml"
    bad.write_text("steps: 10\nmodel: [unclosed\n")
    assert main(["plan", "--config", str(bad)]) == 3
    err = capsys.readouterr().err
    assert f"--config {bad}: not valid YAML (line" in err and "Traceback" not in err
    listed = tmp_path / "list.yml"
    listed.write_text("- a\n- b\n")
    assert main(["plan", "--config", str(listed)]) == 3
    assert "expected a mapping of key: value, got list" in capsys.readouterr().err


def test_paths_are_made_absolute_against_the_directory_the_command_runs_in(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny", None, ["root=runs", "compilation_cache=cache"])
    assert cfg.root == str(tmp_path / "runs") and cfg.placement.compilation_cache == str(tmp_path / "cache")
    assert cfg.data.dataset == str(tmp_path / "var" / "data" / "stdlib-seq64")  # one default per sequence length
    assert load_config("small").data.dataset.endswith("var/data/stdlib-bpe1024-seq128")  # the preset's BPE
    assert load_config("tiny", None, ["root=gs://bucket/runs"]).root == "gs://bucket/runs"
    assert cfg.run_uri == str(tmp_path / "runs" / "demo")


def test_the_retired_lean_format_is_read_as_auto_with_one_note(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_config("tiny", None, {}).checkpoint.checkpoint_format == "auto"
    monkeypatch.setattr(sections, "_NOTED", set())  # noted once per process: earlier tests may have noted it
    (tmp_path / "old.yml").write_text("checkpoint:\n  checkpoint_format: lean\n")
    with caplog.at_level(logging.WARNING, logger="training.config"):
        from_file = load_config("tiny", [str(tmp_path / "old.yml")])
        # Compression was refused with lean; lean is auto now, so it is Orbax's to apply.
        from_override = load_config("tiny", None, ["checkpoint_format=lean", "checkpoint_compression=true"])
        # A config.json an older run stored, which says lean.
        from_json = config_from_json((Path(__file__).parent / "data" / "config-0.1-tiny.json").read_text())
    assert [c.checkpoint.checkpoint_format for c in (from_file, from_override, from_json)] == ["auto"] * 3
    assert from_override.checkpoint.checkpoint_compression
    notes = [r.getMessage() for r in caplog.records if "lean" in r.getMessage()]
    assert notes == [sections.LEAN_RETIRED], notes
    assert "OCDBT commits and restores faster" in notes[0] and "rtrain bench --only formats" in notes[0]
    assert "steps saved in lean still restore" in notes[0]
    with pytest.raises(ConfigError, match="checkpoint_format"):
        load_config("tiny", None, ["checkpoint_format=leaner"])
