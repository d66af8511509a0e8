"""The Llama 3.x presets are the published models: their parameter counts from the model's own abstract shapes,
and the Hugging Face config.json of each model (init_from) sets nothing the preset does not already say."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest
from hf_files import PUBLISHED, PUBLISHED_PARAMS, write_checkpoint

from training.config import load_config
from training.mesh import param_count
from training.tasks import load_task

PRESETS = tuple(PUBLISHED)


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_has_its_model_s_published_parameter_count(preset: str) -> None:
    cfg = load_config(preset)
    params = jax.eval_shape(load_task(cfg).init, jax.random.key(0))  # shapes alone: nothing is allocated
    assert sum(x.size for x in jax.tree.leaves(params)) == PUBLISHED_PARAMS[preset]
    assert param_count(cfg.model) == PUBLISHED_PARAMS[preset]


@pytest.mark.parametrize("preset", PRESETS)
def test_init_from_the_published_checkpoint_needs_no_other_key(preset: str, tmp_path: Path) -> None:
    """The preset with its model's Hugging Face directory: the same model keys, nothing refused."""
    ckpt = tmp_path / preset
    write_checkpoint(ckpt, PUBLISHED[preset])
    alone, loaded = load_config(preset), load_config(preset, None, [f"model.init_from={ckpt}"])
    assert loaded.model.model_dump(exclude={"init_from"}) == alone.model.model_dump(exclude={"init_from"})
    assert loaded.model.init_from == str(ckpt)


def test_each_preset_plans_at_its_minimum_topology_leaving_remat_to_the_compiled_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from training.cli import main

    for preset in PRESETS:
        assert main(["plan", "--preset", preset]) == 0, preset
        out = capsys.readouterr().out
        assert "by the formula" in out and "remat auto: chosen from the compiled step when a job is launched" in out


def test_the_published_shapes_are_what_the_presets_say() -> None:
    """Head width, vocabulary, tied embeddings and RoPE scaling, as the model cards give them."""
    got = {
        p: (c.model.head_dim, c.model.vocab_size, c.model.tie_embeddings, c.model.rope_scaling, c.model.rope_theta)
        for p in PRESETS
        for c in [load_config(p)]
    }
    assert got == {
        "llama3.2-1b": (64, 128256, True, 32.0, 500000.0),
        "llama3.2-3b": (128, 128256, True, 32.0, 500000.0),
        "llama3.1-8b": (128, 128256, False, 8.0, 500000.0),
        "llama3.1-70b": (128, 128256, False, 8.0, 500000.0),
    }
    # Llama 3 (3.0) keeps its own presets: the same shapes as 3.1, with no RoPE scaling (an 8k context).
    for old, new in (("llama3-8b", "llama3.1-8b"), ("llama3-70b", "llama3.1-70b")):
        a, b = load_config(old).model, load_config(new).model
        assert (a.rope_scaling, param_count(a)) == (0.0, param_count(b))
