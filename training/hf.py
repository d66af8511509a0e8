"""Hugging Face Llama checkpoints: ``config.json`` <-> the config's model keys, safetensors <-> the Llama tree.

A checkpoint is a directory (local or ``gs://``) of ``config.json``, one or more
``*.safetensors`` files (with ``model.safetensors.index.json`` when sharded) and
usually ``tokenizer.json``.  Our Llama rotates the two halves of each head
together, as Hugging Face's ``LlamaForCausalLM`` does, so the q and k weights map
without a permutation; every projection is the transpose of its ``nn.Linear``
weight.  Safetensors are read and written here with numpy (and ``ml_dtypes`` for
bfloat16): the format is an 8-byte header length, a JSON header and the raw bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import ml_dtypes
import numpy as np

from training.storage import NotFound, Store, join, open_store

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
ARCHITECTURE = "LlamaForCausalLM"
LLAMA3_BANDS = (1.0, 4.0)  # Llama 3's RoPE scaling: low_freq_factor and high_freq_factor (as our Llama has them)
SHARD_BYTES = 4 << 30  # an exported file holds at most this much (Hugging Face's own default is 5 GB)
DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
NAMES = {v: k for k, v in DTYPES.items()}
# A Hugging Face ``config.json``: another project's document, free-form.
HFConfig = dict[str, Any]


class LlamaKeys(TypedDict, total=False):
    """The model section's keys a Llama ``config.json`` sets (the RoPE scaling's context only when it scales)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    norm_eps: float
    tie_embeddings: bool
    rope_theta: float
    rope_scaling: float
    rope_original_context: int


# The config's model keys that a Hugging Face config.json sets.
MODEL_KEYS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "rope_theta",
    "rope_scaling",
    "rope_original_context",
    "norm_eps",
    "tie_embeddings",
)
# One block's weights: (our path under the block, the Hugging Face name under ``model.layers.<i>.``, transposed).
LAYER_WEIGHTS = (
    (("attn", "q", "kernel"), "self_attn.q_proj.weight", True),
    (("attn", "k", "kernel"), "self_attn.k_proj.weight", True),
    (("attn", "v", "kernel"), "self_attn.v_proj.weight", True),
    (("attn", "o", "kernel"), "self_attn.o_proj.weight", True),
    (("mlp", "gate", "kernel"), "mlp.gate_proj.weight", True),
    (("mlp", "up", "kernel"), "mlp.up_proj.weight", True),
    (("mlp", "down", "kernel"), "mlp.down_proj.weight", True),
    (("attn_norm", "scale"), "input_layernorm.weight", False),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", False),
)


class HFError(ValueError):
    """A Hugging Face checkpoint that cannot be read or does not fit, in one line that names it."""


# --- safetensors ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a safetensors file."""

    file: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    size: int


