"""A worker's reports to its agent: a closed set of types, each one JSON line on the worker's pipe."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


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


@dataclass(frozen=True)
class WorkerReport:
    """One report: its type and its fields (``time``, ``attempt``: the round, ``process_id``: the rank, and the type's own)."""

    type: ReportType
    fields: dict[str, Any]

    def line(self) -> str:
        return json.dumps({"type": self.type.value, **self.fields}, default=str) + "\n"


def report(type_: ReportType, round_: int, rank: int, **fields: Any) -> WorkerReport:
    """A report of this moment from the worker of ``rank`` in round ``round_``."""
    return WorkerReport(ReportType(type_), {"time": time.time(), "attempt": round_, "process_id": rank, **fields})


def decode(line: bytes | str) -> WorkerReport:
    """A report read back from its line; ValueError for a line that is not one (unreadable, or of no known type)."""
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError(f"a report is a JSON object, not {type(msg).__name__}")
    kind = msg.pop("type", None)
    try:
        return WorkerReport(ReportType(kind), msg)
    except ValueError:
        raise ValueError(f"no report type {kind!r}") from None
