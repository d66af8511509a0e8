"""The memory-fit check from the compiled train step: argument bytes, sharding, any task, the CLI."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from training.config import load_config
from training.memfit import CompiledMemory, compiled_memory
from training.mesh import BYTES, PlanError, check_fit, param_count, plan_mesh

# Two workers with FSDP across hosts: the parameters go from 2 shards (1 worker) to 4.
TINY_FSDP = {"dcn_data": 1, "dcn_fsdp": -1}

USER_TASK = """
import flax.linen as nn
import jax
import jax.numpy as jnp

from training.tasks import ExampleSpec


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        x = nn.relu(nn.Dense(256, kernel_init=dense)(x))
        return nn.Dense(10)(x)


class Classifier:
    def __init__(self, cfg):
        self.model = MLP()

    def init(self, rng):
        return self.model.init(rng, jnp.zeros((1, 32)))["params"]

    def loss(self, params, batch, rng):
        logits = self.model.apply({"params": params}, batch["x"])
        labels = jax.nn.one_hot(batch["y"], 10)
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1)), {}

    def evaluate(self, params, batch):
        return {"loss": self.loss(params, batch, None)[0]}

    def example_spec(self):
        return {"x": ExampleSpec((32,), "float32"), "y": ExampleSpec((), "int32")}

    def data(self):
        raise AssertionError("planning must not open the task's data")

    def tokens_per_example(self):
        return 1


def make_task(cfg, args):
    return Classifier(cfg)
"""


@pytest.fixture(scope="module")
def tiny() -> dict[int, CompiledMemory]:
    """The tiny preset's compiled step at 1 worker (2 parameter shards) and 2 workers (4 shards)."""
    cfg = load_config("tiny", None, TINY_FSDP)
    return {w: compiled_memory(cfg, w) for w in (1, 2)}


