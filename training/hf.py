"""Hugging Face Llama checkpoints: ``config.json`` <-> the config's model keys, safetensors <-> the Llama tree.

A checkpoint is a directory (local or ``gs://``) of ``config.json``, one or more
``*.safetensors`` files (with ``model.safetensors.index.json`` when sharded) and
usually ``tokenizer.json``.  Our Llama rotates the two halves of each head
together, as Hugging Face's ``LlamaForCausalLM`` does, so the q and k weights map
without a permutation; every projection is the transpose of its ``nn.Linear``
weight.  Safetensors are read and written here with numpy (and ``ml_dtypes`` for
bfloat16): the format is an 8-byte header length, a JSON header and the raw bytes.

A checkpoint is checked from its headers alone when a config names it (:func:`checkpoint_keys`):
every file there, every tensor the model reads present with its shape and a dtype we read, and
every file as long as its header says, before a job starts and reads the weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import ml_dtypes
import numpy as np

from training.storage import NotFound, Store, join, open_store

if TYPE_CHECKING:
    from training.models.llama import LlamaConfig

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_FILE = "generation_config.json"  # transformers' generate() reads its eos_token_id (where a text ends)
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
# Bytes an element of each safetensors dtype takes (the format's list): a header's offsets are checked against them.
ITEMSIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2}
ITEMSIZES |= {"I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
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
    kind: str  # its safetensors dtype: F32, BF16, ...
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    size: int

    @property
    def dtype(self) -> np.dtype[Any]:
        """Its numpy dtype (KeyError for a kind this reader does not load; :func:`check_weights` refuses those)."""
        return DTYPES[self.kind]


def read_header(store: Store, name: str) -> dict[str, TensorInfo]:
    """The tensors of safetensors file ``name`` in ``store``: dtype, shape and where their bytes are.

    An entry whose byte range does not hold its shape in its dtype is refused; nothing but the header is read.
    """
    where = store.child(name)
    head = store.get_range(name, 0, 8)
    if len(head) < 8:
        raise HFError(f"{where}: not a safetensors file (shorter than its 8-byte header length)")
    n = int.from_bytes(head, "little")
    raw = store.get_range(name, 8, n)
    if len(raw) < n:
        raise HFError(f"{where}: truncated: its header of {n} bytes ends past the file's {8 + len(raw)} bytes")
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise HFError(f"{where}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise HFError(f"{where}: not a safetensors file (its header is not a JSON object)")
    return {key: _entry(where, name, 8 + n, key, entry) for key, entry in header.items() if key != "__metadata__"}


def _entry(where: str, name: str, data_start: int, key: str, entry: Any) -> TensorInfo:
    """One header entry as a TensorInfo, refused in one line when it is not one."""
    try:
        kind, shape = str(entry["dtype"]), tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise HFError(f"{where}: tensor {key}'s header entry is not dtype, shape and data_offsets") from None
    want = math.prod(shape) * ITEMSIZES[kind] if kind in ITEMSIZES else end - begin
    if begin < 0 or end - begin != want:
        raise HFError(
            f"{where}: tensor {key}'s data_offsets [{begin}, {end}] do not hold its shape {list(shape)} of {kind} "
            f"({want} bytes)"
        )
    return TensorInfo(name, kind, shape, data_start + begin, end - begin)


def check_length(store: Store, name: str, tensors: Mapping[str, TensorInfo]) -> None:
    """Refuse file ``name`` when it ends before the last byte its header places (a truncated download or copy),
    naming the first tensor cut short: one ranged read of a byte when the file is whole, a bisection when not."""
    by_end = sorted((t for t in tensors.items() if t[1].size), key=lambda t: t[1].start + t[1].size)
    if not by_end or _has_byte(store, name, by_end[-1][1].start + by_end[-1][1].size - 1):
        return
    lo, hi = 0, len(by_end) - 1  # the first tensor whose last byte is missing is one of by_end[lo..hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if _has_byte(store, name, by_end[mid][1].start + by_end[mid][1].size - 1):
            lo = mid + 1
        else:
            hi = mid
    key, cut = by_end[lo]
    raise HFError(
        f"{store.child(name)}: truncated: tensor {key} (bytes {cut.start} to {cut.start + cut.size}) ends past "
        "the end of the file"
    )


def _has_byte(store: Store, name: str, offset: int) -> bool:
    """Whether the object ``name`` is longer than ``offset`` bytes (one ranged read of its byte there)."""
    try:
        return len(store.get_range(name, offset, 1)) == 1
    except Exception as e:
        if _range_past_the_end(e):
            return False
        raise


def _range_past_the_end(error: Exception) -> bool:
    """Whether ``error`` is GCS answering a range that starts past an object's end (HTTP 416)."""
    try:
        from google.api_core import exceptions
    except ImportError:
        return False
    return isinstance(error, exceptions.RequestRangeNotSatisfiable)


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


@dataclass(frozen=True)
class Weights:
    """A checkpoint's tensors by name, from its safetensors' headers, and where a tensor it lacks should have been
    (its one file, its index, or the directory)."""

    tensors: dict[str, TensorInfo]
    home: str


