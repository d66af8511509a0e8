"""An export that generates: config.json's ``bos_token_id``/``eos_token_id`` and a generation_config.json, from the
checkpoint the run started from (when it tokenizes with that checkpoint's tokenizer) or from the run's tokenizer.

transformers reads them from an export here; its ``generate()``, which needs torch (not a dependency of the
project), stops at the end of a text where torch is installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from training import hf
from training.config import Config, load_config
from training.export import generation, write_hf
from training.tasks.lm import LanguageModel

FIXTURE = Path(__file__).parent / "data" / "hf" / "llama3-tied"


def _copy(tmp_path: Path) -> Path:
    d = tmp_path / "llama3-tied"
    shutil.copytree(FIXTURE, d)
    return d


def test_the_source_checkpoint_s_generation_config_is_taken_whole(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    source = {"bos_token_id": 7, "eos_token_id": [0, 5], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (d / hf.GENERATION_FILE).write_text(json.dumps(source))
    gen = generation(load_config(None, None, [f"model.init_from={d}"]))
    assert gen is not None and gen.ids == {"bos_token_id": 7, "eos_token_id": [0, 5]}
    assert gen.config == source and gen.source == f"{d} (generation_config.json)"
    # Without one, config.json's ids.
    (d / hf.GENERATION_FILE).unlink()
    config = json.loads((d / "config.json").read_text()) | {"bos_token_id": 3, "eos_token_id": 4}
    (d / "config.json").write_text(json.dumps(config))
    gen = generation(load_config(None, None, [f"model.init_from={d}"]))
    assert gen is not None and gen.ids == gen.config == {"bos_token_id": 3, "eos_token_id": 4}


def test_the_run_s_tokenizer_gives_them_when_it_is_not_the_source_s(tmp_path: Path, tiny_dataset: str) -> None:
    """A tokenizer.json with a beginning-of-text token; the byte tokenizer (a text begins after an eos)."""
    from tokenizers import Tokenizer

    from training import data

    tok = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    tok.add_special_tokens(["<|begin_of_text|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    dataset = str(tmp_path / "data")
    data.prepare(None, dataset, 32, tokenizer=str(tmp_path / "tokenizer.json"), max_bytes=30_000)
    cfg = load_config(None, None, [f"data.dataset={dataset}", f"data.tokenizer={tmp_path / 'tokenizer.json'}"])
    gen = generation(cfg)
    assert gen is not None and gen.ids == {"bos_token_id": 320, "eos_token_id": 0}  # <|begin_of_text|>, <|end_of_text|>
    assert gen.source == "the run's huggingface tokenizer"
    # The source's ids only go with the source's own tokenizer: with the bytes tokenizer, its ids (eos 0).
    d = _copy(tmp_path / "src")
    (d / hf.GENERATION_FILE).write_text(json.dumps({"bos_token_id": 7, "eos_token_id": 9}))
    cfg = load_config(None, None, [f"model.init_from={d}", "data.tokenizer=bytes", f"data.dataset={tiny_dataset}"])
    gen = generation(cfg)
    assert (
        gen is not None and gen.ids == {"bos_token_id": 0, "eos_token_id": 0} and gen.source.endswith("bytes tokenizer")
    )


def test_transformers_reads_an_export_s_ids(tmp_path: Path) -> None:
    from transformers import GenerationConfig, LlamaConfig

    d = _copy(tmp_path)
    (d / hf.GENERATION_FILE).write_text(json.dumps({"bos_token_id": 7, "eos_token_id": [0, 5], "temperature": 0.6}))
    out = _export(load_config(None, None, [f"model.init_from={d}"]), tmp_path / "out")
    assert "generation_config.json" in {p.name for p in out.iterdir()}
    theirs = GenerationConfig.from_pretrained(out)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.temperature) == (7, [0, 5], 0.6)
    model = LlamaConfig.from_pretrained(out)
    assert (model.bos_token_id, model.eos_token_id) == (7, [0, 5])


def _export(cfg: Config, out: Path, norm_scale: float = 1.0) -> Path:
    """The run's parameters as ``rtrain export --format hf`` writes a step (training.export.write_hf): here the
    init_from checkpoint's own, its final norm scaled by ``norm_scale``."""
    import flax.linen as nn
    import jax

    task = LanguageModel(cfg.model, cfg.data)
    abstract = nn.unbox(jax.eval_shape(task.init, jax.random.key(0)))
    params = hf.to_params(hf.Checkpoint(cfg.model.init_from), abstract, task.model_cfg)
    params["final_norm"]["scale"] = params["final_norm"]["scale"] * norm_scale
    write_hf(cfg, params, out)
    return out


def test_generate_stops_at_the_end_of_a_text_where_torch_is_installed(tmp_path: Path) -> None:
    """A model whose every next token is the eos (its final norm zeroed: every logit 0, argmax id 0): generate()
    stops after one new token; without the export's eos_token_id it would run to max_new_tokens (transformers'
    default eos is 2)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    cfg = load_config(None, None, [f"model.init_from={FIXTURE}"])
    out = _export(cfg, tmp_path / "out", norm_scale=0.0)
    model = LlamaForCausalLM.from_pretrained(out, dtype="float32").eval()
    prompt = torch.tensor([[5, 17, 42]])
    ids = model.generate(prompt, max_new_tokens=20, do_sample=False)
    assert ids.shape[1] == prompt.shape[1] + 1 and int(ids[0, -1]) == 0
    np.testing.assert_array_equal(ids[0, :3].numpy(), prompt[0].numpy())
