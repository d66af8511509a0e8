"""The built-in Llama 3: attention kernels agree, documents stay apart, RoPE's scaling, the task's data."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from training.config import ConfigError, load_config
from training.data.tokens import segments
from training.models.llama import REMAT_POLICIES, Llama, LlamaConfig, remat_policy, rope_frequencies
from training.tasks import TaskError, load_task
from training.tasks.lm import llama_config

CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)


def _logits(cfg: LlamaConfig, tokens: np.ndarray, seg: np.ndarray, pos: np.ndarray) -> np.ndarray:
    model = Llama(cfg)
    params = model.init(jax.random.key(0), jnp.asarray(tokens))["params"]
    return np.asarray(model.apply({"params": params}, jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos)))


def test_scanned_layers_compute_what_the_unrolled_blocks_do() -> None:
    tokens = np.random.default_rng(2).integers(0, 64, (2, 12)).astype(np.int32)
    seg, pos = np.ones_like(tokens), np.broadcast_to(np.arange(12, dtype=np.int32), tokens.shape)
    scanned = LlamaConfig(**{**CFG.__dict__, "scan_layers": True})
    model = Llama(scanned)
    params = model.init(jax.random.key(0), jnp.asarray(tokens))["params"]
    unrolled = dict(params)
    stacked = unrolled.pop("layers")
    for i in range(CFG.n_layers):
        unrolled[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    a = model.apply({"params": params}, tokens, seg, pos)
    b = Llama(CFG).apply({"params": unrolled}, tokens, seg, pos)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_the_fused_attention_path_matches_the_reference_einsums() -> None:
    tokens = np.random.default_rng(0).integers(0, 64, (2, 16)).astype(np.int32)
    parts = segments(tokens[0], eos=5)
    seg, pos = np.stack([parts["segment_ids"]] * 2), np.stack([parts["positions"]] * 2)
    fused = _logits(CFG, tokens, seg, pos)
    ref = _logits(LlamaConfig(**{**CFG.__dict__, "attention": "reference"}), tokens, seg, pos)
    np.testing.assert_allclose(fused, ref, rtol=2e-4, atol=2e-4)


def test_a_packed_document_does_not_see_the_one_before_it() -> None:
    """The second document's logits are the same whatever the first document was."""
    rng = np.random.default_rng(1)
    second = rng.integers(6, 64, 8)
    outs = []
    for first in (rng.integers(6, 64, 7), rng.integers(6, 64, 7)):
        tokens = np.concatenate([first, [5], second]).astype(np.int32)[None]
        parts = segments(tokens[0], eos=5)
        outs.append(_logits(CFG, tokens, parts["segment_ids"][None], parts["positions"][None])[0, 8:])
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    alone = np.asarray(second, np.int32)[None]
    one = _logits(CFG, alone, np.ones_like(alone), np.arange(8, dtype=np.int32)[None])[0]
    np.testing.assert_allclose(outs[0], one, rtol=1e-4, atol=1e-4)  # as if it were alone: positions restart


def test_segments_start_after_each_end_of_document() -> None:
    parts = segments(np.array([7, 8, 0, 9, 0, 0, 3], np.int32), eos=0)
    assert parts["segment_ids"].tolist() == [1, 1, 1, 2, 2, 3, 4]
    assert parts["positions"].tolist() == [0, 1, 2, 0, 1, 0, 0]


def test_llama31_rope_scaling_keeps_high_frequencies_and_divides_low_ones() -> None:
    base = np.asarray(rope_frequencies(LlamaConfig(**{**CFG.__dict__, "d_model": 512, "n_heads": 4})))
    scaled = np.asarray(
        rope_frequencies(LlamaConfig(**{**CFG.__dict__, "d_model": 512, "n_heads": 4, "rope_scaling": 8.0}))
    )
    assert scaled[0] == pytest.approx(base[0])  # the fastest rotation: a wavelength far below 8192/4
    assert scaled[-1] == pytest.approx(base[-1] / 8)  # the slowest: beyond 8192, divided by the factor
    assert np.all(scaled <= base + 1e-12)


