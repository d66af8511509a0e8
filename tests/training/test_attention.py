"""The attention kernels: Pallas's splash kernel (interpreted on CPU) and XLA's agree with the reference einsums,
forward and gradients, on packed documents with grouped-query heads, at head widths 32 and 64 (Llama 3.2 1B's);
``auto`` picks splash only on a TPU."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import training.models
from training.models.attention import AttentionError, attention, resolve

B, S, H, KV, D = 2, 256, 4, 2, 32


def _inputs(seed: int = 0, d: int = D) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(B, S, n, d)), jnp.float32) for n in (H, KV, KV))
    seg = np.ones((B, S), np.int32)
    seg[0, 100:], seg[0, 200:] = 2, 3  # documents that end inside the kernel's 128-token tiles
    seg[1, 37:], seg[1, 130:], seg[1, 131:] = 2, 3, 4  # and a one-token document
    return q, k, v, jnp.asarray(seg)


def _loss_and_grads(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> Any:
    w = jnp.cos(jnp.arange(q.shape[-1], dtype=jnp.float32))  # a weighting, so the gradients differ per feature

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return (attention(q, k, v, seg, impl=impl) * w).sum()

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize(("impl", "d"), [("splash", D), ("splash", 64), ("xla", D)])
def test_the_kernel_matches_the_reference_forward_and_gradients_on_packed_documents(impl: str, d: int) -> None:
    q, k, v, seg = _inputs(d=d)
    ref = attention(q, k, v, seg, impl="reference")
    got = attention(q, k, v, seg, impl=impl)
    assert got.shape == (B, S, H, d)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    (loss, grads), (ref_loss, ref_grads) = (
        _loss_and_grads(impl, q, k, v, seg),
        _loss_and_grads("reference", q, k, v, seg),
    )
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-4)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


def test_a_packed_document_does_not_see_the_one_before_it_through_the_splash_kernel() -> None:
    """Row 0's third document (tokens 200..255) attends the same whatever the documents before it hold."""
    q, k, v, seg = _inputs()
    other_k, other_v = _inputs(seed=1)[1:3]
    mixed_k = k.at[0, :200].set(other_k[0, :200])
    mixed_v = v.at[0, :200].set(other_v[0, :200])
    a = attention(q, k, v, seg, impl="splash")[0, 200:]
    b = attention(q, mixed_k, mixed_v, seg, impl="splash")[0, 200:]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(attention(q, mixed_k, mixed_v, seg, impl="splash")[0, 150:200]), a[:50])


def test_auto_is_splash_on_a_tpu_when_the_shapes_fit_its_tiles_and_xla_elsewhere() -> None:
    assert resolve("auto", 2048, 128, "tpu") == "splash"
    assert resolve("auto", 2048, 128, "gpu") == "xla"
    assert resolve("auto", 2048, 128, "cpu") == "xla"
    assert resolve("auto", 2000, 128, "tpu") == "xla"  # not whole 128-token tiles
    # Heads of width 64 (Llama 3.2 1B's) go to the kernel whole: 48.8% MFU against XLA's 34.4% on a v5e.
    assert resolve("auto", 2048, 64, "tpu") == resolve("auto", 8192, 64, "tpu") == "splash"
    assert resolve("auto", 2048, 32, "tpu") == "xla"  # a width splash was never measured at
    assert resolve("reference", 2048, 128, "tpu") == "reference"
    with pytest.raises(AttentionError, match="unknown kernel 'flash'"):
        resolve("flash", 2048, 128)


def test_the_package_exports_the_same_attention_for_a_user_s_model() -> None:
    q, k, v, seg = _inputs()
    got = training.models.attention(q, k, v, segment_ids=seg, impl="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(attention(q, k, v, seg, impl="reference")), atol=1e-5)
    with pytest.raises(AttentionError, match="do not fit"):
        attention(q, k[:, :, :1, :3], v[:, :, :1, :3])
