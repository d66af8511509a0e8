"""Hugging Face Llama weights in and out, checked against transformers' own LlamaForCausalLM.

The fixtures under data/hf are tiny random Llama 3 models that transformers made (make_fixtures.py): GQA with
Llama 3's RoPE scaling and an untied head, and a tied one with a single key/value head, each with the logits
transformers gives for a batch of token ids (``reference.npz``).  Our Llama, given their weights through
``init_from``, must give the same logits; an export must give back the same files' tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from training import hf
from training.config import ConfigError, load_config
from training.tasks.lm import LanguageModel

FIXTURES = Path(__file__).parent / "data" / "hf"
MODELS = ("llama3-gqa-scaled", "llama3-tied")
TOLERANCE = 1e-4  # float32 logits of magnitude ~6; the two implementations agree to ~6e-6


def task_for(model_dir: Path | str, *overrides: str) -> LanguageModel:
    cfg = load_config(None, None, [f"init_from={model_dir}", *overrides])
    return LanguageModel(cfg.model, cfg.data)


def abstract_params(task: LanguageModel) -> Any:
    return nn.unbox(jax.eval_shape(task.init, jax.random.key(0)))


def our_logits(task: LanguageModel, params: Any, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(task.logits(params, {"inputs": jnp.asarray(tokens)}))


def reference(name: str) -> Any:
    return np.load(FIXTURES / name / "reference.npz")


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("name", MODELS)
def test_a_checkpoint_loaded_with_init_from_gives_transformers_logits(name: str, scan: bool) -> None:
    task = task_for(FIXTURES / name, f"scan_layers={scan}")
    params = hf.to_params(hf.Checkpoint(str(FIXTURES / name)), abstract_params(task), task.model_cfg)
    ref = reference(name)
    diff = np.abs(our_logits(task, params, ref["tokens"]) - ref["logits"]).max()
    assert diff < TOLERANCE, f"{name}: logits differ from transformers' by {diff:.3g}"


def test_the_config_takes_the_checkpoint_s_shapes_rope_and_tokenizer() -> None:
    cfg = load_config(None, None, [f"init_from={FIXTURES / 'llama3-gqa-scaled'}"])
    got = {k: getattr(cfg, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")}
    assert got == {"vocab_size": 320, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 48}
    assert (cfg.model.rope_theta, cfg.model.rope_scaling, cfg.model.rope_original_context) == (100.0, 8.0, 32)
    assert cfg.model.tie_embeddings is False
    assert cfg.data.tokenizer == str(FIXTURES / "llama3-gqa-scaled" / "tokenizer.json")
    assert cfg.data.dataset.endswith("var/data/stdlib-llama3-gqa-scaled-seq64")
    assert load_config(None, None, [f"init_from={FIXTURES / 'llama3-tied'}"]).model.tie_embeddings is True


def test_a_key_the_config_sets_must_agree_with_the_checkpoint() -> None:
    with pytest.raises(ConfigError, match=r"init_from: .*llama3-tied has d_model=32, the config sets d_model=64$"):
        load_config(None, None, [f"init_from={FIXTURES / 'llama3-tied'}", "d_model=64"])
    # The same value, or a key the preset alone sets, is fine.
    assert load_config("small", None, [f"init_from={FIXTURES / 'llama3-tied'}", "d_model=32"]).model.d_model == 32


def test_init_from_is_for_the_built_in_llama_only() -> None:
    with pytest.raises(ConfigError, match="init_from loads a Hugging Face Llama into the built-in lm task"):
        load_config(None, None, [f"init_from={FIXTURES / 'llama3-tied'}", "task=examples/regression/task.py:make_task"])


def _copy(tmp_path: Path, name: str = "llama3-tied") -> Path:
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    return out


def _edit_config(d: Path, **changes: Any) -> None:
    data = json.loads((d / "config.json").read_text())
    data.update(changes)
    (d / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda d: (d / "config.json").unlink(),
            r"config.json: missing \(a Hugging Face checkpoint has a config.json\)",
        ),
        (lambda d: _edit_config(d, architectures=["MistralForCausalLM"]), "architecture MistralForCausalLM is not"),
        (lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
        (lambda d: _edit_config(d, hidden_act="gelu"), "hidden_act is 'gelu'; this Llama has 'silu' only"),
    ],
)
def test_a_bad_checkpoint_is_one_line_naming_it(tmp_path: Path, damage: Any, message: str) -> None:
    d = _copy(tmp_path)
    damage(d)
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, None, [f"init_from={d}"])
    assert "\n" not in str(e.value)


def test_missing_weights_and_a_shape_mismatch_are_one_line_naming_them(tmp_path: Path) -> None:
    """The worker's own reading refuses them too (a config names them first: test_hf_checks.py)."""
    d = _copy(tmp_path)
    keys = dict(hf.checkpoint_keys(str(d)).model) | {"d_ff": 64}
    cfg = load_config(None, None, {f"model.{k}": v for k, v in keys.items()})
    task = LanguageModel(cfg.model, cfg.data)
    with pytest.raises(
        hf.HFError, match=r"model.layers.0.mlp.gate_proj.weight has shape \[48, 32\], .* needs \[64, 32\]"
    ):
        hf.to_params(hf.Checkpoint(str(d)), abstract_params(task), task.model_cfg)
    (d / "model.safetensors").unlink()
    with pytest.raises(hf.HFError, match=r"no \*.safetensors file"):
        hf.Checkpoint(str(d))


