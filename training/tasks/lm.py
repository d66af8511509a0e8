"""The built-in task: a Llama 3 decoder trained on a prepared token dataset (``rtrain prepare``)."""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp

from training.config import Config
from training.data import load_manifest
from training.data.shards import Manifest
from training.data.tokens import lm_source
from training.models.llama import Llama, LlamaConfig, cross_entropy
from training.sections import DataSection, ModelSection
from training.tasks import Batch, ExampleSpec, Metrics, TaskData, TaskError


def llama_config(model: ModelSection) -> LlamaConfig:
    """The model a run config's model section describes."""
    return LlamaConfig(
        vocab_size=model.vocab_size,
        d_model=model.d_model,
        n_layers=model.n_layers,
        n_heads=model.n_heads,
        n_kv_heads=model.kv_heads,
        d_ff=model.d_ff,
        rope_theta=model.rope_theta,
        rope_scaling=model.rope_scaling,
        rope_original_context=model.rope_original_context,
        norm_eps=model.norm_eps,
        tie_embeddings=model.tie_embeddings,
        dtype=model.dtype,
        param_dtype=model.param_dtype,
        # auto is resolved when a job is launched (training.api.resolve_remat); a model built from a config that
        # still says auto (a plan's formula, a parameter count) keeps the least: full.
        remat="full" if model.remat == "auto" else model.remat,
        scan_layers=model.scan_layers,
        attention=model.attention,
    )


def check_manifest(data: DataSection, seq_len: int, vocab_size: int) -> Manifest:
    """The prepared dataset's manifest, refused when it does not fit the data section, the sequence length or the
    model's vocabulary (nothing of the shards is read)."""
    manifest = load_manifest(data.dataset)
    if int(manifest["seq_len"]) != seq_len:
        raise TaskError(
            f"dataset {data.dataset} has sequences of {manifest['seq_len']} tokens, the config seq_len={seq_len}"
        )
    check_tokenizer(data, manifest)
    vocab = int(manifest.get("vocab_size", 256))
    if vocab > vocab_size:
        raise TaskError(
            f"dataset {data.dataset} has a vocabulary of {vocab} tokens, more than the model's vocab_size={vocab_size}"
        )
    return manifest


def token_data(data: DataSection, seq_len: int, vocab_size: int) -> TaskData:
    """The data section's prepared dataset as the task's train and validation sources, checked first."""
    manifest = check_manifest(data, seq_len, vocab_size)
    return TaskData(
        train=lm_source(data.dataset, "train", reads=data.dataset_reads),
        validation=lm_source(data.dataset, "validation", reads=data.dataset_reads),
        fingerprint=str(manifest["fingerprint"]),
    )


def check_tokenizer(data: DataSection, manifest: Manifest) -> None:
    """The data section's tokenizer is the one the dataset was prepared with (kind, and a file's own bytes)."""
    from training.data.tokenizer import resolve

    entry = manifest.get("tokenizer") or {"kind": "bytes"}
    want = data.tokenizer
    where = f"dataset {data.dataset} was prepared with the {entry.get('kind')} tokenizer"
    if want in ("bytes", "bpe"):
        if entry.get("kind") != want:
            raise TaskError(f"{where}, the config's tokenizer is {want}")
        return
    tok = resolve(want)
    if tok.fingerprint != entry.get("fingerprint"):
        raise TaskError(
            f"{where} (fingerprint {str(entry.get('fingerprint'))[:12]}), not the config's {want} "
            f"(fingerprint {tok.fingerprint[:12]})"
        )


class TokenTask:
    """Next-token prediction on a prepared token dataset: the data, the loss and the checks; the model is a subclass's.

    A subclass passes the data section, the sequence length and ``vocab_size`` (its model's) and defines ``init``
    and ``logits``.
    """

    FIELDS = ("inputs", "targets", "segment_ids", "positions")

    def __init__(self, data: DataSection, seq_len: int, vocab_size: int) -> None:
        self.data_cfg = data  # where the prepared tokens are and how they are read
        self.seq_len = seq_len
        self.vocab_size = vocab_size

    def logits(self, params: Any, batch: Batch) -> jax.Array:
        raise NotImplementedError

    def loss(self, params: Any, batch: Batch, rng: jax.Array) -> tuple[jax.Array, Metrics]:
        loss, accuracy = cross_entropy(self.logits(params, batch), batch["targets"])
        return loss, {"accuracy": accuracy}

    def evaluate(self, params: Any, batch: Batch) -> Metrics:
        loss, accuracy = cross_entropy(self.logits(params, batch), batch["targets"])
        return {"loss": loss, "accuracy": accuracy}

    def example_spec(self) -> dict[str, ExampleSpec]:
        return {k: ExampleSpec((self.seq_len,), "int32") for k in self.FIELDS}

    def check_manifest(self) -> Manifest:
        """The dataset's manifest, refused when it does not fit the config (nothing of the shards is read)."""
        return check_manifest(self.data_cfg, self.seq_len, self.vocab_size)

    def data(self) -> TaskData:
        return token_data(self.data_cfg, self.seq_len, self.vocab_size)

    def tokens_per_example(self) -> int:
        return self.seq_len


class LanguageModel(TokenTask):
    """The built-in Llama 3 on packed documents (segment ids keep them apart)."""

    def __init__(self, model: ModelSection, data: DataSection) -> None:
        super().__init__(data, model.seq_len, model.vocab_size)
        self.init_from = model.init_from
        self.model_cfg = llama_config(model)
        self.model = Llama(self.model_cfg)

    def init(self, rng: jax.Array) -> Any:
        tokens = jnp.zeros((1, self.seq_len), jnp.int32)
        return self.model.init(rng, tokens)["params"]

    def initial_params(self, abstract: Any) -> Any:
        """The parameters of ``init_from`` (a Hugging Face Llama), placed as ``abstract`` (shapes, shardings) says."""
        from training.hf import load_params

        return load_params(self.init_from, abstract, self.model_cfg)

    def logits(self, params: Any, batch: Batch) -> jax.Array:
        return cast(
            jax.Array,
            self.model.apply({"params": params}, batch["inputs"], batch.get("segment_ids"), batch.get("positions")),
        )


def make_task(cfg: Config, args: dict[str, Any]) -> LanguageModel:
    """The built-in ``lm`` task: its model is the config's own keys, so it takes no ``task_args``."""
    if args:
        raise TaskError(f"task 'lm' takes no task_args (its model is set by the config's keys), got {sorted(args)}")
    return LanguageModel(cfg.model, cfg.data)
