"""``rtrain export``: a committed step's parameters as a Hugging Face directory or a plain Orbax checkpoint.

The step is the newest validated one unless one is named.  ``hf`` writes ``config.json``, safetensors
(sharded past 4 GiB a file) and the dataset's ``tokenizer.json`` (when it was prepared with one), which
transformers' ``LlamaForCausalLM`` loads; ``orbax`` writes the named parameter tree alone with Orbax's
``StandardCheckpointer``, restorable by any Orbax user.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal, TypedDict

from training.checkpoint.ledger import Ledger
from training.checkpoint.steps import committed_steps
from training.config import Config
from training.sections import DataSection
from training.storage import is_gcs, join, open_store

FORMATS = ("hf", "orbax")


class ExportError(ValueError):
    """An export that cannot be made, in one line that names why."""


class Exported(TypedDict):
    """What ``export`` wrote: the run, its step, the format, where, and the files (hf) or directory (orbax)."""

    run: str
    step: int
    format: str
    output: str
    files: list[str]


def pick_step(run_uri: str, step: int | None) -> int:
    """The given step if it is committed, else the newest validated one."""
    steps = committed_steps(run_uri)
    if step is not None:
        if step not in steps:
            raise ExportError(f"step {step} is not a committed checkpoint of {run_uri} (committed: {steps})")
        return step
    newest = Ledger(open_store(run_uri)).newest_validated()
    if newest is None:
        raise ExportError(f"run {run_uri} has no validated checkpoint (rtrain validate it, or name one with --step)")
    return newest


def _empty_target(output: str) -> None:
    if is_gcs(output):
        if open_store(output).list():
            raise ExportError(f"--output {output} is not empty")
    elif os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ExportError(f"--output {output} exists and is not an empty directory")


def tokenizer_file(data: DataSection) -> bytes | None:
    """The run's Hugging Face tokenizer.json, from its dataset (None: the dataset's tokenizer has none)."""
    from training.data.tokens import load_tokenizer

    try:
        tok = load_tokenizer(data.dataset)
    except Exception:  # noqa: BLE001 - a run whose dataset is gone still exports its weights
        return None
    return tok.definition() if tok.kind in ("huggingface", "bpe") else None


def export(cfg: Config, output: str, fmt: Literal["hf", "orbax"] = "hf", step: int | None = None) -> Exported:
    """Write step ``step`` (default: the newest validated) of the run ``cfg`` names to ``output``."""
    import numpy as np

    from training.checkpoint.manager import load_params_host

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt == "hf" and cfg.task != "lm":
        raise ExportError(f"--format hf writes the built-in lm task's Llama; this run's task is {cfg.task!r}")
    _empty_target(output)
    step = pick_step(cfg.run_uri, step)
    params = load_params_host(cfg.run_uri, step)
    if fmt == "orbax":
        return _orbax(cfg, step, params, output)
    from training import hf
    from training.tasks.lm import llama_config

    model = llama_config(cfg.model)
    dtype = np.dtype(hf.DTYPES["BF16"]) if cfg.model.param_dtype == "bfloat16" else np.dtype(np.float32)
    tensors = hf.from_params(params, model, dtype)
    config = hf.hf_config(model, cfg.model.param_dtype)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "hf" if is_gcs(output) else Path(output)
        files = hf.write_checkpoint(local, tensors, config, tokenizer_file(cfg.data))
        if is_gcs(output):
            store = open_store(output)
            for name in files:
                store.put(name, (local / name).read_bytes())
    return Exported(run=cfg.run_uri, step=step, format=fmt, output=output, files=files)


def _orbax(cfg: Config, step: int, params: Any, output: str) -> Exported:
    import orbax.checkpoint as ocp

    target = output if is_gcs(output) else os.path.abspath(output)
    if not is_gcs(output) and os.path.isdir(output):
        os.rmdir(output)  # empty (checked): Orbax writes the directory itself
    with ocp.StandardCheckpointer() as ck:
        ck.save(target, params)
        ck.wait_until_finished()
    return Exported(run=cfg.run_uri, step=step, format="orbax", output=output, files=[join(output, "")])