def scan(store: Store) -> Weights:
    """Every tensor of the checkpoint in ``store`` from its files' headers (and index): a missing or truncated file,
    an index entry its file does not hold, or a PyTorch ``.bin``-only checkpoint, refused in one line naming it."""
    try:
        index = json.loads(store.get(INDEX_FILE))
        weight_map = {str(t): str(f) for t, f in index["weight_map"].items()}
    except NotFound:
        weight_map = {}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise HFError(f"{store.child(INDEX_FILE)}: not an index (a JSON object with a weight_map)") from None
    top = [] if weight_map else [k for k in store.list() if "/" not in k]
    files = sorted(set(weight_map.values())) if weight_map else [k for k in top if k.endswith(".safetensors")]
    if not files:
        pickles = [k for k in top if k.endswith(".bin")]
        if pickles:
            raise HFError(
                f"{store.child(pickles[0])}: a PyTorch .bin checkpoint; init_from reads safetensors only "
                "(transformers writes them: save_pretrained(DIR, safe_serialization=True))"
            )
        raise HFError(f"{store.uri}: no *.safetensors file (a Hugging Face checkpoint holds its weights in them)")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        try:
            found = read_header(store, name)
        except NotFound:
            raise HFError(f"{store.child(name)}: missing (named by {INDEX_FILE})") from None
        check_length(store, name, found)
        tensors |= found
    for t, f in weight_map.items():
        if t not in tensors or tensors[t].file != f:
            raise HFError(f"{store.child(f)}: no tensor {t} ({INDEX_FILE} puts it in this file)")
    home = INDEX_FILE if weight_map else files[0] if len(files) == 1 else ""
    return Weights(tensors, store.child(home) if home else store.uri)


def hf_shapes(keys: LlamaKeys) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama of these config keys reads from a checkpoint, by its name there, with its shape."""
    d, ff, v = keys["d_model"], keys["d_ff"], keys["vocab_size"]
    kv = keys["n_kv_heads"] * (d // keys["n_heads"])  # heads x head width is the model's width
    layer: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (d, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, d),
        "mlp.gate_proj.weight": (ff, d),
        "mlp.up_proj.weight": (ff, d),
        "mlp.down_proj.weight": (d, ff),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(keys["n_layers"]):
        out |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    out["model.norm.weight"] = (d,)
    if not keys.get("tie_embeddings"):
        out["lm_head.weight"] = (v, d)
    return out


def check_weights(store: Store, weights: Weights, keys: LlamaKeys) -> None:
    """Refuse a checkpoint short of a tensor the model of ``keys`` reads, or holding one of another shape or of a
    dtype this reader does not load: one line naming the file and the tensor."""
    for name, shape in hf_shapes(keys).items():
        info = weights.tensors.get(name)
        if info is None:
            raise HFError(f"{weights.home}: no tensor {name} (its config.json's model reads one)")
        where = store.child(info.file)
        if info.kind not in DTYPES:
            raise HFError(f"{where}: tensor {name} is {info.kind}, not one of {', '.join(DTYPES)}")
        if info.shape != shape:
            raise HFError(
                f"{where}: tensor {name} has shape {list(info.shape)}, its config.json's model needs {list(shape)}"
            )


class Checkpoint:
    """A Hugging Face Llama checkpoint at a URI: its config and its tensors by name (read when asked)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")
        self.store = open_store(self.uri)
        self.config = read_config(self.store)
        self.tensors = scan(self.store).tensors

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


def hf_config(model: LlamaConfig, dtype: str) -> HFConfig:
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


def weight_names(model: LlamaConfig) -> Iterator[tuple[tuple[str, ...], str, bool]]:
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
    model: LlamaConfig,
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


def leaves(
    ckpt: Checkpoint, abstract: Mapping[str, Any], model: LlamaConfig
) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
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


def from_params(params: Mapping[str, Any], model: LlamaConfig, dtype: np.dtype[Any]) -> dict[str, np.ndarray]:
    """Hugging Face's tensors, by name, of a (scanned or unscanned) Llama parameter tree."""
    out = {}
    for path, name, transposed in weight_names(model):
        scanned = _scanned(path) if "layers" in params else None
        arr = np.asarray(_get(params, scanned[0])[scanned[1]] if scanned else _get(params, path))
        out[name] = np.ascontiguousarray(arr.T if transposed else arr).astype(dtype)
    return out


def write_checkpoint(
    out: Path,
    tensors: Mapping[str, np.ndarray],
    config: Mapping[str, Any],
    tokenizer: bytes | None,
    generation: Mapping[str, Any] | None = None,
) -> list[str]:
    """Write a Hugging Face directory: config.json, safetensors (sharded past ``SHARD_BYTES``), tokenizer.json and
    ``generation`` as generation_config.json (each of the last two when given).

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
    if generation is not None:
        (out / GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")
        files.append(GENERATION_FILE)
    return files


@dataclass(frozen=True)
class CheckpointKeys:
    """What a checkpoint sets in a run's config: the model's keys, and its tokenizer.json (None: it has none)."""

    model: LlamaKeys
    tokenizer: str | None


def checkpoint_keys(uri: str) -> CheckpointKeys:
    """The config keys of the Hugging Face Llama checkpoint at ``uri``, its weights checked from their headers.

    Only config.json and each safetensors file's header (and a byte at its end) are read: a checkpoint that is
    not there, or whose weights the model could not load, is refused here, before a job starts.
    """
    store = open_store(uri)
    if not store.list():
        raise HFError(f"{store.uri}: no such directory (or nothing in it)")
    model = model_keys(read_config(store), store.child(CONFIG_FILE))
    check_weights(store, scan(store), model)
    tokenizer = join(uri, TOKENIZER_FILE) if store.exists(TOKENIZER_FILE) else None
    return CheckpointKeys(model, tokenizer)


def load_params(uri: str, abstract: Any, model: LlamaConfig) -> Any:
    """The checkpoint's weights as the model's parameters, each placed with its ``abstract`` leaf's sharding.

    Every process reads the whole checkpoint, one parameter at a time (a scanned one: all its layers), and
    keeps its own shards of it (``jax.make_array_from_callback``) before it reads the next.
    """
    import jax

    def place(arr: np.ndarray, want: Any) -> jax.Array:
        return jax.make_array_from_callback(want.shape, want.sharding, lambda idx: arr[idx])

    return to_params(Checkpoint(uri), abstract, model, place)
