"""Where the Training view may read runs from: the project's ``var/runs`` and ``RTRAIN_STORAGE_ROOTS``."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from urllib.parse import quote

from rtrain_airflow.hooks.training import PROJECT_ROOT, absolute
from training.api import RUN_NAME_PATTERN

log = logging.getLogger(__name__)

STORAGE_ROOTS_ENV = "RTRAIN_STORAGE_ROOTS"


class Refused(ValueError):
    """A run or root that is not allowed (the message says why); a 403."""


def _split_roots(value: str) -> list[str]:
    """``RTRAIN_STORAGE_ROOTS``: colon-separated, where ``gs://`` keeps its own colon."""
    parts, out, i = value.split(":"), [], 0
    while i < len(parts):
        if parts[i].strip() == "gs" and i + 1 < len(parts) and parts[i + 1].startswith("//"):
            out.append("gs:" + parts[i + 1].strip())
            i += 2
            continue
        if parts[i].strip():
            out.append(parts[i].strip())
        i += 1
    return out


_GCS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


def _gcs(uri: str) -> str | None:
    """``gs://bucket/a/b`` without a trailing slash, or None when it is not a plain one (``..``, ``//``, ``.``)."""
    if not uri.startswith("gs://"):
        return None
    segments = uri[len("gs://") :].rstrip("/").split("/")
    if not _GCS_BUCKET.match(segments[0]) or any(s in ("", ".", "..") or "\\" in s for s in segments[1:]):
        return None
    return "gs://" + "/".join(segments)


def default_root() -> str:
    return os.path.realpath(PROJECT_ROOT / "var" / "runs")


def storage_roots() -> tuple[list[str], list[str]]:
    """(local roots, resolved; gs:// roots): the project's var/runs and ``RTRAIN_STORAGE_ROOTS``."""
    local, gcs = [default_root()], []
    for item in _split_roots(os.environ.get(STORAGE_ROOTS_ENV, "")):
        if item.startswith("gs://"):
            if norm := _gcs(item):
                gcs.append(norm)
            else:
                log.warning("%s: ignoring %r (not a plain gs://bucket/prefix)", STORAGE_ROOTS_ENV, item)
        else:
            local.append(os.path.realpath(absolute(item, PROJECT_ROOT)))
    return local, gcs


def run_root(run_name: str, root: str | None) -> str:
    """The run root of ``run_name`` under ``root`` (default: var/runs), if both are allowed; else Refused."""
    if not isinstance(run_name, str) or not re.match(RUN_NAME_PATTERN, run_name):
        raise Refused(f"run_name must match {RUN_NAME_PATTERN}")
    local, gcs = storage_roots()
    if root and root.startswith("gs://"):
        base = _gcs(root)
        if base is None:
            raise Refused("root: not a plain gs://bucket/prefix")
        if not any(base == r or base.startswith(r + "/") for r in gcs):
            raise Refused(f"root: {base} is not inside the storage roots (see {STORAGE_ROOTS_ENV})")
        return f"{base}/{run_name}"
    try:
        base = default_root() if not root else os.path.realpath(absolute(root, PROJECT_ROOT))
        resolved = os.path.realpath(os.path.join(base, run_name))  # the run directory itself may be a link
    except (ValueError, OSError) as e:  # a NUL byte, a symlink loop
        raise Refused(f"root: cannot be resolved ({type(e).__name__})") from None
    if not any(Path(resolved).is_relative_to(r) and resolved != r for r in local):
        raise Refused(f"root: the run is not inside the storage roots (see {STORAGE_ROOTS_ENV})")
    return resolved


def pool_root(root: str | None) -> str:
    """A storage root (default: var/runs) whose runs share a pool, if it is allowed; else Refused."""
    return run_root("queue", root).rsplit("/", 1)[0]


def root_query(uri: str) -> str:
    """``?root=...`` for a run root's URLs ('' for the default root)."""
    parent = uri.rstrip("/").rsplit("/", 1)[0]
    return "" if parent == default_root() else f"?root={quote(parent)}"