def test_the_lm_task_refuses_task_args_and_a_dataset_with_a_larger_vocabulary(tiny_dataset: str) -> None:
    cfg = load_config("tiny", None, {"dataset": tiny_dataset, "task_args": {"x": 1}})
    with pytest.raises(TaskError, match="takes no task_args"):
        load_task(cfg)
    larger = load_config("tiny", None, {"dataset": tiny_dataset, "vocab_size": 300})
    assert load_task(larger).data().fingerprint  # 256 byte tokens fit in 300
    with pytest.raises(ValueError, match="below the byte tokenizer"):
        load_config("tiny", None, {"dataset": tiny_dataset, "vocab_size": 100})


def test_the_lm_task_refuses_a_dataset_prepared_with_another_tokenizer(tiny_dataset: str, tmp_path) -> None:
    bpe = load_config("tiny", None, {"dataset": tiny_dataset, "vocab_size": 300, "tokenizer": "bpe"})
    with pytest.raises(TaskError, match="prepared with the bytes tokenizer, the config's tokenizer is bpe"):
        load_task(bpe).data()
    missing = load_config("tiny", None, {"dataset": tiny_dataset, "tokenizer": str(tmp_path / "tokenizer.json")})
    with pytest.raises(ValueError, match="tokenizer file .* does not exist"):
        load_task(missing).data()


def test_the_lm_task_serves_examples_with_segments_from_a_prepared_dataset(tiny_dataset: str) -> None:
    cfg = load_config("tiny", None, {"dataset": tiny_dataset})
    data = load_task(cfg).data()
    ex = data.train[0]
    assert {k: v.shape for k, v in ex.items()} == {k: (cfg.model.seq_len,) for k in ex}
    assert np.array_equal(ex["inputs"][1:], ex["targets"][:-1])
    assert data.validation is not None and len(data.validation) > 0


def test_the_loss_is_optax_s_cross_entropy_and_the_accuracy_counts_targets_with_the_top_logit():
    import optax

    from training.models.llama import cross_entropy

    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 300)) * 3
    targets = jax.random.randint(jax.random.PRNGKey(1), (4, 16), 0, 300)
    targets = targets.at[:, :5].set(jnp.argmax(logits, -1)[:, :5])  # 20 of the 64 tokens predicted right
    loss, acc = cross_entropy(logits, targets)
    want = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    assert float(acc) == float((jnp.argmax(logits, -1) == targets).mean()) == 20 / 64
    grads = jax.grad(lambda x: cross_entropy(x, targets)[0])(logits)
    want_grads = jax.grad(lambda x: optax.softmax_cross_entropy_with_integer_labels(x, targets).mean())(logits)
    np.testing.assert_allclose(np.asarray(grads), np.asarray(want_grads), atol=1e-7)


@pytest.mark.slow
def test_every_remat_policy_gives_the_gradients_of_no_remat() -> None:
    tokens = np.random.default_rng(3).integers(0, 64, (2, 16)).astype(np.int32)
    parts = segments(tokens[0], eos=5)
    seg, pos = np.stack([parts["segment_ids"]] * 2), np.stack([parts["positions"]] * 2)
    base = LlamaConfig(**{**CFG.__dict__, "scan_layers": True})
    params = Llama(base).init(jax.random.key(0), jnp.asarray(tokens))["params"]

    def grads(cfg: LlamaConfig) -> list[np.ndarray]:
        def loss(p: Any) -> jax.Array:
            return jnp.asarray(Llama(cfg).apply({"params": p}, tokens, seg, pos)).std()

        return [np.asarray(g) for g in jax.tree.leaves(jax.jit(jax.grad(loss))(params))]

    want = grads(base)
    for policy in REMAT_POLICIES:
        got = grads(LlamaConfig(**{**base.__dict__, "remat": policy}))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=policy)


def test_remat_takes_a_policy_and_the_old_booleans() -> None:
    assert load_config("tiny", None, {"remat": "dots"}).model.remat == "dots"
    assert load_config("tiny", None, {"remat": True}).model.remat == "full"
    assert load_config("tiny", None, {"remat": False}).model.remat == "none"
    legacy = load_config("tiny", None, {"activation_checkpointing": True})
    assert (legacy.model.remat, legacy.model.activation_checkpointing) == ("full", True)
    assert (
        llama_config(load_config("tiny", None, {"model.remat": "attn", "model.attention": "splash"}).model).remat
        == "attn"
    )
    assert load_config("llama3-8b").model.remat == "full"
    with pytest.raises(ConfigError, match="remat"):
        load_config("tiny", None, {"remat": "some"})
    with pytest.raises(ValueError, match="unknown policy"):
        remat_policy("some")
