"""A prepared token dataset as a random-access source of language-model examples.

Each record of a prepared split is ``seq_len + 1`` token ids (their dtype is in
the manifest); example ``i`` is record ``i`` shifted into inputs and targets,
with the segment id and the position inside its document of every input token,
so packed documents do not attend across each other.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from training.data.errors import DatasetError
from training.data.preparation import SEPARATOR
from training.data.shards import Manifest, load_manifest, shard_paths
from training.data.tokenizer import Tokenizer, from_manifest
from training.storage import open_store


def token_dtype(manifest: Manifest) -> np.dtype[Any]:
    """The dtype of a dataset's token ids (bytes for the byte-level format)."""
    return np.dtype(str(manifest.get("token_dtype", "uint8")))


def eos_id(manifest: Manifest) -> int:
    """The token that ends every document of a dataset."""
    return int(manifest.get("eos_id", SEPARATOR))


class LMExample:
    """Record bytes -> ``inputs``, ``targets``, ``segment_ids``, ``positions`` (int32 each)."""

    def __init__(self, dtype: np.dtype[Any], eos: int) -> None:
        self.dtype = dtype
        self.eos = eos

    def __call__(self, record: bytes) -> dict[str, np.ndarray]:
        tokens = np.frombuffer(record, dtype=self.dtype).astype(np.int32)
        inputs, targets = tokens[:-1], tokens[1:]
        return {"inputs": inputs, "targets": targets, **segments(inputs, self.eos)}


def segments(inputs: np.ndarray, eos: int) -> dict[str, np.ndarray]:
    """Segment ids (1, 2, ...: a document starts after each ``eos``) and positions inside each document."""
    starts = np.zeros(len(inputs), dtype=bool)
    starts[0] = True
    starts[1:] = inputs[:-1] == eos
    seg = np.cumsum(starts).astype(np.int32)
    idx = np.arange(len(inputs), dtype=np.int32)
    first = np.maximum.accumulate(np.where(starts, idx, 0))
    return {"segment_ids": seg, "positions": (idx - first).astype(np.int32)}


@functools.lru_cache(maxsize=8)
def records(dataset_uri: str, split: str, cache_dir: str | None = None, reads: str = "auto") -> Any:
    """A grain MapDataset of one split's raw records (opened once per process: datasets are immutable)."""
    import grain

    paths = shard_paths(dataset_uri, split, cache_dir, reads)
    if not paths:
        raise DatasetError(f"the {split} split of {dataset_uri} is empty")
    return grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))


def lm_source(dataset_uri: str, split: str, cache_dir: str | None = None, reads: str = "auto") -> Any:
    """A split of a prepared dataset as language-model examples (a grain MapDataset); ``reads``: how a host
    reads a ``gs://`` one (``shards.READS``)."""
    manifest = load_manifest(dataset_uri)
    return records(dataset_uri, split, cache_dir, reads).map(LMExample(token_dtype(manifest), eos_id(manifest)))


def load_tokenizer(dataset_uri: str) -> Tokenizer:
    """The tokenizer of a prepared dataset (bytes for a byte-level one), to decode its ids."""
    manifest = load_manifest(dataset_uri)
    return from_manifest(manifest.get("tokenizer"), open_store(dataset_uri), manifest.get("eos_id"))
