"""The ``maxtext`` task: a MaxText decoder (Llama 3 and the others it ships) on a prepared token dataset.

MaxText builds the model from its own configuration (``model_name`` and any of
its keys as ``overrides``); this engine keeps the rest: the mesh, the
optimizer, the elastic rounds, the checkpoints and the data.  The model's
parameters carry MaxText's logical axis names, and its rules, narrowed to this
engine's mesh axes, shard them.  An extra: ``pip install -e ".[maxtext]"``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from training.config import Config
from training.mesh import AXES
from training.sections import DataSection, ModelSection
from training.tasks import Batch, TaskError, current_mesh
from training.tasks.lm import TokenTask

ARGS = ("model_name", "overrides")
# Keys this engine sets and an override may not: the sequence length is the config's, the engine starts JAX's
# distributed system and checkpoints, and MaxText's own input pipeline, output and device count are not used.
OWNED = {
    "max_target_length": "the config's seq_len",
    "skip_jax_distributed_system": "the engine starts JAX's distributed system",
    "enable_checkpointing": "the engine checkpoints",
    "enable_dropout": "the engine trains without dropout",
    "dataset_type": "the data is the config's dataset",
    "internal_compile": "the engine compiles",
    "internal_compile_num_devices": "the engine compiles",
    "num_slices": "the engine's mesh spans the slices",
    "quantization_local_shard_count": "the engine's mesh decides the devices",
    "jax_cache_dir": "the engine keeps the compilation cache",
    "base_output_directory": "the run root holds everything",
    "run_name": "the run root holds everything",
}


class MaxTextTask(TokenTask):
    """Next-token prediction with a MaxText model built for whichever mesh the engine traces it on."""

    def __init__(self, data: DataSection, seq_len: int, model_cfg: Any) -> None:
        super().__init__(data, seq_len, int(model_cfg.vocab_size))
        self.model_cfg = model_cfg
        self._models: dict[Mesh, Any] = {}

    def logical_rules(self) -> tuple[tuple[str, Any], ...]:
        """MaxText's logical axis rules, each narrowed to this engine's mesh axes (``data``, ``fsdp``, ``tensor``)."""
        return tuple((str(name), _narrow(axes)) for name, axes in self.model_cfg.logical_axis_rules)

    def model(self) -> Any:
        """The MaxText module for the mesh being traced on (one device when none is set: host validation)."""
        from maxtext.models import models

        mesh = current_mesh()
        if mesh is None:
            mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), AXES)
        if mesh not in self._models:
            self._models[mesh] = models.transformer_as_linen(self.model_cfg, mesh, quant=None)
        return self._models[mesh]

    def init(self, rng: jax.Array) -> Any:
        shape = (1, self.seq_len)
        tokens = jnp.zeros(shape, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(self.seq_len, dtype=jnp.int32), shape)
        segments = jnp.ones(shape, jnp.int32)
        variables = self.model().init(
            {"params": rng, "dropout": rng}, tokens, positions, segments, enable_dropout=False
        )
        return variables["params"]

    def logits(self, params: Any, batch: Batch) -> jax.Array:
        inputs = batch["inputs"]
        positions = batch.get("positions")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(inputs.shape[-1], dtype=jnp.int32), inputs.shape)
        out = self.model().apply({"params": params}, inputs, positions, batch.get("segment_ids"), enable_dropout=False)
        return cast(jax.Array, out).astype(jnp.float32)


def _narrow(axes: Any) -> Any:
    """A rule's mesh axes, kept where this engine's mesh has them (None: replicated)."""
    if axes is None:
        return None
    if isinstance(axes, str):
        return axes if axes in AXES else None
    kept = tuple(a for a in axes if a in AXES)
    return kept or None


def model_config(model: ModelSection, model_name: str, overrides: dict[str, Any]) -> Any:
    """MaxText's configuration of the model: its base, the model's file, the overrides, then the keys owned here."""
    try:
        import maxtext
        import maxtext.models.models  # noqa: F401 - before its configuration module (which imports it circularly)
        from maxtext.configs import pyconfig, types
    except ImportError as e:
        raise TaskError(f"task 'maxtext' needs MaxText: pip install -e '.[maxtext]' ({e})") from None
    owned = sorted(set(overrides) & set(OWNED))
    if owned:
        raise TaskError(f"task 'maxtext': task_args.overrides may not set {owned[0]} ({OWNED[owned[0]]})")
    unknown = sorted(set(overrides) - set(types.MaxTextConfig.model_fields))
    if unknown:
        raise TaskError(f"task 'maxtext': task_args.overrides: {unknown[0]!r} is not a key of MaxText's configuration")
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    if model_name != "default" and not os.path.isfile(
        os.path.join(os.path.dirname(base), "models", f"{model_name}.yml")
    ):
        raise TaskError(f"task 'maxtext': MaxText has no model {model_name!r} (its configs/models/*.yml)")
    keys: dict[str, Any] = {
        "dtype": model.dtype,
        "weight_dtype": model.param_dtype,
        "attention": "dot_product",
        "per_device_batch_size": 1,
        **overrides,
        "model_name": model_name,
        "override_model_config": True,
        "max_target_length": model.seq_len,
        "skip_jax_distributed_system": True,
        "enable_checkpointing": False,
        "enable_dropout": False,
        "dataset_type": "synthetic",
        # The device and slice counts given, so that MaxText never starts a JAX backend (the engine's workers
        # start JAX's distributed system after building the task); the engine's mesh decides both.
        "internal_compile": True,
        "internal_compile_num_devices": 1,
        "num_slices": 1,
        "quantization_local_shard_count": 1,
        "jax_cache_dir": "",
        "base_output_directory": tempfile.gettempdir(),
        "run_name": "rtrain",
    }
    # pyconfig.initialize() ends the process on a bad configuration (and writes /dev/termination-log); its two
    # steps, taken here, leave the error to this engine to report.
    try:
        return pyconfig.HyperParameters(pyconfig._initialize_pydantic(["rtrain", base], **keys))
    except Exception as e:  # noqa: BLE001 - MaxText's own validation: named in one line
        raise TaskError(f"task 'maxtext': MaxText refused the configuration: {_reason(e)}") from None


def _reason(e: Exception) -> str:
    """One line of a MaxText configuration error (a pydantic error: the key and what is wrong with it)."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(k) for k in first['loc'])}: {first['msg']}"
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def make_task(cfg: Config, args: dict[str, Any]) -> MaxTextTask:
    """The built-in ``maxtext`` task: ``task_args`` are ``model_name`` (MaxText's) and ``overrides`` (its keys)."""
    unknown = sorted(set(args) - set(ARGS))
    if unknown:
        raise TaskError(f"task 'maxtext': unknown task_args key {unknown[0]!r} (known: {', '.join(ARGS)})")
    model_name = args.get("model_name", "default")
    overrides = args.get("overrides", {})
    if not isinstance(model_name, str) or not model_name:
        raise TaskError(f"task 'maxtext': task_args.model_name must be a MaxText model name, got {model_name!r}")
    if not isinstance(overrides, dict):
        raise TaskError(f"task 'maxtext': task_args.overrides must be a mapping, got {type(overrides).__name__}")
    return MaxTextTask(cfg.data, cfg.model.seq_len, model_config(cfg.model, model_name, overrides))
