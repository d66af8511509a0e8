"""Optimizers and schedules from config, and gradient accumulation over micro-batches."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from training.config import ConfigError, load_config
from training.optim import make_optimizer, make_schedule


@pytest.mark.parametrize(
    ("schedule", "at"),
    [
        ("cosine", {0: 0.0, 10: 1.0, 100: 0.1}),
        ("linear", {0: 0.0, 10: 1.0, 55: 0.55, 100: 0.1}),
        ("constant", {0: 0.0, 10: 1.0, 100: 1.0}),
        ("wsd", {0: 0.0, 10: 1.0, 80: 1.0, 90: 0.55, 100: 0.1}),
    ],
)
def test_schedules_warm_up_then_decay_as_named(schedule: str, at: dict[int, float]) -> None:
    cfg = load_config(
        "tiny",
        None,
        {"schedule": schedule, "steps": 100, "warmup_steps": 10, "learning_rate": 1.0, "min_lr_ratio": 0.1},
    )
    lr = make_schedule(cfg.optimizer)
    for step, want in at.items():
        assert float(lr(step)) == pytest.approx(want, abs=1e-6), (schedule, step)


@pytest.mark.parametrize("name", ["adamw", "lion", "adafactor", "sgd"])
def test_each_optimizer_lowers_a_quadratic(name: str) -> None:
    cfg = load_config("tiny", None, {"optimizer": name, "learning_rate": 0.05, "warmup_steps": 0, "steps": 50})
    tx = make_optimizer(cfg.optimizer)
    params = {"w": jax.numpy.full((4, 4), 3.0)}
    state = tx.init(params)
    loss = lambda p: (p["w"] ** 2).sum()  # noqa: E731
    first = float(loss(params))
    for _ in range(50):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    assert float(loss(params)) < 0.5 * first, name


def test_grad_accum_must_split_the_global_batch() -> None:
    with pytest.raises(ConfigError, match="divisible by grad_accum"):
        load_config("tiny", None, {"global_batch": 16, "grad_accum": 3})


def test_accumulated_micro_batches_give_the_full_batch_update(tiny_dataset: str) -> None:
    """The same step with grad_accum 1 and 4: the same loss and (to rounding) the same parameters."""
    from training.data import make_batches
    from training.mesh import build_mesh, plan_mesh
    from training.tasks import load_task
    from training.trainer import Trainer

    out = []
    for accum in (1, 4):
        cfg = load_config(
            "tiny", None, {"dataset": tiny_dataset, "grad_accum": accum, "devices_per_worker": 1, "min_workers": 1}
        )
        tr = Trainer(cfg.optimizer, build_mesh(plan_mesh(cfg.placement, 1)), load_task(cfg))
        state = tr.init()
        batch = next(make_batches(tiny_dataset, "train", seed=0, global_batch=16, process_index=0, process_count=1))
        state, metrics = tr.step(state, tr.global_batch(batch))
        out.append((float(metrics["loss"]), jax.device_get(state["params"])))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-5)
    for a, b in zip(jax.tree.leaves(out[0][1]), jax.tree.leaves(out[1][1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["adamw", "lion", "adafactor", "sgd"])
def test_the_abstract_state_a_restore_is_given_is_the_initialised_one(name: str) -> None:
    """The trainer's abstract state (built from one abstract init) has the tree, shapes, dtypes and shardings
    of the state its initialisation makes, for each optimizer's state."""
    from training.mesh import build_mesh, plan_mesh
    from training.tasks import load_task
    from training.trainer import Trainer

    cfg = load_config("tiny", None, {"optimizer": name, "devices_per_worker": 1, "min_workers": 1})
    tr = Trainer(cfg.optimizer, build_mesh(plan_mesh(cfg.placement, 1)), load_task(cfg))
    state = tr.init()
    assert str(jax.tree.structure(tr.abstract)) == str(jax.tree.structure(state)), name
    for want, got in zip(jax.tree.leaves(tr.abstract), jax.tree.leaves(state), strict=True):
        assert (want.shape, want.dtype) == (got.shape, got.dtype), name
        assert want.sharding.is_equivalent_to(got.sharding, got.ndim), name


def test_a_small_state_s_initialisation_is_compiled_without_optimisation_on_cpu(monkeypatch, tiny_dataset) -> None:
    """It runs once: on CPU it is compiled for the least compile time, up to a size where the slower run would cost
    more; the state it makes is the optimised program's to the last bits or close to them."""
    import training.trainer as trainer_mod
    from training.mesh import build_mesh, plan_mesh
    from training.tasks import load_task

    cfg = load_config("tiny", None, {"dataset": tiny_dataset, "devices_per_worker": 1, "min_workers": 1})
    tr = trainer_mod.Trainer(cfg.optimizer, build_mesh(plan_mesh(cfg.placement, 1)), load_task(cfg))
    assert tr.init_compiler_options() == {"xla_backend_optimization_level": 0}
    state = tr.init()
    with tr.tracing():
        optimised = tr._init()  # the jit's own compile, with XLA's default options
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(optimised), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(trainer_mod, "UNOPTIMISED_INIT_MAX", 10)
    assert tr.init_compiler_options() is None  # a large state: its run would cost more than the compile saves


@pytest.mark.parametrize("scale", [0.01, 100.0])  # under the clip's norm, and over it
def test_the_clip_given_the_step_s_norm_updates_exactly_as_optax_s_own(scale: float) -> None:
    import optax

    cfg = load_config("tiny", None, {"grad_clip": 1.0})
    tx = make_optimizer(cfg.optimizer)
    keys = jax.random.split(jax.random.key(3), 3)
    params = {"w": jax.random.normal(keys[0], (16, 8)), "b": jax.random.normal(keys[1], (8,))}
    grads = jax.tree.map(lambda p: scale * jax.random.normal(keys[2], p.shape), params)
    state = tx.init(params)
    reference, ref_state = jax.jit(optax.chain(optax.clip_by_global_norm(1.0), *tx_rest(cfg)).update)(
        grads, state, params
    )
    given, given_state = jax.jit(lambda g, s, p: tx.update(g, s, p, grad_norm=optax.tree.norm(g)))(grads, state, params)
    alone, _ = jax.jit(tx.update)(grads, state, params)  # not given: optax's clip computes it
    for a, b, c in zip(jax.tree.leaves(reference), jax.tree.leaves(given), jax.tree.leaves(alone), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert str(jax.tree.structure(ref_state)) == str(jax.tree.structure(given_state))  # checkpoints keep their layout


def tx_rest(cfg: Any) -> list[Any]:  # the optimizer after the clip, as make_optimizer builds it
    import optax

    return [optax.adamw(make_schedule(cfg.optimizer), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)]