def test_argument_bytes_are_the_sharded_state_and_halve_when_the_shards_double(tiny):
    cfg = load_config("tiny", None, TINY_FSDP)
    for workers, shards in ((1, 2), (2, 4)):
        got = tiny[workers]
        plan = plan_mesh(cfg.placement, workers)
        assert plan.param_shards == shards and got.devices == plan.devices and got.mesh_shape == plan.shape
        assert got.params == param_count(cfg.model)
        # Parameters and the two AdamW moments, each split over the parameter shards (norm scales and
        # counters are replicated: a few percent more), plus this device's rows of the batch.
        expected = 3 * got.params * BYTES[cfg.model.param_dtype] / shards
        batch = 4 * (cfg.optimizer.global_batch // plan.batch_shards) * cfg.model.seq_len * 4  # 4 int32 fields a token
        assert got.state_bytes == pytest.approx(expected, rel=0.05)
        assert got.argument_bytes >= got.state_bytes + batch
        assert got.argument_bytes == pytest.approx(got.state_bytes, rel=0.05)
        assert got.alias_bytes == pytest.approx(got.state_bytes, rel=0.01)  # the state is donated
        assert got.temp_bytes > 0 and got.total_bytes >= got.argument_bytes + got.temp_bytes
    assert tiny[2].argument_bytes / tiny[1].argument_bytes == pytest.approx(0.5, abs=0.05)


def test_a_user_task_gets_a_compiled_estimate_and_its_data_is_never_opened(tmp_path):
    from training.api import plan

    file = tmp_path / "mlp_task.py"
    file.write_text(textwrap.dedent(USER_TASK))
    cfg = load_config("tiny", None, {"task": f"{file}:make_task", "global_batch": 8})
    with pytest.raises(PlanError, match="knows only the built-in 'lm' task"):
        check_fit(cfg)  # the formula cannot estimate it, and nothing was given to measure it with
    report = plan(cfg)  # the API measures it: no --compiled needed for a task the formula does not know
    assert report["memory_source"] == "compiled" and report["params"] == 32 * 256 + 256 + 256 * 10 + 10
    assert report["memory_gib"] == report["compiled_memory_gib"]
    assert 0 < report["memory_gib"]["arguments"] < report["memory_gib"]["total"]


def test_plan_compiled_prints_both_figures_and_refuses_what_the_compiled_step_does_not_fit(tiny, monkeypatch, capsys):
    from training import memfit
    from training.cli import main

    monkeypatch.setattr(memfit, "compiled_memory", lambda cfg, workers: tiny[workers])  # measured above
    assert main(["plan", *(f"{k}={v}" for k, v in TINY_FSDP.items()), "--compiled"]) == 0
    out = capsys.readouterr().out
    assert "by the formula" in out and "from the compiled step (CPU backend, XLA's buffer assignment" in out
    assert main(["plan", "--compiled", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["memory_source"] == "formula" and report["compiled_memory_gib"]["total"] > 0
    # A device between the two estimates: one of them fits and the other does not, and --compiled decides.
    formula = check_fit(load_config("tiny"))[1].total  # type: ignore[union-attr]
    compiled = tiny[1].total_bytes
    assert compiled != pytest.approx(formula, rel=0.05), (compiled, formula)
    device_gib = (formula + compiled) / 2 / 0.9 / 2**30
    if compiled < formula:
        pytest.skip(f"the compiled step ({compiled} B) is below the formula ({formula:.0f} B) on this XLA")
    assert main(["plan", f"device_memory_gib={device_gib}"]) == 0
    capsys.readouterr()
    assert main(["plan", f"device_memory_gib={device_gib}", "--compiled"]) == 3
    err = capsys.readouterr().err
    assert "does not fit at the minimum topology" in err and "by the compiled step" in err


def test_llama3_8b_is_analysed_from_shapes_alone():
    cfg = load_config("llama3-8b")
    plan = plan_mesh(cfg.placement, 4)
    t0 = time.perf_counter()
    got = compiled_memory(cfg, 4)
    print(f"llama3-8b compiled analysis: {time.perf_counter() - t0:.1f} s ({got.compile_s:.1f} s compiling)")
    assert got.params == 8_030_261_248 and got.devices == 16
    # Arguments are the parameters and AdamW's two moments (the gradients are temporaries), plus a batch.
    share = 3 * got.params * BYTES[cfg.model.param_dtype] / plan.param_shards
    assert got.argument_bytes == pytest.approx(share, rel=0.10)


def test_on_an_accelerator_xla_s_own_peak_is_the_estimate_and_the_cpu_s_error_is_reported() -> None:
    common = dict(
        argument_bytes=6 * 2**30,
        output_bytes=6 * 2**30,
        temp_bytes=5 * 2**30,
        code_bytes=2**20,
        alias_bytes=6 * 2**30,
        peak_bytes=10 * 2**30,
        state_bytes=6 * 2**30,
        params=10**9,
        devices=1,
        mesh_shape={"data": 1, "fsdp": 1, "tensor": 1},
        compile_s=1.0,
    )
    cpu = CompiledMemory(**common)  # type: ignore[arg-type]
    assert cpu.total_bytes == 11 * 2**30 + 2**20  # the live sum, the larger
    assert cpu.cpu_error is None
    tpu = CompiledMemory(**common, backend="tpu", cpu_total_bytes=cpu.total_bytes)  # type: ignore[arg-type]
    assert tpu.total_bytes == 10 * 2**30 + 2**20
    assert tpu.cpu_error == pytest.approx(0.1, abs=1e-3)
    assert tpu.gib()["cpu_estimate"] == pytest.approx(11.0, abs=1e-2)


def test_the_device_compile_is_refused_where_jax_finds_only_the_cpu(monkeypatch):
    from training.memfit import _child, accelerator_present

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not accelerator_present()
    with pytest.raises(PlanError, match="no accelerator: JAX found only the CPU"):
        _child(load_config("tiny", None, TINY_FSDP), 1, 120.0, device=True)
    monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
    assert accelerator_present()


def test_a_device_compile_that_runs_out_of_memory_is_a_refusal_not_a_missing_figure(monkeypatch):
    import training.memfit as memfit

    cfg = load_config("tiny", None, TINY_FSDP)
    cpu = memfit._child(cfg, 1, 120.0, device=False)
    # What the v5e's compile said of the 150M model at batch 16 x 2048 without remat.
    oom = (
        "the compiled memory analysis failed: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. "
        "Ran out of memory in memory space hbm. Used 83.58G of 15.75G hbm."
    )
    busy = "the compiled memory analysis failed: the TPU is in use by another process"

    def device_child(message: str):
        def child(cfg, workers, timeout_s, device):
            if device:
                raise PlanError(message)
            return cpu

        return child

    monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
    monkeypatch.setattr(memfit, "_child", device_child(oom))
    with pytest.raises(PlanError, match="does not fit the device.*83.58G"):
        memfit.compiled_memory(cfg, 1)
    monkeypatch.setattr(memfit, "_child", device_child(busy))
    assert memfit.compiled_memory(cfg, 1) == cpu
