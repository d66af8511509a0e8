"""Causal attention over packed documents, by one of three kernels: Pallas's TPU splash kernel, XLA, or einsums.

``attention(q, k, v, segment_ids=..., impl=...)`` takes ``q`` [batch, seq, heads, head_dim]
and ``k``, ``v`` [batch, seq, kv_heads, head_dim] (grouped-query: ``heads`` a multiple of
``kv_heads``) and returns [batch, seq, heads, head_dim].  A token attends to itself and the
earlier tokens of its own segment (document) only.

- ``splash``: Pallas's splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``),
  a flash-style kernel that never holds the seq x seq scores.  Off a TPU it runs in Pallas's
  interpret mode (slow: for checking it on CPU).  On a mesh of several devices it runs per
  device's shard of the batch (and of the heads) under ``shard_map``.
- ``xla``: ``jax.nn.dot_product_attention`` with the mask (cuDNN's fused kernel on a GPU; on TPU
  and CPU, XLA's einsums and softmax, which keep batch x heads x seq x seq scores).
- ``reference``: plain einsums with fp32 scores, for checking the others.
- ``auto``: ``splash`` on a TPU when the sequence is whole 128-token tiles and the head width a
  multiple of 64, ``xla`` otherwise.

The kernel takes a head of any width whole: its blocks span the head (``(block, head_dim)``), and
its softmax statistics and output scratch are widened to the 128 lanes and cut back to the head
(``head_dim_v_repeats = cdiv(head_dim_v, NUM_LANES)`` in ``splash_attention_kernel.py``).  Only the
sequence blocks must be multiples of 128.  So a head of width 64 (Llama 3.2 1B's) goes to the kernel
as it is, with no padding: on one TPU v5e that model trained at 48.8% MFU with splash against 34.4%
with XLA's einsums (issue 59).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
import numpy as np

Impl = Literal["auto", "splash", "xla", "reference"]
IMPLS: tuple[str, ...] = ("auto", "splash", "xla", "reference")
TILE = 128  # the splash kernel's lane width: its sequence blocks are multiples of it
HEAD_WIDTH = 64  # auto picks splash for head widths that are multiples of this (measured on a TPU at 64 and 128)


class AttentionError(ValueError):
    """An attention call that cannot run as asked (a bad kernel name or shapes)."""


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """[batch, 1, q, k]: causal, and only inside the token's own segment."""
    s = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal[None])[:, None]


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Attention as plain einsums (fp32 scores) under a [batch, 1, q, k] mask, for checking the fused paths."""
    nh, nkv = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, nh // nkv, axis=2), jnp.repeat(v, nh // nkv, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def resolve(impl: str, seq_len: int, head_dim: int, platform: str | None = None) -> str:
    """The kernel ``impl`` means on ``platform`` (default: JAX's default backend) for these shapes."""
    if impl not in IMPLS:
        raise AttentionError(f"attention: unknown kernel {impl!r}; known: {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    platform = platform or jax.default_backend()
    fits = seq_len % TILE == 0 and head_dim % HEAD_WIDTH == 0
    return "splash" if platform == "tpu" and fits else "xla"


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *, impl: str = "auto"
) -> jax.Array:
    """Causal grouped-query attention that keeps packed documents (``segment_ids`` [batch, seq]) apart."""
    b, s, nh, hd = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, s) or k.shape[3] != hd or nh % k.shape[2]:
        raise AttentionError(f"attention: q {q.shape} and k {k.shape}, v {v.shape} do not fit (grouped-query)")
    if segment_ids is None:
        segment_ids = jnp.ones((b, s), jnp.int32)
    kind = resolve(impl, s, hd)
    if kind == "reference":
        return reference_attention(q, k, v, attention_mask(segment_ids))
    if kind == "xla":
        return jax.nn.dot_product_attention(q, k, v, mask=attention_mask(segment_ids))
    return _sharded_splash(q, k, v, segment_ids.astype(jnp.int32))


def _block(seq_len: int) -> int:
    """The splash tile along the sequence: the largest of 512, 256, 128 that divides it."""
    for b in (512, 256, 128):
        if seq_len % b == 0:
            return b
    raise AttentionError(
        f"attention: the splash kernel needs a sequence length that is a multiple of 128, got {seq_len}"
    )


@functools.lru_cache(maxsize=16)
def _kernel(seq_len: int, heads: int, interpret: bool) -> Any:
    """The splash kernel for one (sequence, heads) shape: causal, tiles of ``_block``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    bs = _block(seq_len)
    sizes = sk.BlockSizes(
        block_q=bs,
        block_kv=bs,
        block_kv_compute=bs,
        block_q_dkv=bs,
        block_kv_dkv=bs,
        block_kv_dkv_compute=bs,
        block_q_dq=bs,
        block_kv_dq=bs,
    )
    mask = sm.MultiHeadMask([sm.CausalMask((seq_len, seq_len)) for _ in range(heads)])
    # Built in a thread of its own, outside the caller's trace (JAX's trace state is per thread), and its
    # block tables turned into host arrays: device arrays a jitted step closes over become its hidden
    # arguments, which an ahead-of-time compiled step is then called without.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        kernel = pool.submit(
            sk.make_splash_mha, mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
        ).result()
    return jax.tree.map(np.asarray, kernel)


def _splash(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """The splash kernel on one device's rows: [b, s, h, d] in and out, vmapped over the batch."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    s, nh, hd = q.shape[1], q.shape[2], q.shape[3]
    kernel = _kernel(s, nh, jax.default_backend() != "tpu")
    qt = jnp.swapaxes(q * jnp.asarray(1.0 / math.sqrt(hd), q.dtype), 1, 2)  # the kernel does not scale
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    out = jax.vmap(kernel)(qt, kt, vt, segment_ids=sk.SegmentIds(q=segment_ids, kv=segment_ids))
    return jnp.swapaxes(cast(jax.Array, out), 1, 2)


def _sharded_splash(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """The splash kernel, per device under ``shard_map`` when the trace has a mesh of several devices.

    A Pallas call is opaque to XLA's partitioner: each device runs it on its own rows (``act_batch``)
    and heads (``act_heads``), as the logical axis rules in force shard them.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return _splash(q, k, v, segment_ids)
    import flax.linen as nn
    from jax.sharding import PartitionSpec as P

    spec: Any = nn.logical_to_mesh_axes(("act_batch", None, "act_heads", None))
    batch = _dividing(spec[0], mesh, q.shape[0])  # (the model's init traces one row: replicated then)
    heads = _dividing(spec[2], mesh, math.gcd(q.shape[2], k.shape[2]))
    qkv = P(batch, None, heads, None)
    fn = jax.shard_map(_splash, mesh=mesh, in_specs=(qkv, qkv, qkv, P(batch, None)), out_specs=qkv, check_vma=False)
    return fn(q, k, v, segment_ids)


def _dividing(axes: Any, mesh: Any, size: int) -> Any:
    """``axes`` (a mesh axis, several, or None) when they split ``size`` evenly, else None (not split)."""
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    n = math.prod(int(mesh.shape[a]) for a in names)
    return axes if names and size % n == 0 else None