def _meta_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Meta's interleaved-pairs rotary layout of a [out, in] q/k weight (what a converter undoes)."""
    out, inp = w.shape
    return w.reshape(heads, 2, out // heads // 2, inp).transpose(0, 2, 1, 3).reshape(out, inp)


WRONG = {
    "q/k in Meta's interleaved rotary layout": lambda name, w: (
        _meta_permute(w, 4 if "q_proj" in name else 2) if "q_proj" in name or "k_proj" in name else w
    ),
    "o_proj not transposed": lambda name, w: w.T if "o_proj" in name else w,
    "the two norms of a block swapped": lambda name, w: w,  # swapped below, by name
}


@pytest.mark.parametrize("mistake", list(WRONG))
def test_a_wrong_mapping_is_caught_by_the_logits(mistake: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: each of these mistakes moves the logits far past the tolerance."""
    name = "llama3-gqa-scaled"
    get = hf.Checkpoint.get

    def wrong(self: hf.Checkpoint, tensor: str) -> np.ndarray:
        if mistake.startswith("the two norms"):
            swap = {"input_layernorm": "post_attention_layernorm", "post_attention_layernorm": "input_layernorm"}
            for a, b in swap.items():
                if a in tensor:
                    return get(self, tensor.replace(a, b))
        return np.asarray(WRONG[mistake](tensor, get(self, tensor)))

    monkeypatch.setattr(hf.Checkpoint, "get", wrong)
    task = task_for(FIXTURES / name)
    params = hf.to_params(hf.Checkpoint(str(FIXTURES / name)), abstract_params(task), task.model_cfg)
    ref = reference(name)
    assert np.abs(our_logits(task, params, ref["tokens"]) - ref["logits"]).max() > 100 * TOLERANCE


@pytest.mark.parametrize("shard_bytes", [hf.SHARD_BYTES, 40_000])
@pytest.mark.parametrize("name", MODELS)
def test_an_export_reads_back_to_the_same_weights_and_config(
    name: str, shard_bytes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.numpy import load_file
    from transformers import LlamaConfig

    monkeypatch.setattr(hf, "SHARD_BYTES", shard_bytes)
    task = task_for(FIXTURES / name, "scan_layers=true")
    source = hf.Checkpoint(str(FIXTURES / name))
    params = hf.to_params(source, abstract_params(task), task.model_cfg)
    tensors = hf.from_params(params, task.model_cfg, np.dtype(np.float32))
    out = tmp_path / "export"
    files = hf.write_checkpoint(out, tensors, hf.hf_config(task.model_cfg, "float32"), b"{}")
    assert (len([f for f in files if f.endswith(".safetensors")]) > 1) == (shard_bytes == 40_000)
    # Every tensor of the source, bit for bit, read by the safetensors library (not our reader).
    written: dict[str, np.ndarray] = {}
    for f in files:
        if f.endswith(".safetensors"):
            written |= load_file(out / f)
    assert set(written) == set(source.tensors) - ({"lm_head.weight"} if task.model_cfg.tie_embeddings else set())
    for t, arr in written.items():
        np.testing.assert_array_equal(arr, source.get(t), err_msg=t)
    # transformers reads the config to the same model; our reader to the same keys.
    theirs, ours = LlamaConfig.from_pretrained(out), LlamaConfig.from_pretrained(FIXTURES / name)
    for key in ("hidden_size", "num_key_value_heads", "tie_word_embeddings", "rope_parameters", "head_dim"):
        assert getattr(theirs, key) == getattr(ours, key), key
    assert hf.checkpoint_keys(str(out)).model == hf.checkpoint_keys(str(FIXTURES / name)).model


def test_bfloat16_weights_read_as_the_model_s_dtype(tmp_path: Path) -> None:
    src = hf.Checkpoint(str(FIXTURES / "llama3-tied"))
    d = _copy(tmp_path)
    bf16 = {t: src.get(t).astype(hf.DTYPES["BF16"]) for t in src.tensors}
    hf.write_safetensors(d / "model.safetensors", bf16, {"format": "pt"})
    task = task_for(d)
    params = hf.to_params(hf.Checkpoint(str(d)), abstract_params(task), task.model_cfg)
    assert params["embed"].dtype == np.float32
    np.testing.assert_array_equal(params["embed"], bf16["model.embed_tokens.weight"].astype(np.float32))


def test_transformers_regenerates_the_fixtures_where_torch_is_installed(tmp_path: Path) -> None:
    """make_fixtures.py again, with torch: the same logits; and transformers loads an export to them."""
    pytest.importorskip("torch")
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    assert spec and spec.loader
    mf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mf)
    mf.make(tmp_path / "again")
    for name in MODELS:
        np.testing.assert_allclose(
            reference(name)["logits"], np.load(tmp_path / "again" / name / "reference.npz")["logits"], atol=TOLERANCE
        )
        task = task_for(FIXTURES / name)
        params = hf.to_params(hf.Checkpoint(str(FIXTURES / name)), abstract_params(task), task.model_cfg)
        out = tmp_path / "export" / name
        hf.write_checkpoint(
            out,
            hf.from_params(params, task.model_cfg, np.dtype(np.float32)),
            hf.hf_config(task.model_cfg, "float32"),
            None,
        )
        assert mf.check(out, FIXTURES / name) < TOLERANCE


@pytest.mark.slow
def test_a_run_starts_from_init_from_and_exports_what_it_trained(tmp_path: Path, jax_cache: str, gcs_root: str) -> None:
    """A real job (2 hosts) from a checkpoint, at a learning rate too small to move the logits; both exports."""
    import orbax.checkpoint as ocp
    from jobs import job_config, run_job

    from training import data
    from training.api import export, validate

    name = "llama3-gqa-scaled"
    model = FIXTURES / name
    dataset = str(tmp_path / "data")
    data.prepare(None, dataset, 32, tokenizer=str(model / "tokenizer.json"), max_bytes=300_000)
    cfg = job_config(
        str(tmp_path / "runs"),
        dataset,
        jax_cache,
        init_from=str(model),
        run_name="ft",
        seq_len=32,
        steps=2,
        checkpoint_every=2,
        learning_rate=1e-7,
        min_workers=2,
        max_workers=2,
    )
    assert run_job(cfg) == 0
    assert validate(cfg.run_uri)["verdict"] == "validated"
    out = export(cfg.run_uri, str(tmp_path / "hf"), "hf")
    assert out["step"] == 2 and "tokenizer.json" in out["files"]
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    # Where texts begin and end, for generate(): the source checkpoint's generation_config.json, whole.
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen == json.loads((model / "generation_config.json").read_text())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (gen["bos_token_id"], gen["eos_token_id"])
    task = task_for(tmp_path / "hf", "seq_len=32")
    params = hf.to_params(hf.Checkpoint(str(tmp_path / "hf")), abstract_params(task), task.model_cfg)
    ref = reference(name)
    diff = np.abs(our_logits(task, params, ref["tokens"]) - ref["logits"]).max()
    assert diff < TOLERANCE, f"the exported step's logits differ from transformers' by {diff:.3g}"
    # The same export to gs:// (the emulator) reads back to the same tensors.
    assert export(cfg.run_uri, f"{gcs_root}/hf", "hf")["files"] == out["files"]
    on_gcs, local = hf.Checkpoint(f"{gcs_root}/hf"), hf.Checkpoint(str(tmp_path / "hf"))
    for t in local.tensors:
        np.testing.assert_array_equal(on_gcs.get(t), local.get(t), err_msg=t)
    # The plain Orbax export: the named tree, restored by Orbax alone.
    export(cfg.run_uri, str(tmp_path / "orbax"), "orbax", step=2)
    with ocp.StandardCheckpointer() as ck:
        tree = ck.restore(tmp_path / "orbax")
    np.testing.assert_array_equal(tree["layers_1"]["attn"]["k"]["kernel"], params["layers_1"]["attn"]["k"]["kernel"])
    np.testing.assert_array_equal(tree["embed"], params["embed"])
    # The DAG's export task: the same step through the operator; skipped when its params are empty.
    from airflow.sdk.exceptions import AirflowSkipException
    from rtrain_airflow.operators.training import RTrainExportCheckpointOperator

    spec = {"config": json.loads(cfg.to_json()), "run_uri": cfg.run_uri, "backend": "local"}
    op = RTrainExportCheckpointOperator(
        task_id="export", spec=spec, export_format="hf", export_dir=str(tmp_path / "op")
    )
    assert op.execute({})["files"] == out["files"]  # type: ignore[arg-type]
    for name in out["files"]:
        assert (tmp_path / "op" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    with pytest.raises(AirflowSkipException):
        RTrainExportCheckpointOperator(task_id="export", spec=spec, export_format="hf", export_dir="").execute({})  # type: ignore[arg-type]


def test_a_checkpoint_on_gcs_loads_as_a_local_one(gcs_root: str) -> None:
    """init_from=gs://...: config.json, the safetensors' ranges and tokenizer.json read over HTTP (the emulator)."""
    from training.data.tokenizer import resolve
    from training.storage import open_store

    name = "llama3-gqa-scaled"
    store = open_store(f"{gcs_root}/{name}")
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        store.put(f, (FIXTURES / name / f).read_bytes())
    cfg = load_config(None, None, [f"init_from={gcs_root}/{name}"])
    assert cfg.data.tokenizer == f"{gcs_root}/{name}/tokenizer.json" and cfg.model.n_kv_heads == 2
    assert resolve(cfg.data.tokenizer).fingerprint == resolve(str(FIXTURES / name / "tokenizer.json")).fingerprint
    task = LanguageModel(cfg.model, cfg.data)
    params = hf.to_params(hf.Checkpoint(cfg.model.init_from), abstract_params(task), task.model_cfg)
    ref = reference(name)
    assert np.abs(our_logits(task, params, ref["tokens"]) - ref["logits"]).max() < TOLERANCE


def test_an_export_is_refused_in_one_line_without_a_validated_step_or_into_a_full_directory(tmp_path: Path) -> None:
    from training.export import ExportError, export

    cfg = load_config(None, None, [f"root={tmp_path / 'runs'}", "run_name=none"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ExportError, match=r"--output .*full exists and is not an empty directory$"):
        export(cfg, str(tmp_path / "full"), "hf")
    with pytest.raises(
        ExportError, match=r"has no validated checkpoint \(rtrain validate it, or name one with --step\)$"
    ):
        export(cfg, str(tmp_path / "out"), "orbax")
    with pytest.raises(ExportError, match=r"step 3 is not a committed checkpoint of .*none \(committed: \[\]\)$"):
        export(cfg, str(tmp_path / "out"), "hf", step=3)


@pytest.mark.parametrize("scan", [False, True])
def test_load_params_places_each_weight_with_its_sharding(scan: bool) -> None:
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    name = "llama3-gqa-scaled"
    task = task_for(FIXTURES / name, f"scan_layers={scan}")
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P())), abstract_params(task)
    )
    placed = hf.load_params(str(FIXTURES / name), abstract, task.model_cfg)
    host = hf.to_params(hf.Checkpoint(str(FIXTURES / name)), abstract, task.model_cfg)
    assert jax.tree.structure(placed) == jax.tree.structure(host)  # type: ignore[operator]
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(host), strict=True):
        assert isinstance(got, jax.Array) and got.sharding == NamedSharding(mesh, P())
        np.testing.assert_array_equal(np.asarray(got), want)
