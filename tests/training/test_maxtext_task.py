"""The ``maxtext`` task: MaxText's own Llama 3 trained by this engine (the ``maxtext`` extra).

Fast: the real llama3-8b of MaxText has the published parameter count and the built-in ``lm`` preset's;
a tiny one is sharded by MaxText's logical axes narrowed to the engine's mesh, trains (its loss falls)
and is evaluated through the engine's own trainer and host validation; bad arguments are one line each.
Slow: the README's commands (prepare, train on 2 hosts through a lost one, validate) run as written;
extended: the same job keeps the exact data position.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jax
import pytest

from training.config import Config, load_config
from training.tasks import TaskError, load_task

pytest.importorskip("maxtext", reason="the maxtext extra: pip install -e '.[maxtext]'")

LLAMA3_8B = 8_030_261_248  # MaxText's llama3-8b, and Meta's published Llama 3 8B
TINY = {  # a Llama 3 of MaxText's llama3-8b file, narrowed to seconds on CPU
    "base_emb_dim": 64,
    "base_num_query_heads": 4,
    "base_num_kv_heads": 2,
    "base_num_decoder_layers": 2,
    "base_mlp_dim": 128,
    "head_dim": 16,
    "vocab_size": 512,
    "dtype": "float32",
}


def config(task_args: dict[str, Any], **overrides: Any) -> Config:
    return load_config("tiny", None, {"task": "maxtext", "task_args": task_args, **overrides})


def n_params(tree: Any) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def test_maxtexts_llama3_8b_has_the_published_parameter_count_and_the_builtin_presets() -> None:
    from training.mesh import build_mesh, plan_mesh
    from training.optim import make_optimizer, make_schedule
    from training.trainer import state_shardings

    cfg = config({"model_name": "llama3-8b"}, seq_len=128, devices_per_worker=1, min_workers=1)
    task = load_task(cfg)
    mesh = build_mesh(plan_mesh(cfg.placement, 1), jax.devices()[:1])
    layout = state_shardings(task, make_optimizer(cfg.optimizer, make_schedule(cfg.optimizer)), mesh)
    params, shardings = layout.params, layout.param_shardings
    assert n_params(params) == LLAMA3_8B
    builtin = load_config("llama3-8b", None, {"devices_per_worker": 1, "min_workers": 1, "max_workers": 1})
    assert n_params(jax.eval_shape(load_task(builtin).init, jax.random.key(0))) == LLAMA3_8B
    # MaxText's axis names reach the engine's mesh: its query kernel is split over fsdp (embed) and tensor (heads).
    query = shardings["decoder"]["layers"]["self_attention"]["query"]["kernel"].spec
    assert tuple(query) == ("fsdp", None, "tensor", None), query


def test_a_tiny_maxtext_llama3_trains_and_validates_through_the_engine(tiny_dataset: str) -> None:
    from training.checkpoint.lifecycle import evaluate
    from training.data import make_batches
    from training.mesh import build_mesh, plan_mesh
    from training.trainer import Trainer

    cfg = config(
        {"model_name": "llama3-8b", "overrides": TINY},
        dataset=tiny_dataset,
        devices_per_worker=1,
        min_workers=1,
        learning_rate=3e-3,
        warmup_steps=2,
        val_batch=8,
        val_batches=2,
    )
    task = load_task(cfg)
    trainer = Trainer(cfg.optimizer, build_mesh(plan_mesh(cfg.placement, 1)), task)
    state = trainer.init()
    batches = make_batches(tiny_dataset, "train", seed=0, global_batch=16, process_index=0, process_count=1)
    batch = trainer.global_batch(next(batches))
    losses = []
    for _ in range(12):  # one batch, again and again: the loss must fall
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert math.log(256) - 0.5 < losses[0] < math.log(512) + 0.5, losses  # near uniform over its vocabulary
    assert losses[-1] < 0.8 * losses[0], losses
    metrics = evaluate(cfg, jax.device_get(state["params"]))  # host validation: one device, no mesh of its own
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]), rel=1e-5)
    assert 0 < metrics["loss"] < math.log(512) + 0.5


@pytest.mark.parametrize(
    ("task_args", "says"),
    [
        ({"model": "llama3-8b"}, "unknown task_args key 'model'"),
        ({"model_name": "llama9-1t"}, "MaxText has no model 'llama9-1t'"),
        ({"overrides": {"max_target_length": 4096}}, "may not set max_target_length (the config's seq_len)"),
        ({"overrides": []}, "task_args.overrides must be a mapping"),
        ({"overrides": {"base_emb_dmi": 64}}, "'base_emb_dmi' is not a key of MaxText's configuration"),
        (
            {"overrides": {"decoder_block": "psychic"}},
            "MaxText refused the configuration: decoder_block: Input should be",
        ),
    ],
)
def test_bad_maxtext_arguments_are_named_in_one_line(task_args: dict[str, Any], says: str) -> None:
    with pytest.raises(TaskError) as e:
        load_task(config(task_args))
    message = str(e.value)
    assert says in message and "\n" not in message and "maxtext" in message, message


def test_a_dataset_with_more_tokens_than_the_model_is_refused(tiny_dataset: str) -> None:
    small = {**TINY, "vocab_size": 128}  # the byte-level dataset has 256
    task = load_task(config({"model_name": "llama3-8b", "overrides": small}, dataset=tiny_dataset))
    with pytest.raises(TaskError, match=r"vocabulary of 256 tokens, more than the model's vocab_size=128"):
        task.data()


@pytest.mark.slow
@pytest.mark.extended
def test_a_maxtext_llama3_trains_elastically_through_a_lost_host_on_the_exact_examples(
    tmp_path: Any, tiny_dataset: str, jax_cache: str
) -> None:
    """Two hosts train MaxText's Llama 3 (tiny), one is preempted at step 10, the other finishes the run."""
    from jobs import assert_exact_data, job_config, run_job, worker_logs

    from training import api

    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="maxtext",
        task="maxtext",
        task_args={"model_name": "llama3-8b", "overrides": TINY},
        steps=16,
        checkpoint_every=4,
        min_workers=1,
        max_workers=2,
        chaos=["preempt:worker=1,step=10"],
        trace_data_ids=True,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    st = api.status(cfg.run_uri)
    assert st["state"] == "finished" and st["step"] == 16, st
    assert [e["workers"] for e in api.events(cfg.run_uri, ("launch",))] == [2, 1]
    assert_exact_data(cfg.run_uri, tiny_dataset, cfg)
    verdict = api.validate(cfg.run_uri, 16)
    assert verdict["verdict"] == "validated" and float(verdict["metrics"]["loss"]) < math.log(512), verdict


