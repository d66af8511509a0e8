"""A run's TensorBoard scalars as TensorBoard shows them, read by its own ``EventAccumulator`` (the tests' reader)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

from training.scalars import TENSORBOARD
from training.storage import LocalStore, Store, open_store


class _QuietPurges(logging.Filter):
    """Purges are how rollbacks are shown here, not a problem worth a warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Detected out of order event.step")


def read_scalars(
    run_uri: str, subdir: str = "train", *, store: Store | None = None
) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` as TensorBoard shows it: read by its ``EventAccumulator``.

    Every value is kept (no sampling) and restarts purge as in the UI, so a
    resumed run has one value per step.  A ``gs://`` run's event files are copied
    to a temporary directory first (the accumulator reads local files without
    TensorFlow).
    """
    from tensorboard.backend.event_processing import event_accumulator

    store = store or open_store(run_uri)
    prefix = f"{TENSORBOARD}/{subdir}/"
    keys = [k for k in store.list(prefix) if "/" not in k[len(prefix) :] and "tfevents" in k[len(prefix) :]]
    if not keys:
        return {}
    tmp = None
    if isinstance(store, LocalStore):
        path = store.child(prefix)
    else:
        tmp = path = tempfile.mkdtemp(prefix="rtrain-tb-")
        for k in keys:
            with open(os.path.join(tmp, k[len(prefix) :]), "wb") as f:
                f.write(store.get(k))
    quiet = _QuietPurges()
    tb_log = logging.getLogger("tensorboard")
    tb_log.addFilter(quiet)
    try:
        acc: Any = event_accumulator.EventAccumulator(
            path, size_guidance={event_accumulator.SCALARS: 0}, purge_orphaned_data=True
        )
        acc.Reload()
        out = {str(tag): [(int(e.step), float(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
        return {tag: points for tag, points in out.items() if points}  # (a tag whose points were all purged)
    finally:
        tb_log.removeFilter(quiet)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
