"""Which checkpoint steps of a run exist, by Orbax's own rule; and their integrity records.

Light on purpose: the Airflow side and the CLI list committed steps and check
integrity records without loading JAX.  ``orbax.checkpoint`` (which imports JAX)
is imported inside :func:`committed_steps` only, the one place that needs it.

Integrity: just before a step commits, the process committing it writes the
size and CRC32C of every file of the step into the step itself (``integrity.json``,
:func:`record_integrity`; on gs:// the object metadata GCS keeps anyway, elsewhere
computed with google-crc32c), so the record is of what was written, whatever
happens to the files once committed.  Rank 0's agent copies it into the ledger's
``committed`` record.  A restore first compares the files with that record
(:func:`verify`): a flipped byte, a truncated or a missing file is found before
any of it is trusted, and named.  Orbax and TensorStore have no such check of
their own for our formats (zarr and OCDBT chunks carry no checksums).
"""

from __future__ import annotations

import json
import logging
import sys

from training.layout import checkpoints_uri, step_uri
from training.storage import NotFound, open_store

INTEGRITY = "integrity.json"  # in each step: the size and CRC32C of its files, written before it commits
# What Orbax writes or rewrites as it commits, after the record: not in it.
UNRECORDED = frozenset({INTEGRITY, "_CHECKPOINT_METADATA", "commit_success.txt"})

log = logging.getLogger(__name__)

_fresh = False


def fresh_gcs_listings() -> None:
    """Make every gs:// listing through fsspec's gcsfs (Orbax's, through ``etils.epath``) ask the bucket.

    gcsfs keeps each directory listing it made and forgets it only on its own writes, so a
    process would never see a step another host committed: a save would seem not to have
    committed, and the newest checkpoint would be missed.  A filesystem made before this call
    keeps its listings, so the one ``etils`` holds is dropped.
    """
    global _fresh
    if _fresh:
        return
    import fsspec.config

    for protocol in ("gs", "gcs"):
        fsspec.config.conf.setdefault(protocol, {})["use_listings_cache"] = False
    backend = sys.modules.get("etils.epath.backend")
    if backend is not None:
        backend._FileSystemSpecBackend._get_filesystem.cache_clear()
    _fresh = True


def committed_steps(run: str) -> list[int]:
    """Committed (finalised) checkpoint steps of a run, ascending, as Orbax decides."""
    fresh_gcs_listings()
    from etils import epath

    # Orbax's own rule (a renamed directory locally, a commit marker on gs://): imported here,
    # not at module level, because it loads JAX.
    from orbax.checkpoint import path as ocp_path

    root = epath.Path(checkpoints_uri(run))
    if not root.exists():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and ocp_path.step.is_checkpoint_finalized(p))


def is_committed(run: str, step: int) -> bool:
    """Whether checkpoint ``step`` of a run is committed (finalised), as Orbax decides: a look at that step alone."""
    fresh_gcs_listings()
    from etils import epath
    from orbax.checkpoint import path as ocp_path

    path = epath.Path(step_uri(run, step))
    return bool(path.exists() and ocp_path.step.is_checkpoint_finalized(path))


def file_checksums(run: str, step: int) -> dict[str, list[int]]:
    """``{relative file name: [size, crc32c]}`` of every file of a committed step."""
    return open_store(step_uri(run, step)).checksums()


def record_integrity(step_dir: str) -> None:
    """Write the integrity record of the step being committed at ``step_dir`` into it (Orbax's commit calls this).

    One that cannot be written does not stop the commit: the step's agent sums the committed files instead.
    """
    try:
        store = open_store(step_dir)
        files = {name: v for name, v in store.checksums().items() if name not in UNRECORDED}
        store.put(INTEGRITY, json.dumps(files, sort_keys=True).encode())
    except Exception as e:  # noqa: BLE001 - the commit matters more than where its record comes from
        log.warning("could not record the integrity of %s: %s", step_dir, e)


class UnreadableRecord(ValueError):
    """A step's integrity record is there but cannot be read: the step cannot be trusted."""


def recorded_checksums(run: str, step: int) -> dict[str, list[int]] | None:
    """The integrity record written into a step as it committed; None for a step without one."""
    try:
        raw = open_store(step_uri(run, step)).get(INTEGRITY)
    except NotFound:
        return None
    try:
        return dict(json.loads(raw))
    except (ValueError, TypeError, UnicodeDecodeError):
        raise UnreadableRecord(f"the integrity record of checkpoint {step} is unreadable") from None


def verify(run: str, step: int, expected: dict[str, list[int]] | None) -> str:
    """'' when the step's files match its integrity record, else what is wrong (naming the file).

    ``expected``: the ledger's record; without one (the step's agent died before it copied the
    record), the record written into the step.  A step with neither (committed by an older
    version) is not checked.
    """
    if not expected:
        try:
            expected = recorded_checksums(run, step)
        except UnreadableRecord as e:
            return str(e)
    if not expected:
        return ""
    found = file_checksums(run, step)
    for name, (size, crc) in sorted(expected.items()):
        got = found.get(name)
        if got is None:
            return f"file {name} of checkpoint {step} is missing"
        if int(got[0]) != int(size):
            return f"file {name} of checkpoint {step} has {got[0]} bytes, {size} when committed (truncated?)"
        if int(got[1]) != int(crc):
            return f"file {name} of checkpoint {step} fails its CRC32C check (changed since it was committed)"
    return ""
