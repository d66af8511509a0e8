"""Llama 3: a decoder-only transformer with RoPE, RMSNorm, SwiGLU and grouped-query attention.

Parameters carry *logical* axis names (``vocab``, ``embed``, ``heads``, ``mlp``,
``norm``, ``layers``), and activations ``act_*`` ones; the mesh rules map them onto
whatever mesh the job runs on (under the trainer's mesh and rules context: a
constraint is a no-op without one).  With ``scan_layers`` the blocks are one
``nn.scan`` over layers (one compiled block, whatever the depth); each block is
rematerialised under the ``remat`` policy (:data:`REMAT_POLICIES`).  Packed
documents are kept apart by segment ids: a token attends only to earlier tokens
of its own document, and its rotary position counts from its document's start.
The attention kernel is :func:`training.models.attention.attention`'s ``impl``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from training.models.attention import attention, attention_mask, reference_attention

__all__ = ["Llama", "LlamaConfig", "attention_mask", "cross_entropy", "reference_attention"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_save = jax.checkpoint_policies.save_only_these_names
# What each block keeps for the backward pass; the rest is recomputed ("none": no rematerialisation).
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,  # only the block's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # every projection's output
    "qkv_proj": _save("q_proj", "k_proj", "v_proj"),  # the attention's input projections
    "attn": _save("q_proj", "k_proj", "v_proj", "context"),  # those and the attention's output
    "attn_mlp": _save("q_proj", "k_proj", "v_proj", "context", "mlp_hidden"),  # and the MLP's gated hidden
}


def remat_policy(remat: str | bool) -> str:
    """A remat setting as a policy name (the old booleans: true is ``full``, false ``none``)."""
    name = ("full" if remat else "none") if isinstance(remat, bool) else remat
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat: unknown policy {remat!r}; known: {', '.join(REMAT_POLICIES)}")
    return name


@dataclass(frozen=True)
class LlamaConfig:
    """The shapes and numerics of one Llama model."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    rope_theta: float = 500000.0
    rope_scaling: float = 0.0  # Llama 3.1's factor (8); 0: plain RoPE
    rope_original_context: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"  # a REMAT_POLICIES name (True/False: full/none)
    scan_layers: bool = False
    attention: str = "auto"  # auto, splash, xla or reference (training.models.attention)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def param_count(self) -> int:
        """Parameters, from the shapes alone."""
        h, hd = self.d_model, self.head_dim
        attn = h * self.n_heads * hd * 2 + h * self.n_kv_heads * hd * 2
        per_layer = attn + 3 * h * self.d_ff + 2 * h
        head = 0 if self.tie_embeddings else h * self.vocab_size
        return self.vocab_size * h + self.n_layers * per_layer + h + head


def rope_frequencies(cfg: LlamaConfig) -> jax.Array:
    """Inverse frequencies of the rotary embedding, with Llama 3.1's long-context scaling when asked."""
    hd = cfg.head_dim
    freqs = [1.0 / cfg.rope_theta ** (i / hd) for i in range(0, hd, 2)]
    if cfg.rope_scaling:
        low_wavelen, high_wavelen = cfg.rope_original_context / 1.0, cfg.rope_original_context / 4.0
        scaled = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                scaled.append(f)
            elif wavelen > low_wavelen:
                scaled.append(f / cfg.rope_scaling)
            else:
                smooth = (cfg.rope_original_context / wavelen - 1.0) / (4.0 - 1.0)
                scaled.append((1 - smooth) * f / cfg.rope_scaling + smooth * f)
        freqs = scaled
    return jnp.asarray(freqs, jnp.float32)


def apply_rope(x: jax.Array, positions: jax.Array, freqs: jax.Array) -> jax.Array:
    """Rotate ``x`` [batch, seq, heads, head_dim] by its positions [batch, seq] (halves rotated together)."""
    angles = positions[:, :, None, None].astype(jnp.float32) * freqs  # [b, s, 1, hd/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def constrain(x: jax.Array, *axes: str | None) -> jax.Array:
    """Pin an activation's sharding by its logical axes (batch rows stay on their devices)."""
    return cast(jax.Array, nn.with_logical_constraint(x, axes))


def _dense(features: int, axes: tuple[str, str], cfg: LlamaConfig, name: str) -> nn.Dense:
    return nn.Dense(
        features,
        use_bias=False,
        dtype=DTYPES[cfg.dtype],
        param_dtype=DTYPES[cfg.param_dtype],
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), axes),
        name=name,
    )


