"""The input pipeline: one global stream of examples, served to any number of processes.

A source is a grain ``MapDataset`` whose element ``i`` is example ``i`` (a dict of
numpy arrays), from any task.  The pipeline's one promise is the *data position*:
the stream is seeded and reshuffled every epoch, and global batch ``k`` is always
the same examples, however many processes share it.  A job that restarts on a
different number of hosts at step ``k`` continues at exactly the next example.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

Example = dict[str, np.ndarray]


class _AttachId:
    """Pairs an example with its index in the source.

    grain passes the index the element was asked for, which past the first
    epoch is ``epoch * n + i``; the source index is that modulo ``n``.
    """

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, index: int, example: Example) -> tuple[int, Example]:
        return index % self.n, example


def stack(items: Sequence[tuple[int, Example]]) -> Example:
    """One batch from ``(id, example)`` pairs: each field stacked, plus ``ids`` (int64)."""
    out = {key: np.stack([ex[key] for _, ex in items]) for key in items[0][1]}
    out["ids"] = np.fromiter((i for i, _ in items), dtype=np.int64, count=len(items))
    return out


def shuffle_seed(seed: int) -> int:
    """A 32-bit shuffle seed spread out from the run seed.

    grain reshuffles epoch ``e`` with seed ``s + e``; hashing keeps runs with
    seeds 0 and 1 from sharing epochs shifted by one.
    """
    return int.from_bytes(hashlib.sha256(f"rtrain-data-shuffle:{seed}".encode()).digest()[:4], "big")


def check_layout(batch: int, process_index: int, process_count: int, what: str) -> int:
    """Examples per process of a global batch; refuses a batch that does not split."""
    if batch < 1:
        raise ValueError(f"{what} must be >= 1, got {batch}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, process_count={process_count})")
    if batch % process_count:
        raise ValueError(
            f"{what} ({batch}) must be divisible by process_count ({process_count}): every process "
            "takes the same number of examples from each global batch"
        )
    return batch // process_count


def train_stream(
    source: Any, *, seed: int, global_batch: int, process_index: int, process_count: int, shuffle: bool = True
) -> Any:
    """One process's view of the global stream, as a MapDataset of batches (random access).

    The order of operations is the contract:
      shuffle -> repeat   epoch e is permutation(seed + e) of all examples;
                          shuffling after repeat would mix epochs (and grain's
                          shuffle needs a finite length).
      [p::P] -> batch(b)  process p's j-th example of global batch k is stream
                          position k*B + j*P + p: the global batch is the same
                          B positions for any P.
    """
    b = check_layout(global_batch, process_index, process_count, "global_batch")
    if len(source) == 0:
        raise ValueError("the data source is empty")
    ds = source.map_with_index(_AttachId(len(source)))
    if shuffle:
        ds = ds.shuffle(seed=shuffle_seed(seed))
    ds = ds.repeat(None)
    ds = ds[process_index::process_count]
    return ds.batch(b, drop_remainder=True, batch_fn=stack)


def batches(
    source: Any,
    *,
    seed: int,
    global_batch: int,
    process_index: int,
    process_count: int,
    start_batch: int = 0,
    shuffle: bool = True,
    num_threads: int = 2,
    prefetch: int = 4,
) -> Iterator[Example]:
    """This process's batches of the global stream, from global batch ``start_batch`` on.

    Each field has ``global_batch // process_count`` rows, plus ``ids`` (the
    examples' indices in the source).  The position in the data is the batch
    index alone: resuming at step ``k`` on any number of processes is
    ``start_batch=k``.
    """
    import grain

    if start_batch < 0:
        raise ValueError(f"start_batch must be >= 0, got {start_batch}")
    ds = train_stream(
        source,
        seed=seed,
        global_batch=global_batch,
        process_index=process_index,
        process_count=process_count,
        shuffle=shuffle,
    )
    ds = ds[start_batch:]
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return iter(ds.to_iter_dataset(options))


def batch_ids(source: Any, *, seed: int, global_batch: int, batch_index: int) -> np.ndarray:
    """Sorted example ids of global batch ``batch_index``: what every process count must cover, for audits."""
    ds = train_stream(source, seed=seed, global_batch=global_batch, process_index=0, process_count=1)
    return np.sort(ds[batch_index]["ids"])


def eval_set(
    source: Any, *, batch: int, max_batches: int, process_index: int = 0, process_count: int = 1
) -> list[Example]:
    """A fixed evaluation set: the first examples of ``source``, in order, never shuffled.

    ``batch`` is global and laid out like training batches (process p takes
    examples p, p+P, ...), so the set and its metrics do not depend on the
    process count.  There are ``min(max_batches, ceil(n / batch))`` batches,
    all full: a source smaller than that wraps around in the last batch,
    because a jitted eval step wants one shape.
    """
    if max_batches < 1:
        raise ValueError(f"max_batches must be >= 1, got {max_batches}")
    b = check_layout(batch, process_index, process_count, "batch")
    if len(source) == 0:
        raise ValueError("the evaluation source is empty")
    n_batches = min(max_batches, -(-len(source) // batch))
    ds = source.map_with_index(_AttachId(len(source))).repeat(None)[process_index::process_count]
    ds = ds.batch(b, drop_remainder=True, batch_fn=stack)
    return [ds[k] for k in range(n_batches)]
