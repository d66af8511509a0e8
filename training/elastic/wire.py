"""A worker's reports to its agent: a closed set of types, each one JSON line on the worker's pipe."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypedDict


class ReportType(StrEnum):
    """What a worker tells its agent (the agent turns most of them into the run's events)."""

    WORKER_STARTED = "worker_started"  # imports done, standing by for a round
    INIT = "init"  # a fresh state (no checkpoint to restore)
    RESTORE = "restore"  # a checkpoint restored (persistent or local tier)
    COMPILED = "compiled"  # the step compiled (or loaded) for this round's mesh
    COMPILED_AHEAD = "compiled_ahead"  # a smaller size's step compiled ahead of need
    RESUMED = "resumed"  # the round's first step done
    RESUMED_WITH = "resumed_with"  # what the round resumed with (data position, rollback)
    DATA_REFRESHED = "data_refreshed"  # the dataset changed under a resumed run
    METRICS = "metrics"  # a step's loss and metrics
    PROGRESS = "progress"  # throughput
    EVALUATED = "evaluated"  # an in-job evaluation
    CHECKPOINT = "checkpoint"  # a persistent save: committed, or its blocking part done
    LOCAL_CHECKPOINT = "local_checkpoint"  # a local-tier copy finalised
    LOCAL_CHECKPOINT_SKIPPED = "local_checkpoint_skipped"  # a local copy skipped (the last still being written)
    LOCAL_TIER_OFF = "local_tier_off"  # the local tier cannot work for this state (why)
    CORRUPT = "corrupt"  # a checkpoint that failed its checks or its restore
    GUARD = "guard"  # a loss spike or a non-finite step caught
    RESCALE_REQUESTED = "rescale_requested"  # stopped at a checkpoint for a resize
    PREEMPTED = "preempted"  # a preemption notice answered
    CHAOS = "chaos"  # an injected fault fired here
    FINISHED = "finished"  # the last step done
    ERROR = "error"  # the worker's fatal error


# The fields each type must carry (besides time, attempt and process_id, which every report has).
REQUIRED: dict[ReportType, tuple[str, ...]] = {
    ReportType.WORKER_STARTED: ("host", "pid", "seconds"),
    ReportType.INIT: ("step", "mesh", "workers", "seconds"),
    ReportType.RESTORE: ("step", "mesh", "workers", "seconds", "tier"),
    ReportType.COMPILED: ("step", "seconds", "cache_hit"),
    ReportType.COMPILED_AHEAD: ("workers", "seconds"),
    ReportType.RESUMED: ("step", "seconds"),
    ReportType.RESUMED_WITH: ("step", "next_batch", "lr_scale"),
    ReportType.DATA_REFRESHED: ("step", "old", "new"),
    ReportType.METRICS: ("step", "step_time", "loss", "values"),
    ReportType.PROGRESS: ("step", "step_time", "tokens_per_s"),
    ReportType.EVALUATED: ("step", "metrics", "seconds"),
    ReportType.CHECKPOINT: ("step", "committed"),
    ReportType.LOCAL_CHECKPOINT: ("step", "round", "seconds"),
    ReportType.LOCAL_CHECKPOINT_SKIPPED: ("step", "host", "reason"),
    ReportType.LOCAL_TIER_OFF: ("reason",),
    ReportType.CORRUPT: ("step", "reason"),
    ReportType.GUARD: ("step", "reason"),
    ReportType.RESCALE_REQUESTED: ("step", "workers"),
    ReportType.PREEMPTED: ("step", "committed_at", "reason"),
    ReportType.CHAOS: ("action", "spec", "step"),
    ReportType.FINISHED: ("step",),
    ReportType.ERROR: ("error",),
}


# A report's fields: its type's own (``REQUIRED``) and every report's ``time``, ``attempt`` and ``process_id``;
# a JSON object whose keys depend on the type.
ReportFields = dict[str, Any]


class GuardFinding(TypedDict):
    """The in-training guard's finding: the step it rejected, by which metric, its value, why, and the batch after it."""

    step: int
    metric: str
    value: float
    reason: str
    next_batch: int


class GuardReport(TypedDict, total=False):
    """A ``guard`` report as its host's agent keeps it: the finding, where the round restored from, and the stamp."""

    step: int
    metric: str
    value: float
    reason: str
    next_batch: int
    restored_from: int | None  # the step the round restored (None: it started fresh)
    committed_since_restore: bool
    time: float
    attempt: int
    process_id: int


class CorruptReport(TypedDict, total=False):
    """A ``corrupt`` report: the checkpoint step that failed its checks or its restore, and why."""

    step: int
    reason: str
    time: float
    attempt: int
    process_id: int


class NoticeReport(TypedDict, total=False):
    """A ``preempted`` report: the step the group stopped at and committed for a preemption notice."""

    step: int
    noticed: bool  # this process was the one told
    notice_at: float | None  # when it was told
    committed_at: float
    stop_s: float
    reason: str
    time: float
    attempt: int
    process_id: int


def _check(kind: ReportType, fields: ReportFields) -> None:
    missing = [f for f in REQUIRED[kind] if f not in fields]
    if missing:
        raise ValueError(f"a {kind.value} report lacks {', '.join(missing)}")


@dataclass(frozen=True)
class WorkerReport:
    """One report: its type and its fields (``time``, ``attempt``: the round, ``process_id``: the rank, and the type's own)."""

    type: ReportType
    fields: ReportFields

    def line(self) -> str:
        return json.dumps({"type": self.type.value, **self.fields}, default=str) + "\n"


def report(type_: ReportType, round_: int, rank: int, **fields: Any) -> WorkerReport:
    """A report of this moment from the worker of ``rank`` in round ``round_`` (ValueError: it lacks its type's fields)."""
    kind = ReportType(type_)
    _check(kind, fields)
    return WorkerReport(kind, {"time": time.time(), "attempt": round_, "process_id": rank, **fields})


def decode(line: bytes | str) -> WorkerReport:
    """A report read back from its line; ValueError for a line that is not one (unreadable, of no known type, or
    lacking its type's fields)."""
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError(f"a report is a JSON object, not {type(msg).__name__}")
    kind = msg.pop("type", None)
    try:
        report_type = ReportType(kind)
    except ValueError:
        raise ValueError(f"no report type {kind!r}") from None
    _check(report_type, msg)
    return WorkerReport(report_type, msg)