class RMSNorm(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = cast(
            jax.Array,
            self.param(
                "scale",
                nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                (x.shape[-1],),
                DTYPES[self.cfg.param_dtype],
            ),
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.cfg.norm_eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


class Attention(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, s, _ = x.shape
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        q = checkpoint_name(_dense(nh * hd, ("embed", "heads"), cfg, "q")(x), "q_proj").reshape(b, s, nh, hd)
        k = checkpoint_name(_dense(nkv * hd, ("embed", "heads"), cfg, "k")(x), "k_proj").reshape(b, s, nkv, hd)
        v = checkpoint_name(_dense(nkv * hd, ("embed", "heads"), cfg, "v")(x), "v_proj").reshape(b, s, nkv, hd)
        q, k, v = (constrain(t, "act_batch", "act_len", "act_heads", None) for t in (q, k, v))
        freqs = rope_frequencies(cfg)
        q, k = apply_rope(q, positions, freqs), apply_rope(k, positions, freqs)
        out = checkpoint_name(attention(q, k, v, segment_ids, impl=cfg.attention), "context")
        out = constrain(out, "act_batch", "act_len", "act_heads", None).reshape(b, s, nh * hd)
        return constrain(_dense(cfg.d_model, ("heads", "embed"), cfg, "o")(out), "act_batch", "act_len", "act_embed")


class MLP(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = _dense(self.cfg.d_ff, ("embed", "mlp"), self.cfg, "gate")(x)
        up = _dense(self.cfg.d_ff, ("embed", "mlp"), self.cfg, "up")(x)
        hidden = constrain(checkpoint_name(nn.silu(gate) * up, "mlp_hidden"), "act_batch", "act_len", "act_mlp")
        return constrain(
            _dense(self.cfg.d_model, ("mlp", "embed"), self.cfg, "down")(hidden), "act_batch", "act_len", "act_embed"
        )


class Block(nn.Module):
    """One decoder layer; its call signature is a scan body's: (carry, *broadcast) -> (carry, None)."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, None]:
        x = constrain(x, "act_batch", "act_len", "act_embed")
        x = x + Attention(self.cfg, name="attn")(RMSNorm(self.cfg, name="attn_norm")(x), positions, segment_ids)
        x = x + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg, name="mlp_norm")(x))
        return constrain(x, "act_batch", "act_len", "act_embed"), None


class Llama(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab] (fp32)."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(
        self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        cfg = self.cfg
        b, s = tokens.shape
        if segment_ids is None:
            segment_ids = jnp.ones((b, s), jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        embed = cast(
            jax.Array,
            self.param(
                "embed",
                nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
                (cfg.vocab_size, cfg.d_model),
                DTYPES[cfg.param_dtype],
            ),
        )
        x = constrain(jnp.take(embed, tokens, axis=0).astype(DTYPES[cfg.dtype]), "act_batch", "act_len", "act_embed")
        block: Any = Block
        policy = remat_policy(cfg.remat)
        if policy != "none":
            block = nn.remat(block, prevent_cse=False, policy=REMAT_POLICIES[policy])
        if cfg.scan_layers:  # one compiled block, whatever the depth
            layers = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast),
                length=cfg.n_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = layers(cfg, name="layers")(x, positions, segment_ids)
        else:
            for i in range(cfg.n_layers):
                x, _ = block(cfg, name=f"layers_{i}")(x, positions, segment_ids)
        x = RMSNorm(cfg, name="final_norm")(x)
        if cfg.tie_embeddings:
            logits = jnp.einsum("bsd,vd->bsv", x, embed.astype(x.dtype))
        else:
            logits = _dense(cfg.vocab_size, ("embed", "vocab"), cfg, "head")(x)
        return constrain(logits.astype(jnp.float32), "act_batch", "act_len", "act_vocab")


def cross_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean next-token loss and token accuracy (the share of tokens whose target has the top logit).

    The accuracy reuses the softmax's own maximum: the target is a top logit exactly when its logit,
    less the maximum, is 0.  An ``argmax`` would be one more pass over the logits, a few per cent of a
    small model's step on CPU.
    """
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    shifted = logits - top
    target = jnp.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0]
    nll = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1)) - target
    acc = (target >= 0).astype(jnp.float32)
    return nll.mean(), acc.mean()
