"""The accelerator row's arithmetic and shapes (benchmarks/accelerator.py), checked on CPU: the FLOPs that MFU
counts, and the real presets' rows built as a TPU would run them."""

from __future__ import annotations

from benchmarks.cost import model_flops_per_token
from training.config import load_config


def test_a_tied_head_is_counted_as_the_matmul_it_is() -> None:
    """Tied or not, the output head is one [vocab, width] matmul a token; only the lookup is free."""
    tied = load_config("llama3.2-1b").model
    untied = tied.model_copy(update={"tie_embeddings": False})
    assert model_flops_per_token(tied) == model_flops_per_token(untied)
    # 6 x every parameter (the one embedding matrix is the head's matmul) + attention's 12 x layers x width x seq
    assert model_flops_per_token(tied) == 6 * 1_235_814_400 + 12 * 16 * 2048 * tied.seq_len
