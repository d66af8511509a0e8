"""Config layering, mesh planning, the memory-fit check and refusals before any worker starts."""

from __future__ import annotations

import pytest

from training.elastic.chaos import ChaosError, parse_chaos
from training.cli import main
from training.config import ConfigError, load_config
from training.mesh import PlanError, check_batch, choose_workers, feasible_sizes, plan_mesh


def test_layers_apply_in_order_and_overrides_are_typed():
    cfg = load_config("small", None, ["steps=7", "learning_rate=1e-4", "chaos=[]"])
    assert (cfg.preset, cfg.steps, cfg.learning_rate, cfg.d_model) == ("small", 7, 1e-4, 128)


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
    assert plan_mesh(cfg, workers).shape == shape


def test_the_global_batch_stays_constant_and_the_per_device_batch_adapts():
    cfg = load_config("tiny", None, {"global_batch": 16, "min_workers": 1, "max_workers": 4})
    assert [check_batch(cfg, plan_mesh(cfg, n)) for n in (1, 2, 4)] == [8, 4, 2]
    assert feasible_sizes(cfg) == [1, 2, 4]  # 3 hosts x 2 devices cannot split 16 sequences
    assert choose_workers(cfg, 3) == 2 and choose_workers(cfg, 0) is None


def test_memory_fit_refusal_shows_the_numbers_before_any_worker_starts(tmp_path, capsys):
    rc = main(["train", "--preset", "llama3-70b", "min_workers=2", f"root={tmp_path}", "run_name=big"])
    err = capsys.readouterr().err
    assert rc == 3  # a config that cannot run (exit code 3), before anything starts
    assert "does not fit at the minimum topology (2 workers x 4 devices" in err
    assert "optimizer (AdamW mu, nu)" in err and "GiB" in err and "70.62B parameters" in err
    assert not (tmp_path / "big").exists(), "nothing may be written for a refused run"


def test_indivisible_global_batch_is_refused_before_launch(tmp_path, capsys):
    rc = main(["train", "global_batch=6", "min_workers=4", "max_workers=4", f"root={tmp_path}", "run_name=odd"])
    assert rc == 3
    assert "global_batch=6 cannot be split over 4 workers x 2 devices" in capsys.readouterr().err
    assert not (tmp_path / "odd").exists()
    with pytest.raises(PlanError):
        check_batch(load_config("tiny", None, {"global_batch": 6}), plan_mesh(load_config("tiny"), 4))


def test_real_model_presets_fit_at_their_minimum_topology(capsys):
    for preset in ("llama3-8b", "llama3-70b"):
        assert main(["plan", "--preset", preset]) == 0
    assert "feasible worker counts: [4, 8]" in capsys.readouterr().out
    assert main(["plan", "--preset", "llama3-8b", "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["feasible_workers"] == [4, 8]


def test_param_count_matches_the_flax_model():
    import jax

    from training.mesh import param_count
    from training.model import Transformer

    cfg = load_config("tiny", None, {"n_kv_heads": 2})
    params = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), jax.numpy.zeros((1, 8), "int32")))
    n = sum(x.size for x in jax.tree.leaves(params))
    assert n == param_count(cfg)


@pytest.mark.parametrize("spec", ["preempt:worker=1", "capacity:to=2", "crash:worker=x,step=1", "nan:step=1,oops=2"])
def test_bad_chaos_specs_are_refused(spec):
    with pytest.raises(ChaosError):
        parse_chaos(spec)
