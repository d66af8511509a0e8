"""Greedy decoding from a checkpoint of the built-in language model: what the model learned, in words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from training.checkpoint.steps import committed_steps
from training.config import Config
from training.tasks import TaskError


@dataclass(frozen=True)
class Sample:
    """A prompt and its greedy continuation, with the checkpoint they came from."""

    step: int
    prompt: str
    completion: str
    prompt_tokens: int
    new_tokens: int
    stopped_at_eos: bool


def sample(cfg: Config, prompt: str, *, max_new_tokens: int = 64, step: int | None = None) -> Sample:
    """Continue ``prompt`` greedily from a committed checkpoint (default: the newest) of the run ``cfg`` names.

    The model sees the last ``seq_len`` tokens; every call runs one compiled
    program of that fixed length (the sequence padded on the right: causal
    attention makes the padding invisible to the position read).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from training.checkpoint.manager import load_params_host
    from training.data.tokens import load_tokenizer
    from training.tasks import load_task
    from training.tasks.lm import LanguageModel

    task = load_task(cfg)
    if not isinstance(task, LanguageModel):
        raise TaskError(f"rtrain sample decodes the built-in lm task only; this run's task is {cfg.task!r}")
    steps = committed_steps(cfg.run_uri)
    if not steps:
        raise TaskError(f"run {cfg.run_uri} has no committed checkpoint to sample from")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise TaskError(f"step {step} is not a committed checkpoint of {cfg.run_uri} (committed: {steps})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    tok = load_tokenizer(cfg.data.dataset)
    params = load_params_host(cfg.run_uri, step)
    n = cfg.model.seq_len

    @jax.jit
    def next_token(p: Any, window: jax.Array, last: jax.Array) -> jax.Array:
        logits = task.logits(p, {"inputs": window[None]})
        return jnp.argmax(logits[0, last])

    ids = list(tok.encode(prompt)) or [tok.eos_id]
    start = len(ids)
    eos = False
    for _ in range(max_new_tokens):
        ctx = ids[-n:]
        window = np.zeros(n, np.int32)
        window[: len(ctx)] = ctx
        nxt = int(next_token(params, jnp.asarray(window), jnp.int32(len(ctx) - 1)))
        if nxt == tok.eos_id:
            eos = True
            break
        ids.append(nxt)
    new = ids[start:]
    return Sample(step, prompt, tok.decode(new), start, len(new), eos)
