"""A backend added beside the engine in one module: the local slice's hosts, each verb written to a journal.

It is what another package ships to add a backend: this module, and an entry point in the ``rtrain.backends``
group naming it (``rtrain_journaled-1.0.dist-info``, as an install writes it).  A run's config names it by
``placement.backend: journaled``; the journal is ``journal.jsonl`` beside the run (a local root).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from training.api import Config, JobLook
from training.backends import (
    ALIVE,
    BackendError,
    Context,
    JobSpec,
    LocalSliceBackend,
    PoolSpec,
    Preparation,
    Provisioned,
    Released,
    add,
)
from training.backends.base import JobHandle, Timeouts
from training.placement_traits import Traits

NAME = "journaled"
MAX_HOSTS = 4  # what its capacity holds: a run asking for more is refused before anything starts


@dataclass(frozen=True)
class JournaledSpec:
    """Where a journaled run's hosts are: the local slice's (the placement's settings take no keys)."""

    kind: Literal["journaled"] = "journaled"


class JournaledBackend:
    """The local slice's five verbs, each written to the run's journal before it is done."""

    name = NAME

    def __init__(self, ctx: Context) -> None:
        self.local = LocalSliceBackend(ctx.log, ctx.by, provision=ctx.foreground, follow=not ctx.foreground)
        self.by = ctx.by

    def provision(self, job: JobSpec) -> Provisioned:
        journal(job.config.run_uri, "provision", self.by)
        return {**self.local.provision(job), "backend": NAME}

    def launch(self, job: JobSpec, attempt: int) -> JobHandle:
        journal(job.config.run_uri, "launch", self.by, attempt=attempt)
        return {**self.local.launch(job, attempt), "backend": NAME}  # type: ignore[typeddict-item]

    def poll(self, handle: Mapping[str, Any], timeouts: Timeouts, now: float | None = None) -> JobLook:
        look = self.local.poll(handle, timeouts, now)
        if look["state"] not in ALIVE:  # its end, once
            journal(handle["run_uri"], "poll", self.by, state=look["state"])
        return look

    def stop(self, handle: Mapping[str, Any], reason: str) -> None:
        journal(handle["run_uri"], "stop", self.by, reason=reason)
        self.local.stop(handle, reason)

    def release(self, job: JobSpec, handles: Sequence[Mapping[str, Any]]) -> Released:
        journal(job.config.run_uri, "release", self.by)
        return {**self.local.release(job, handles), "backend": NAME}


def journal(run_uri: str, verb: str, by: str, **more: Any) -> None:
    """One line of the run's journal: the verb, who asked, when."""
    path = Path(run_uri) / "journal.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"verb": verb, "by": by, "time": time.time(), **more}) + "\n")


def read_journal(run_uri: str) -> list[dict[str, Any]]:
    """The journal's lines, oldest first (none before the first verb)."""
    path = Path(run_uri) / "journal.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _fit(cfg: Config, settings: Mapping[str, Any], priority: str | None, given: Set[str]) -> Config:
    """Refuse a run its capacity cannot hold."""
    if cfg.elastic.max_workers > MAX_HOSTS:
        raise BackendError(f"max_workers: the journaled backend holds at most {MAX_HOSTS} hosts")
    return cfg


add(
    NAME,
    Traits(hosts_here=True, round_tpu_env=False, handoff_s=120.0),
    # at a priority the run joins its root's shared pool, whose scheduler launches it through this backend
    lambda settings, priority: PoolSpec(priority) if priority else JournaledSpec(),
    lambda where, ctx: JournaledBackend(ctx),
    Preparation(fit=_fit),
)
