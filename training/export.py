"""``rtrain export``: a committed step's parameters as a Hugging Face directory or a plain Orbax checkpoint.

The step is the newest validated one unless one is named.  ``hf`` writes ``config.json``, safetensors
(sharded past 4 GiB a file), the dataset's ``tokenizer.json`` (when it was prepared with one) and a
``generation_config.json``, which transformers' ``LlamaForCausalLM`` loads and ``generate()`` stops at the
end of a text by; ``orbax`` writes the named parameter tree alone with Orbax's ``StandardCheckpointer``,
restorable by any Orbax user.

Where a text begins and ends (``bos_token_id``, ``eos_token_id``, in config.json and
generation_config.json) comes from the checkpoint the run started from (``init_from``) when the run
tokenizes with that checkpoint's own tokenizer, its generation_config.json copied whole; else from the
run's tokenizer: its end-of-document id, and its beginning-of-text token where it has one, else the
end-of-document id again (in the packed training data a text begins after one).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from training.checkpoint.ledger import Ledger
from training.checkpoint.steps import committed_steps
from training.config import Config
from training.sections import DataSection
from training.storage import NotFound, is_gcs, join, open_store, scheme

if TYPE_CHECKING:
    from training.data.tokenizer import Tokenizer

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
    if not scheme(output).filesystem:
        if open_store(output).list():
            raise ExportError(f"--output {output} is not empty")
    elif os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ExportError(f"--output {output} exists and is not an empty directory")


def run_tokenizer(data: DataSection) -> Tokenizer | None:
    """The run's tokenizer: its dataset's, else the data section's own where it needs no dataset (None: neither)."""
    from training.data.tokenizer import Tokenizer, resolve
    from training.data.tokens import load_tokenizer

    try:
        return load_tokenizer(data.dataset)
    except Exception:  # noqa: BLE001 - a run whose dataset is gone still exports its weights
        pass
    try:
        tok = resolve(data.tokenizer) if data.tokenizer != "bpe" else None  # a bpe is trained with its dataset
    except Exception:  # noqa: BLE001 - nor does a tokenizer file that is gone stop an export
        return None
    return tok if isinstance(tok, Tokenizer) else None


def tokenizer_file(data: DataSection) -> bytes | None:
    """The run's Hugging Face tokenizer.json (None: its tokenizer has none)."""
    tok = run_tokenizer(data)
    return tok.definition() if tok is not None and tok.kind in ("huggingface", "bpe") else None


@dataclass(frozen=True)
class Generation:
    """Where an exported model's texts begin and end: config.json's ``bos_token_id``/``eos_token_id`` and the
    generation_config.json that transformers' ``generate()`` reads, with where they came from."""

    ids: dict[str, Any]  # bos_token_id, eos_token_id (an id or a list of them)
    config: dict[str, Any]  # generation_config.json
    source: str


def generation(cfg: Config) -> Generation | None:
    """The export's generation settings: the source checkpoint's when the run uses its tokenizer, else the run
    tokenizer's (None: the run's tokenizer cannot be read any more)."""
    from training.hf import GENERATION_FILE, TOKENIZER_FILE, HFError, read_config

    source = cfg.model.init_from
    if source and cfg.data.tokenizer == join(source, TOKENIZER_FILE):
        store = open_store(source)
        try:
            model = read_config(store)
            gen = json.loads(store.get(GENERATION_FILE))
        except NotFound:
            gen = {}
        except (HFError, ValueError):  # gone or unreadable since the run began: the tokenizer tells
            gen = None
        if isinstance(gen, dict):
            ids = {k: gen.get(k, model.get(k)) for k in ("bos_token_id", "eos_token_id")}
            if ids["eos_token_id"] is not None:
                ids = {k: v for k, v in ids.items() if v is not None}
                return Generation(ids, gen | ids, f"{source} ({GENERATION_FILE if gen else 'config.json'})")
    tok = run_tokenizer(cfg.data)
    if tok is None:
        return None
    ids = {"bos_token_id": tok.eos_id if tok.bos_id is None else tok.bos_id, "eos_token_id": tok.eos_id}
    return Generation(ids, dict(ids), f"the run's {tok.kind} tokenizer")


def export(cfg: Config, output: str, fmt: Literal["hf", "orbax"] = "hf", step: int | None = None) -> Exported:
    """Write step ``step`` (default: the newest validated) of the run ``cfg`` names to ``output``."""
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
    with tempfile.TemporaryDirectory() as tmp:
        staged = not scheme(output).filesystem  # written here, then put into the store
        local = Path(tmp) / "hf" if staged else Path(output)
        files = write_hf(cfg, params, local)
        if staged:
            store = open_store(output)
            for name in files:
                store.put(name, (local / name).read_bytes())
    return Exported(run=cfg.run_uri, step=step, format=fmt, output=output, files=files)


def write_hf(cfg: Config, params: Any, out: Path) -> list[str]:
    """Run ``cfg``'s Llama parameters ``params`` (scanned or not) as a Hugging Face directory at ``out``: config.json
    with the model's shapes and where texts begin and end, safetensors in the run's parameter dtype, tokenizer.json
    and generation_config.json.  Returns the files written."""
    import numpy as np

    from training import hf
    from training.tasks.lm import llama_config

    model = llama_config(cfg.model)
    dtype = np.dtype(hf.DTYPES["BF16"]) if cfg.model.param_dtype == "bfloat16" else np.dtype(np.float32)
    gen = generation(cfg)
    config = hf.hf_config(model, cfg.model.param_dtype) | (gen.ids if gen else {})
    tensors = hf.from_params(params, model, dtype)
    return hf.write_checkpoint(out, tensors, config, tokenizer_file(cfg.data), gen.config if gen else None)


def _orbax(cfg: Config, step: int, params: Any, output: str) -> Exported:
    import orbax.checkpoint as ocp

    target = output if is_gcs(output) else os.path.abspath(output)
    if not is_gcs(output) and os.path.isdir(output):
        os.rmdir(output)  # empty (checked): Orbax writes the directory itself
    with ocp.StandardCheckpointer() as ck:
        ck.save(target, params)
        ck.wait_until_finished()
    return Exported(run=cfg.run_uri, step=step, format="orbax", output=output, files=[join(output, "")])