@pytest.mark.slow
@pytest.mark.extended
def test_the_readme_s_maxtext_commands_run_as_written(tmp_path: Path) -> None:
    """In a directory holding only the examples and the shared .venv, as a user's checkout would."""
    repo = Path(__file__).resolve().parents[2]
    readme = (repo / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme[readme.index("**MaxText's models**") :], re.S)
    assert block, "no bash block after the README's MaxText paragraph"
    commands = [c for c in block.group(1).splitlines() if c.strip()]
    assert [c.split()[:2] for c in commands] == [[".venv/bin/rtrain", v] for v in ("prepare", "train", "validate")]
    project = tmp_path / "project"
    shutil.copytree(repo / "examples", project / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    (project / ".venv").symlink_to(repo / ".venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "RTRAIN_"))}
    out = []
    for cmd in commands:
        r = subprocess.run(["bash", "-c", cmd], cwd=project, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{cmd}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
        out.append(r.stdout)
    assert re.search(r"finished: step (\d+)/\1, .*1 failure\(s\) absorbed", out[1]), out[1]
    assert re.search(r"^\s+24\s+validated\s", out[2], re.M), out[2]
    saved = json.loads((project / "var" / "runs" / "mt1" / "config.json").read_text())
    assert saved["task"] == "maxtext" and saved["task_args"]["model_name"] == "llama3-8b"