def read_header(store: Store, name: str) -> dict[str, TensorInfo]:
    """The tensors of safetensors file ``name`` in ``store``: dtype, shape and where their bytes are."""
    where = store.child(name)
    head = store.get_range(name, 0, 8)
    if len(head) < 8:
        raise HFError(f"{where}: not a safetensors file (shorter than its 8-byte header length)")
    n = int.from_bytes(head, "little")
    raw = store.get_range(name, 8, n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise HFError(f"{where}: not a safetensors file (its header is not JSON)") from None
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise HFError(f"{where}: tensor {key} is {entry['dtype']}, not one of {', '.join(DTYPES)}")
        begin, end = entry["data_offsets"]
        out[key] = TensorInfo(name, DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + n + begin, end - begin)
    return out


def read_tensor(store: Store, info: TensorInfo) -> np.ndarray:
    """One tensor's values (little-endian, as the format stores them)."""
    data = store.get_range(info.file, info.start, info.size)
    if len(data) != info.size:
        raise HFError(f"{store.child(info.file)}: truncated ({len(data)} of {info.size} bytes of a tensor)")
    return np.frombuffer(data, dtype=info.dtype.newbyteorder("<")).reshape(info.shape)


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` as one safetensors file (header padded to 8 bytes, data in the header's order)."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}  # the file's JSON header
    offset = 0
    for name, arr in tensors.items():
        header[name] = {
            "dtype": NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())


# --- the checkpoint -------------------------------------------------------------------------------------------


class Checkpoint:
    """A Hugging Face Llama checkpoint at a URI: its config and its tensors by name (read when asked)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")
        self.store = open_store(self.uri)
        self.config = read_config(self.store)
        self.tensors = self._index()

    def _index(self) -> dict[str, TensorInfo]:
        try:
            weight_map = json.loads(self.store.get(INDEX_FILE))["weight_map"]
            files = sorted(set(weight_map.values()))
        except NotFound:
            files = [k for k in self.store.list() if k.endswith(".safetensors") and "/" not in k]
        if not files:
            raise HFError(f"{self.uri}: no *.safetensors file (a Hugging Face checkpoint holds its weights in them)")
        tensors: dict[str, TensorInfo] = {}
        for name in files:
            try:
                tensors |= read_header(self.store, name)
            except NotFound:
                raise HFError(f"{self.store.child(name)}: missing (named by {INDEX_FILE})") from None
        return tensors

    def get(self, name: str) -> np.ndarray:
        info = self.tensors.get(name)
        if info is None:
            raise HFError(f"{self.uri}: no tensor {name}")
        return read_tensor(self.store, info)


def read_config(store: Store) -> HFConfig:
    """A checkpoint's ``config.json``."""
    try:
        raw = store.get(CONFIG_FILE)
    except NotFound:
        raise HFError(f"{store.child(CONFIG_FILE)}: missing (a Hugging Face checkpoint has a config.json)") from None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise HFError(f"{store.child(CONFIG_FILE)}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise HFError(f"{store.child(CONFIG_FILE)}: not a JSON object")
    return data


def model_keys(hf: Mapping[str, Any], where: str) -> LlamaKeys:
    """The config's model keys a Llama ``config.json`` sets; anything this Llama cannot be is refused by name."""
    archs = hf.get("architectures") or []
    if ARCHITECTURE not in archs and not (not archs and hf.get("model_type") == "llama"):
        got = ", ".join(archs) or f"model_type {hf.get('model_type')!r}"
        raise HFError(f"{where}: architecture {got} is not {ARCHITECTURE}, the only one init_from loads")
    refuse = {
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "attention_bias": (hf.get("attention_bias", False), False),
        "mlp_bias": (hf.get("mlp_bias", False), False),
    }
    for key, (got, want) in refuse.items():
        if got != want:
            raise HFError(f"{where}: {key} is {got!r}; this Llama has {want!r} only")
    try:
        d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        keys = LlamaKeys(
            vocab_size=int(hf["vocab_size"]),
            d_model=d_model,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            d_ff=int(hf["intermediate_size"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise HFError(f"{where}: no {e.args[0]}") from None
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * n_heads != d_model:
        raise HFError(f"{where}: head_dim {head_dim} is not hidden_size/num_attention_heads ({d_model}/{n_heads})")
    return keys | rope_keys(hf, where)


def rope_keys(hf: Mapping[str, Any], where: str) -> LlamaKeys:
    """The RoPE keys: ``rope_parameters`` (transformers 5) or ``rope_theta`` with ``rope_scaling`` (before)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return LlamaKeys(rope_theta=theta, rope_scaling=0.0)
    if kind != "llama3":
        raise HFError(f"{where}: rope type {kind!r}; this Llama has plain RoPE or Llama 3's (rope_type llama3)")
    try:
        bands = (float(rope["low_freq_factor"]), float(rope["high_freq_factor"]))
        keys = LlamaKeys(
            rope_theta=theta,
            rope_scaling=float(rope["factor"]),
            rope_original_context=int(rope["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise HFError(f"{where}: rope_scaling has no {e.args[0]}") from None
    if bands != LLAMA3_BANDS:
        raise HFError(
            f"{where}: rope_scaling low_freq_factor/high_freq_factor {bands[0]:g}/{bands[1]:g}; this Llama has "
            f"Llama 3's {LLAMA3_BANDS[0]:g}/{LLAMA3_BANDS[1]:g}"
        )
    return keys


def hf_config(model: Any, dtype: str) -> HFConfig:
    """A ``config.json`` for a Llama of config ``model`` (a ``LlamaConfig``), weights stored as ``dtype``."""
    out: HFConfig = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.d_ff,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.rope_original_context,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": model.tie_embeddings,
        "torch_dtype": dtype,
    }
    if model.rope_scaling:
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": model.rope_scaling,
            "original_max_position_embeddings": model.rope_original_context,
            "low_freq_factor": LLAMA3_BANDS[0],
            "high_freq_factor": LLAMA3_BANDS[1],
        }
        out["max_position_embeddings"] = int(model.rope_original_context * model.rope_scaling)
    return out


# --- the weights --------------------------------------------------------------------------------------------


def weight_names(model: Any) -> Iterator[tuple[tuple[str, ...], str, bool]]:
    """Each weight of a Llama of config ``model``: its path in an unscanned tree, its name, transposed or not.

    A block's weights come kind by kind (every layer's q, then every layer's k, ...): a scanned tree's
    stacked leaf is complete, and can be placed and let go, before the next kind is read.
    """
    yield ("embed",), "model.embed_tokens.weight", False
    for path, name, transposed in LAYER_WEIGHTS:
        for i in range(model.n_layers):
            yield (f"layers_{i}", *path), f"model.layers.{i}.{name}", transposed
    yield ("final_norm", "scale"), "model.norm.weight", False
    if not model.tie_embeddings:
        yield ("head", "kernel"), "lm_head.weight", True


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _scanned(path: tuple[str, ...]) -> tuple[tuple[str, ...], int] | None:
    """A layer weight's path in a scanned tree (``layers``, with the layer as the leading axis) and its layer."""
    if path[0].startswith("layers_"):
        return ("layers", *path[1:]), int(path[0].removeprefix("layers_"))
    return None


def to_params(
    ckpt: Checkpoint,
    abstract: Mapping[str, Any],
    model: Any,
    place: Callable[[np.ndarray, Any], Any] | None = None,
) -> dict[str, Any]:
    """The checkpoint's weights as a tree shaped and typed like ``abstract`` (the model's own params).

    ``abstract`` may be scanned (``layers`` stacked over a leading axis) or not; every shape is checked.
    ``place(values, abstract leaf)`` makes each leaf as it is read (None: the numpy array itself).
    """
    out: dict[str, Any] = {}
    for path, arr in leaves(ckpt, abstract, model):
        _set(out, path, arr if place is None else place(arr, _get(abstract, path)))
    return out


def leaves(ckpt: Checkpoint, abstract: Mapping[str, Any], model: Any) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """Each parameter of ``abstract``'s tree (its path, its values) from the checkpoint, one at a time."""
    stacks: dict[tuple[str, ...], list[np.ndarray]] = {}
    for path, name, transposed in weight_names(model):
        arr = ckpt.get(name)
        arr = arr.T if transposed else arr
        scanned = _scanned(path) if "layers" in abstract else None
        want = _get(abstract, scanned[0] if scanned else path)
        shape = tuple(want.shape[1:]) if scanned else tuple(want.shape)
        if arr.shape != shape:
            hf_shape = arr.T.shape if transposed else arr.shape
            raise HFError(
                f"{ckpt.uri}: {name} has shape {list(hf_shape)}, the model's weight {'/'.join(path)} needs "
                f"{list(shape[::-1] if transposed else shape)}"
            )
        arr = arr.astype(want.dtype)
        if not scanned:
            yield path, arr
            continue
        stack = stacks.setdefault(scanned[0], [])
        stack.append(arr)
        if len(stack) == model.n_layers:
            yield scanned[0], np.stack(stacks.pop(scanned[0]))


def from_params(params: Mapping[str, Any], model: Any, dtype: np.dtype[Any]) -> dict[str, np.ndarray]:
    """Hugging Face's tensors, by name, of a (scanned or unscanned) Llama parameter tree."""
    out = {}
    for path, name, transposed in weight_names(model):
        scanned = _scanned(path) if "layers" in params else None
        arr = np.asarray(_get(params, scanned[0])[scanned[1]] if scanned else _get(params, path))
        out[name] = np.ascontiguousarray(arr.T if transposed else arr).astype(dtype)
    return out


def write_checkpoint(
    out: Path, tensors: Mapping[str, np.ndarray], config: Mapping[str, Any], tokenizer: bytes | None
) -> list[str]:
    """Write a Hugging Face directory: config.json, safetensors (sharded past ``SHARD_BYTES``), tokenizer.json.

    Returns the files written, by name.
    """
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    files = [CONFIG_FILE]
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {t: f for f, shard in zip(names, shards, strict=True) for t in shard}
        total = sum(a.nbytes for a in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX_FILE)
    for name, shard in zip(names, shards, strict=True):
        write_safetensors(out / name, shard, {"format": "pt"})
    files += names
    if tokenizer is not None:
        (out / TOKENIZER_FILE).write_bytes(tokenizer)
        files.append(TOKENIZER_FILE)
    return files


@dataclass(frozen=True)
class CheckpointKeys:
    """What a checkpoint sets in a run's config: the model's keys, and its tokenizer.json (None: it has none)."""

    model: LlamaKeys
    tokenizer: str | None


def checkpoint_keys(uri: str) -> CheckpointKeys:
    """The config keys of the Hugging Face Llama checkpoint at ``uri`` (only its config.json is read)."""
    store = open_store(uri)
    model = model_keys(read_config(store), store.child(CONFIG_FILE))
    tokenizer = join(uri, TOKENIZER_FILE) if store.exists(TOKENIZER_FILE) else None
    return CheckpointKeys(model, tokenizer)


def load_params(uri: str, abstract: Any, model: Any) -> Any:
    """The checkpoint's weights as the model's parameters, each placed with its ``abstract`` leaf's sharding.

    Every process reads the whole checkpoint, one parameter at a time (a scanned one: all its layers), and
    keeps its own shards of it (``jax.make_array_from_callback``) before it reads the next.
    """
    import jax

    def place(arr: np.ndarray, want: Any) -> jax.Array:
        return jax.make_array_from_callback(want.shape, want.sharding, lambda idx: arr[idx])

    return to_params(Checkpoint(uri), abstract, model, place)
