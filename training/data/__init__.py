"""Datasets: preparation into shards (``prepare``), token sources (``tokens``) and the input pipeline.

The functions below serve a prepared token dataset by its URI, for the built-in
language-model task, the tests and audits; a task of its own hands its source to
:mod:`training.data.pipeline` directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from training.data import pipeline
from training.data.preparation import SEPARATOR, SPLITS, DatasetError, DatasetExistsError, prepare
from training.data.shards import MANIFEST, load_manifest, local_shards, shard_paths
from training.data.tokens import lm_source, load_tokenizer

__all__ = [
    "MANIFEST",
    "SEPARATOR",
    "SPLITS",
    "DatasetError",
    "DatasetExistsError",
    "eval_batches",
    "global_batch_ids",
    "lm_source",
    "load_manifest",
    "load_tokenizer",
    "local_shards",
    "make_batches",
    "prepare",
    "shard_paths",
    "warm",
]


def warm(dataset_uri: str, split: str = "train", cache_dir: str | None = None) -> None:
    """Open (and verify) a split before it is needed: a standby worker does this while it waits."""
    lm_source(dataset_uri, split, cache_dir)


def make_batches(
    dataset_uri: str,
    split: str,
    *,
    seed: int,
    global_batch: int,
    process_index: int,
    process_count: int,
    start_batch: int = 0,
    shuffle: bool = True,
    num_threads: int = 2,
    prefetch: int = 4,
    cache_dir: str | None = None,
    reads: str = "auto",
) -> Iterator[dict[str, np.ndarray]]:
    """This process's batches of a prepared dataset's split, from global batch ``start_batch`` on."""
    return pipeline.batches(
        lm_source(dataset_uri, split, cache_dir, reads),
        seed=seed,
        global_batch=global_batch,
        process_index=process_index,
        process_count=process_count,
        start_batch=start_batch,
        shuffle=shuffle,
        num_threads=num_threads,
        prefetch=prefetch,
    )


def global_batch_ids(
    dataset_uri: str, *, seed: int, global_batch: int, batch_index: int, split: str = "train", **kw: Any
) -> np.ndarray:
    """Sorted record ids of global batch ``batch_index`` of a prepared dataset, for audits."""
    return pipeline.batch_ids(
        lm_source(dataset_uri, split, kw.get("cache_dir")),
        seed=seed,
        global_batch=global_batch,
        batch_index=batch_index,
    )


def eval_batches(
    dataset_uri: str,
    *,
    batch: int,
    max_batches: int,
    process_index: int = 0,
    process_count: int = 1,
    cache_dir: str | None = None,
) -> list[dict[str, np.ndarray]]:
    """The fixed evaluation set of a prepared dataset: its first validation records, in order."""
    return pipeline.eval_set(
        lm_source(dataset_uri, "validation", cache_dir),
        batch=batch,
        max_batches=max_batches,
        process_index=process_index,
        process_count=process_count,
    )
