"""The shapes the accelerator row trains (our ~1B Llama 3, the published Llama 3.2 1B, a small one for CPU), and the
packed documents of random tokens each trains on."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.config import Config


@dataclass(frozen=True)
class Shape:
    """One measured configuration of the built-in Llama."""

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab: int
    seq_len: int
    batch: int
    remat: str = "full"
    attention: str = "auto"
    dtype: str = "bfloat16"
    param_dtype: str = "bfloat16"
    doc_len: int = 700  # mean packed document length (segment ids restart the attention)
    preset: str = ""  # a published model's preset: its model keys, attention and remat, at this seq_len and batch

    def config(self) -> Config:
        """The run config the row trains: the preset's at this sequence length and batch, on one device; else the
        shape's own keys."""
        from training.config import load_config

        if not self.preset:
            return load_config("tiny", None, self.overrides())
        one_device = {"elastic.min_workers": 1, "elastic.max_workers": 1, "placement.devices_per_worker": 1}
        keys = {"model.seq_len": self.seq_len, "optimizer.global_batch": self.batch, "checkpoint.val_batch": self.batch}
        return load_config(self.preset, None, keys | one_device | {"optimizer.steps": 100_000})

    def overrides(self) -> dict[str, Any]:
        """The run config's keys for this shape."""
        return {
            "task": "lm",
            "d_model": self.d_model,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "d_ff": self.d_ff,
            "vocab_size": self.vocab,
            "seq_len": self.seq_len,
            "global_batch": self.batch,
            "remat": self.remat,
            "attention": self.attention,
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
            "scan_layers": True,
            "steps": 100_000,
            "warmup_steps": 10,
            "min_workers": 1,
            "max_workers": 1,
        }


ONE_B = Shape("1b-seq2048", 2048, 16, 16, 8, 8192, 32768, 2048, 4)
SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        ONE_B,
        replace(ONE_B, name="1b-seq2048-qkv_proj", remat="qkv_proj"),
        replace(ONE_B, name="1b-seq2048-attn", remat="attn"),
        replace(ONE_B, name="1b-seq2048-dots", remat="dots"),
        replace(ONE_B, name="1b-seq2048-xla", attention="xla"),
        replace(ONE_B, name="1b-b2-full", batch=2),
        replace(ONE_B, name="1b-b2-dots", batch=2, remat="dots"),
        replace(ONE_B, name="1b-b2-none", batch=2, remat="none"),
        replace(ONE_B, name="1b-seq8192", seq_len=8192, batch=1),
        replace(ONE_B, name="1b-seq8192-qkv_proj", seq_len=8192, batch=1, remat="qkv_proj"),
        Shape("150m-b16", 768, 12, 12, 12, 3072, 32768, 2048, 16, remat="full", param_dtype="float32"),
        Shape("150m-b16-none", 768, 12, 12, 12, 3072, 32768, 2048, 16, remat="none", param_dtype="float32"),
        Shape("cpu-small", 128, 2, 4, 2, 512, 1024, 128, 2, remat="full", param_dtype="float32", doc_len=40),
    )
}
# Llama 3.2 1B as its preset trains it (attention and remat auto): its own 2 x 2048 tokens a step, the issue's
# 4 x 2048 and 1 x 8192.  The model's keys are the preset's (these fields only name the shape and feed the batch).
LLAMA32_1B = Shape("llama3.2-1b", 2048, 16, 32, 8, 8192, 128256, 2048, 2, "auto", preset="llama3.2-1b")
for s in (LLAMA32_1B, replace(LLAMA32_1B, name="llama3.2-1b-b4", batch=4)):
    SHAPES[s.name] = s
SHAPES["llama3.2-1b-seq8192"] = replace(LLAMA32_1B, name="llama3.2-1b-seq8192", seq_len=8192, batch=1)
TPU_DEFAULT = ("1b-seq2048", "1b-seq2048-dots", "1b-seq8192", "llama3.2-1b", "llama3.2-1b-b4", "llama3.2-1b-seq8192")
CPU_DEFAULT = ("cpu-small",)


def packed_batch(batch: int, seq_len: int, vocab: int, doc_len: int, seed: int = 0) -> dict[str, Any]:
    """Random tokens in packed documents of random lengths (mean ``doc_len``): segment ids and positions."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)
    seg = np.zeros((batch, seq_len), np.int32)
    pos = np.zeros((batch, seq_len), np.int32)
    for b in range(batch):
        i, doc = 0, 1
        while i < seq_len:
            n = min(int(rng.integers(1, 2 * doc_len)), seq_len - i)
            seg[b, i : i + n], pos[b, i : i + n] = doc, np.arange(n)
            i, doc = i + n, doc + 1
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg, "positions": pos}
