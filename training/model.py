"""A decoder-only transformer (Llama-style: RMSNorm, SwiGLU, grouped-query attention).

Parameters carry *logical* axis names (``embed``, ``mlp``, ``heads``, ``vocab``);
``training.mesh`` maps them onto the mesh axes of whatever topology the job
runs on, so the same model code serves every mesh the elastic agent builds.
"""

from __future__ import annotations

from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from training.config import Config

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _dense(features: int, axes: tuple[str | None, str | None], cfg: Config, name: str) -> nn.Dense:
    return nn.Dense(
        features,
        use_bias=False,
        dtype=DTYPES[cfg.dtype],
        param_dtype=DTYPES[cfg.param_dtype],
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), axes),
        name=name,
    )


class RMSNorm(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale: jax.Array = cast(
            jax.Array,
            self.param(
                "scale",
                nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                (x.shape[-1],),
                DTYPES[self.cfg.param_dtype],
            ),
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


class Attention(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, s, _ = x.shape
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.kv_heads
        q = _dense(nh * hd, ("embed", "heads"), cfg, "q")(x).reshape(b, s, nh, hd)
        k = _dense(nkv * hd, ("embed", "heads"), cfg, "k")(x).reshape(b, s, nkv, hd)
        v = _dense(nkv * hd, ("embed", "heads"), cfg, "v")(x).reshape(b, s, nkv, hd)
        if nkv != nh:  # grouped-query attention: each kv head serves nh // nkv query heads
            k = jnp.repeat(k, nh // nkv, axis=2)
            v = jnp.repeat(v, nh // nkv, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(hd).astype(jnp.float32)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(causal[None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nh * hd)
        return _dense(cfg.d_model, ("heads", "embed"), cfg, "o")(out)


class MLP(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = _dense(self.cfg.d_ff, ("embed", "mlp"), self.cfg, "gate")(x)
        up = _dense(self.cfg.d_ff, ("embed", "mlp"), self.cfg, "up")(x)
        return _dense(self.cfg.d_model, ("mlp", "embed"), self.cfg, "down")(nn.silu(gate) * up)


class Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + Attention(self.cfg, name="attn")(RMSNorm(self.cfg, name="attn_norm")(x))
        return x + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg, name="mlp_norm")(x))


class Transformer(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        pdt = DTYPES[cfg.param_dtype]
        embed: jax.Array = cast(
            jax.Array,
            self.param(
                "embed",
                nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
                (cfg.vocab_size, cfg.d_model),
                pdt,
            ),
        )
        pos: jax.Array = cast(
            jax.Array,
            self.param(
                "pos",
                nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed")),
                (cfg.seq_len, cfg.d_model),
                pdt,
            ),
        )
        x = (jnp.take(embed, tokens, axis=0) + pos[None, : tokens.shape[1]]).astype(DTYPES[cfg.dtype])
        block = nn.remat(Block) if cfg.activation_checkpointing else Block
        for i in range(cfg.n_layers):
            x = block(cfg, name=f"block_{i}")(x)
        x = RMSNorm(cfg, name="final_norm")(x)
        head = _dense(cfg.vocab_size, ("embed", "vocab"), cfg, "head")
        return head(x).astype(jnp.float32)


def loss_fn(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    acc = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return nll.mean(), {"accuracy": acc.mean()}
