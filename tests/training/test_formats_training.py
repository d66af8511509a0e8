"""Text, JSONL and Parquet data, tokenized with a BPE, trained through resizes: exact example ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import job_config, run_job, step_ids, worker_logs

from training import api, data
from training.data import pipeline

pytestmark = pytest.mark.slow

FILLER = "the model reads document {i}: def f{i}(x):\n    return x * {i} + {j}\n"


def _write(fmt: str, where: Path) -> str:
    docs = [FILLER.format(i=i, j=j) * (1 + i % 3) for i in range(120) for j in range(2)]
    where.mkdir(parents=True)
    if fmt == "text":
        for k, doc in enumerate(docs):
            (where / f"doc{k:04d}.txt").write_text(doc)
        return str(where)
    if fmt == "jsonl":
        (where / "docs.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
        return str(where / "docs.jsonl")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": docs}), where / "docs.parquet")
    return str(where / "docs.parquet")


@pytest.mark.parametrize(
    "fmt",
    [
        pytest.param("parquet", marks=pytest.mark.extended),
        pytest.param("jsonl", marks=pytest.mark.extended),
        pytest.param("text", marks=pytest.mark.extended),
    ],
)
def test_a_bpe_dataset_from_each_format_trains_through_a_shrink_and_a_regrowth_on_the_exact_examples(
    tmp_path: Path, jax_cache: str, fmt: str
) -> None:
    source = _write(fmt, tmp_path / "src")
    dataset = str(tmp_path / "ds")
    field = None if fmt == "text" else "body"
    manifest = data.prepare(source, dataset, 64, tokenizer="bpe", vocab_size=320, field=field, val_fraction=0.05)
    assert manifest["tokenizer"]["kind"] == "bpe" and manifest["token_dtype"] == "uint16"
    cfg = job_config(
        str(tmp_path / "runs"),
        dataset,
        jax_cache,
        run_name=f"fmt-{fmt}",
        tokenizer="bpe",
        vocab_size=320,
        # Enough steps on one host for the second host to come back (an agent's start, a warm worker): a round
        # that loads its kept step trains on at once.
        steps=90,
        min_workers=1,
        max_workers=2,
        checkpoint_every=3,
        chaos=["capacity:to=1,step=5", "capacity:to=2,step=9"],
        trace_data_ids=True,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    st = api.status(cfg.run_uri)
    assert st["state"] == "finished" and st["step"] == 90

    ids = step_ids(cfg.run_uri)
    assert sorted(ids) == list(range(cfg.optimizer.steps)), "every step consumed exactly one global batch"
    source_ds = data.lm_source(dataset, "train")
    for step, got in ids.items():
        want = pipeline.batch_ids(
            source_ds, seed=cfg.optimizer.seed, global_batch=cfg.optimizer.global_batch, batch_index=step
        )
        assert got == sorted(int(i) for i in want), f"step {step}: wrong examples after a resize"
    sizes = [e["workers"] for e in api.events(cfg.run_uri, ["launch"])]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, f"the job did not shrink and grow back: {sizes}"
