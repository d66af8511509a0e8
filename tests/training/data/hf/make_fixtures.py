"""Make (or check) the tiny Hugging Face Llama 3 fixtures with transformers' own LlamaForCausalLM on CPU.

Run with a Python that has torch, transformers and tokenizers (not the project's venv: torch is not a
dependency of the project)::

    python make_fixtures.py [OUT_DIR]              # write the models and their reference logits (default: here)
    python make_fixtures.py --check EXPORT MODEL   # logits of an exported directory against MODEL's reference

Each model is a directory of ``config.json``, ``model.safetensors`` and ``tokenizer.json`` (a byte-level
BPE of 320 tokens), plus ``reference.npz``: token ids and the float32 logits transformers gives for them.
Every weight is random (norms included), so a wrong mapping of any of them changes the logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
VOCAB = 320
# name -> LlamaConfig keys: GQA with Llama 3's RoPE scaling and untied head; MQA-like GQA with a tied head.
MODELS = {
    "llama3-gqa-scaled": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        # theta 100 and an original context of 32: of the 4 frequencies of a head of 8, one is kept, one
        # smoothed and two scaled (wavelengths 6.3, 20, 63, 200 against the bands' 8 and 32)
        "rope_theta": 100.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    },
    "llama3-tied": {
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "rope_theta": 500000.0,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
    },
}
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
TOKENS_SHAPE = (2, 24)
CORPUS = [
    "def fine_tune(model, data):\n    return model.train(data)\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import jax\nimport numpy as np\nx = np.arange(10)\nprint(x.sum())\n",
    "Resilient training survives lost hosts, restores checkpoints and trains on.\n",
]


def tokenizer_json() -> str:
    """A byte-level BPE of ``VOCAB`` tokens with ``<|end_of_text|>`` as id 0 (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def make(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer_json()
    for i, (name, keys) in enumerate(MODELS.items()):
        torch.manual_seed(i)
        config = LlamaConfig(**COMMON, **keys, attn_implementation="eager")  # type: ignore[call-arg]
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.uniform_(0.5, 1.5)
                else:
                    p.normal_(0.0, 0.25)
        d = out / name
        model.save_pretrained(d)
        (d / "tokenizer.json").write_text(tok)
        tokens = np.random.default_rng(i).integers(0, VOCAB, TOKENS_SHAPE).astype(np.int32)
        np.savez(d / "reference.npz", tokens=tokens, logits=logits(model, tokens))
        print(f"{d}: {sum(p.numel() for p in model.parameters())} parameters")


def logits(model: object, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()  # type: ignore[operator, attr-defined]


def check(export: Path, reference: Path) -> float:
    """The largest difference between transformers' logits of ``export`` and ``reference``'s; prints it."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(export, attn_implementation="eager", dtype="float32").eval()
    ref = np.load(reference / "reference.npz")
    diff = float(np.abs(logits(model, ref["tokens"]) - ref["logits"]).max())
    if (export / "tokenizer.json").exists():
        AutoTokenizer.from_pretrained(export)  # loads
    print(
        json.dumps(
            {"export": str(export), "config": json.loads((export / "config.json").read_text()), "max_diff": diff}
        )
    )
    return diff


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        sys.exit(0 if check(Path(sys.argv[2]), Path(sys.argv[3])) < 1e-4 else 1)
    make(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
