"""Hugging Face Llama directories for tests, written without this project's writer: the published config.json of
each Llama 3.x model, and safetensors whose headers name every weight with its shape (sparse files: their bytes
are never written, so a 70B checkpoint costs a few kilobytes of disk)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The config.json of each model on the Hugging Face Hub (meta-llama/...), less the keys no loader reads.
_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def _rope(factor: float) -> dict[str, Any]:
    return {
        "rope_scaling": {
            "factor": factor,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        }
    }


PUBLISHED: dict[str, dict[str, Any]] = {
    "llama3.2-1b": _LLAMA3
    | _rope(32.0)
    | {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "llama3.2-3b": _LLAMA3
    | _rope(32.0)
    | {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "llama3.1-8b": _LLAMA3
    | _rope(8.0)
    | {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "llama3.1-70b": _LLAMA3
    | _rope(8.0)
    | {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
}
# Each model's parameter count as published (the model cards' and transformers' num_parameters()).
PUBLISHED_PARAMS = {
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
}
ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I32": 4, "I8": 1}


def tensor_shapes(config: dict[str, Any]) -> dict[str, list[int]]:
    """Every tensor of a LlamaForCausalLM of this config.json, by its name in the checkpoint, with its shape."""
    d, ff, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // heads
    out = {"model.embed_tokens.weight": [v, d]}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": [heads * hd, d],
            p + "self_attn.k_proj.weight": [kv * hd, d],
            p + "self_attn.v_proj.weight": [kv * hd, d],
            p + "self_attn.o_proj.weight": [d, heads * hd],
            p + "mlp.gate_proj.weight": [ff, d],
            p + "mlp.up_proj.weight": [ff, d],
            p + "mlp.down_proj.weight": [d, ff],
            p + "input_layernorm.weight": [d],
            p + "post_attention_layernorm.weight": [d],
        }
    out["model.norm.weight"] = [d]
    if not config.get("tie_word_embeddings"):
        out["lm_head.weight"] = [v, d]
    return out


def write_header(path: Path, tensors: dict[str, tuple[str, list[int]]], size: int | None = None) -> None:
    """A safetensors file of ``tensors`` (name -> dtype, shape) whose data is a hole of the right size (``size``:
    the file's length instead of the header's end)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = ITEMSIZE[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset if size is None else size)


def write_checkpoint(
    out: Path, config: dict[str, Any], dtype: str = "BF16", shard_bytes: int = 5_000_000_000
) -> dict[str, str]:
    """A Hugging Face directory of ``config``: config.json and header-only safetensors, sharded past ``shard_bytes``
    with an index as transformers shards them; returns each tensor's file."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shards: list[dict[str, tuple[str, list[int]]]] = [{}]
    size = 0
    for name, shape in tensor_shapes(config).items():
        n = ITEMSIZE[dtype]
        for s in shape:
            n *= s
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = (dtype, shape)
        size += n
    if len(shards) == 1:
        write_header(out / "model.safetensors", shards[0])
        return dict.fromkeys(shards[0], "model.safetensors")
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {t: f for f, shard in zip(names, shards, strict=True) for t in shard}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name, shard in zip(names, shards, strict=True):
        write_header(out / name, shard)
    return weight_map
