"""The small API the CLI, the backends and the Airflow plugin call: plan, begin a job, look, stop, the checkpoint lifecycle.

This is the Airflow side's door into the engine's runs: besides it, ``plugins/`` imports only the
backends (``training.backends``: a job's placement and its watch), the GKE settings (``training.gke``),
the shared pool's verbs (``training.service.commands``) and the priority names (an import-linter
contract in ``pyproject.toml`` forbids the rest).  So it stays cheap to import: no JAX, Orbax or grain
at module level.  The calls
that need them (validation, listing committed steps with Orbax's rule, dataset
preparation) import them when they run, which is inside a task's ``execute()``
or a CLI command.

A *job* is one incarnation of a run: :func:`begin_job` takes the run lock and
hands it to the job's host agents (``training.elastic``).  Launching, and the
checks before it, are :mod:`training.job_launch`'s; this API passes them on.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict, cast

from training.checkpoint import lifecycle
from training.checkpoint.ledger import CheckpointRecord, Ledger
from training.checkpoint.lifecycle import (
    LifecycleError,
    Promotion,
    RecoveryRow,
    Rollback,
    RunNotFound,
    RunReport,
    Verdict,
    WallSplit,
    find_recoveries,
    wall_split,
)
from training.checkpoint.prune import Pruned
from training.config import (
    RUN_NAME_PATTERN,
    Config,
    ConfigError,
    absolute,
    config_from_json,
    dotted,
    key_schema,
    load_config,
    note_flat_keys,
)
from training.data import DatasetError
from training.elastic.capacity import LocalCapacity
from training.elastic.rendezvous import Rendezvous
from training.elastic.status import repair_status as run_repair_status
from training.elastic.status import status as run_status
from training.event_text import describe, duration, mesh_text, readable
from training.events import (
    ALIVE_STATES,
    FINAL_STATES,
    Event,
    EventLog,
    EventReader,
    RunState,
    RunStatus,
    floor_key,
)
from training.faults import ACTIONS as CHAOS_ACTIONS
from training.faults import ChaosError, parse_chaos, spec_pattern
from training.gke.launch import GKESettings
from training.job_launch import (
    LAPSE_WAIT_MAX_S,
    Begun,
    LaunchError,
    LaunchRefused,
    begin_job,
    begin_or_follow,
    check_fit,
    check_task,
    plan,
    resolve_remat,
    stop_job,
)
from training.layout import AIRFLOW, CAPACITY, CONFIG
from training.mesh import PlanEnd, PlanError, PlanReport
from training.records import JSONObject
from training.storage import AlreadyExists, NotFound, open_store
from training.tasks import TaskError

if TYPE_CHECKING:
    from training.export import Exported

__all__ = [
    "TaskError",
    "check_task",
    "ALIVE_STATES",
    "LAPSE_WAIT_MAX_S",
    "CHAOS_ACTIONS",
    "FINAL_STATES",
    "RUN_NAME_PATTERN",
    "ChaosError",
    "Config",
    "ConfigError",
    "dotted",
    "key_schema",
    "note_flat_keys",
    "DatasetError",
    "absolute",
    "check_fit",
    "config_from_dict",
    "describe",
    "duration",
    "Event",
    "EventReader",
    "CheckpointRecord",
    "mesh_text",
    "readable",
    "load_config",
    "parse_chaos",
    "spec_pattern",
    "LaunchError",
    "LaunchRefused",
    "LifecycleError",
    "PlanError",
    "RunNotFound",
    "RunSpec",
    "DatasetSpec",
    "RunState",
    "begin_job",
    "committed_steps",
    "events",
    "export",
    "events_since",
    "floor_key",
    "job_state",
    "host_processes",
    "begin_or_follow",
    "Begun",
    "plan",
    "promote",
    "prune",
    "report",
    "rollback",
    "record_pods_waiting",
    "set_capacity",
    "status",
    "repair_status",
    "stop_job",
    "validate",
    "validate_pending",
    "Promotion",
    "Pruned",
    "Rollback",
    "Verdict",
    "JobLook",
    "HostProcesses",
    "PreparedDataset",
    "PlanEnd",
    "PlanReport",
    "RunReport",
    "WallSplit",
    "wall_split",
    "run_exists",
    "checkpoint_states",
    "prepare_dataset",
    "newest_event_key",
    "newest_validated",
    "dag_run_mark",
    "DagRunMark",
    "set_dag_run_mark",
    "format_report",
    "find_recoveries",
    "RecoveryRow",
    "load_run_config",
    "resolve_remat",
    "local_job_pids",
    "release_capacity",
    "RunStatus",
]


class DatasetSpec(TypedDict):
    """A DAG run's dataset: where its text comes from (at most ``max_bytes``), the prepared ``uri``, a refresh."""

    source: str
    max_bytes: int | None
    uri: str
    refresh: bool


class RunSpec(TypedDict, total=False):
    """A DAG run's resolved run: what the resolve task returns and every other task reads."""

    config: JSONObject  # Config.model_dump(mode="json"), paths absolute
    run_uri: str
    run_name: str
    backend: str
    dataset: DatasetSpec
    gke: GKESettings  # the backend's settings, from the conf's key of its name (GKE's; {} for the local slice)
    priority: str | None  # None: the run has its capacity to itself; a level: it joins the root's shared pool


def committed_steps(run_uri: str) -> list[int]:
    """Committed checkpoint steps (Orbax's rule; imports Orbax when called)."""
    from training.checkpoint.steps import committed_steps as steps

    return steps(run_uri)


def load_run_config(run_uri: str) -> Config:
    try:
        return config_from_json(open_store(run_uri).get(CONFIG).decode())
    except NotFound:
        raise RunNotFound(f"no run at {run_uri} (it has no {CONFIG})") from None


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """A Config from its JSON form (a RunSpec's ``config``), validated."""
    return Config.model_validate(dict(data))


def run_exists(run_uri: str) -> bool:
    return open_store(run_uri).exists(CONFIG)


# --- watching ----------------------------------------------------------------------------------------


def status(run_uri: str) -> RunStatus | None:
    """The run's status document as written; a read: nothing is written (see :func:`repair_status`)."""
    return run_status(run_uri)


def repair_status(run_uri: str) -> RunStatus | None:
    """The run's status, a job nobody leads any more first recorded failed (``training.elastic.status``).

    The watchers' look (a sensor, a trigger, the shared pool's scheduler, ``rtrain status``): without it a
    job whose every host and launcher died at once would say "running" forever.
    """
    return run_repair_status(run_uri)


class HostProcesses(TypedDict):
    """One host's processes, as its agent's heartbeat gives them: find them with ``ps -p`` on ``node``."""

    node: str  # the machine (pod) they run on
    state: str  # the agent's: idle, training, leaving, gone
    round: int  # the round of its current (or last) worker
    agent: int
    worker: int | None  # the round's worker, while one runs
    standby: int | None  # the standby warming up or waiting, while there is one


def host_processes(run_uri: str, job: str | None) -> dict[str, HostProcesses]:
    """Each host of ``job`` and its processes' pids (agent, worker, standby), from the rendezvous; a read."""
    if not job:
        return {}
    recs = Rendezvous(open_store(run_uri)).hosts(job)
    return {
        h: HostProcesses(
            node=r.node, state=r.state, round=r.round, agent=r.pid, worker=r.worker_pid, standby=r.standby_pid
        )
        for h, r in sorted(recs.items())
    }


class JobLook(TypedDict):
    """One look at a job: its state (pending, alive, finished, failed, stopped), why it ended, and the run's status."""

    state: str
    reason: str
    status: RunStatus
    waiting: NotRequired[str]  # why the job's pods wait (a backend that can tell)
    queue: NotRequired[dict[str, object]]  # the job's row in its shared pool's queue (a QueueRow, the pool's backend)
    retry: NotRequired[bool]  # False: a failure a relaunch cannot help (a setting to fix first)


def job_state(handle: Mapping[str, Any], start_timeout_s: float = 300.0) -> JobLook:
    """One look at a job: ``{"state", "reason", "status"}``; state is alive, finished, failed, stopped or cancelled.

    Whose job: the status carries the job id; until the job's agents write one,
    the job is ``pending`` (failed after ``start_timeout_s``).
    """
    st = repair_status(str(handle["run_uri"])) or {}
    if st.get("job") != handle.get("job"):
        if time.time() - float(handle.get("launched_at", time.time())) > start_timeout_s:
            return JobLook(state="failed", status=st, reason=f"job {handle.get('job')} did not start")
        return JobLook(state="pending", status=st, reason="")
    state = str(st.get("state") or "pending")
    ended = state not in ALIVE_STATES and state != "finished"  # failed, stopped, cancelled: say why
    return JobLook(state=state, status=st, reason=str(st.get("reason", "")) if ended else "")


def events(run_uri: str, types: tuple[str, ...] | None = None, after: str | None = None) -> list[Event]:
    return EventLog(open_store(run_uri)).read(types=types, after_key=after)


def events_since(run_uri: str, cursor: str | None, seen: Collection[str], start: str | None = None) -> list[Event]:
    """The run's events after ``cursor``, and those that landed late (stamped up to ``LATE_S`` before it), less ``seen``.

    For a follower that goes on from the newest event it saw: it keeps the names it saw since
    ``floor_key(cursor)`` in ``seen``.  Nothing at or before ``start`` (where the follower began: an
    earlier job's events) is returned.
    """
    log = EventLog(open_store(run_uri))
    after = max(floor_key(cursor) if cursor else "", start or "") or None
    return log.get([k for k in log.keys(after) if k not in seen])


def newest_event_key(run_uri: str) -> str | None:
    return EventLog(open_store(run_uri)).newest_key()


# --- capacity (the local slice) ------------------------------------------------------------------------


def set_capacity(run_uri: str, workers: int, reason: str = "manual", source: str = "cli") -> None:
    """The local slice's host count: fewer takes hosts away, more gives them back (agents join)."""
    if workers < 0:
        raise ValueError("capacity cannot be negative")
    store = open_store(run_uri)
    LocalCapacity(store, default=workers).set(workers, reason=reason)
    EventLog(store, source=source).emit("capacity", available=workers, reason=reason)


def local_job_pids(run_uri: str) -> list[int]:
    """Process ids of the run's host agents on this machine (from their heartbeats)."""
    node = socket.gethostname()
    return sorted(rec.pid for rec in Rendezvous(open_store(run_uri)).hosts().values() if rec.node == node)


def release_capacity(run_uri: str, reason: str = "released", source: str = "airflow") -> None:
    """The local slice's hosts given back: no capacity left for the run."""
    store = open_store(run_uri)
    store.delete(CAPACITY)
    EventLog(store, source=source).emit("capacity", available=0, reason=reason)


def record_pods_waiting(run_uri: str, reason: str, job: str | None = None) -> None:
    """Record why the job's pods wait (``""``: none does now) among the run's events, for its timeline."""
    EventLog(open_store(run_uri), source="airflow").emit("pods_waiting", reason=reason, job=job)


# --- the checkpoint lifecycle --------------------------------------------------------------------------


def validate(run_uri: str, step: int | None = None) -> Verdict:
    return lifecycle.validate(run_uri, step)


def validate_pending(run_uri: str) -> list[Verdict]:
    return lifecycle.validate_pending(run_uri)


def rollback(run_uri: str, to: int | None = None, reason: str = "manual rollback") -> Rollback:
    return lifecycle.rollback(run_uri, to, reason)


def promote(run_uri: str, step: int | None = None) -> Promotion:
    return lifecycle.promote(run_uri, step)


def export(run_uri: str, output: str, fmt: Literal["hf", "orbax"] = "hf", step: int | None = None) -> Exported:
    """Write a step (default: the newest validated) as a Hugging Face directory or a plain Orbax checkpoint."""
    from training.export import export as export_step

    return export_step(load_run_config(run_uri), absolute(output), fmt, step)


def prune(run_uri: str, dry_run: bool = False) -> Pruned:
    return lifecycle.prune(run_uri, dry_run)


def report(run_uri: str) -> RunReport:
    """The run's story from its events and ledger (reads no checkpoint)."""
    return lifecycle.report(run_uri)


def format_report(r: Mapping[str, Any]) -> str:
    return lifecycle.format_report(dict(r))


def checkpoint_states(run_uri: str) -> dict[int, CheckpointRecord]:
    """The ledger's current record of every step it knows."""
    return Ledger(open_store(run_uri)).states()


def newest_validated(run_uri: str) -> int | None:
    return Ledger(open_store(run_uri)).newest_validated()


# --- a DAG run's own marks -----------------------------------------------------------------------------
# What a DAG run's first launch did, so that a retry or a cleared task does not redo it
# (roll back again, refuse its own run as "existing").


def _mark_key(dag_run_id: str) -> str:
    import re

    return f"{AIRFLOW}{re.sub(r'[^A-Za-z0-9_.-]', '_', dag_run_id)[:200]}.json"


class DagRunMark(TypedDict):
    """A DAG run's first launch of a run: what it resumed from, and whether the run existed before it."""

    dag_run_id: str
    time: float
    resume_from: str
    existed: bool


def dag_run_mark(run_uri: str, dag_run_id: str) -> DagRunMark | None:
    try:
        return cast(DagRunMark, json.loads(open_store(run_uri).get(_mark_key(dag_run_id))))
    except NotFound:
        return None


def set_dag_run_mark(run_uri: str, dag_run_id: str, *, resume_from: str, existed: bool) -> None:
    """Mark ``dag_run_id``'s first launch of the run (once: a second mark of the same DAG run is ignored)."""
    mark = DagRunMark(dag_run_id=dag_run_id, time=time.time(), resume_from=resume_from, existed=existed)
    data = json.dumps(mark, sort_keys=True).encode()
    try:
        open_store(run_uri).create(_mark_key(dag_run_id), data)
    except AlreadyExists:
        pass


def prepare_dataset(
    source: str | None,
    output: str,
    seq_len: int,
    max_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
    refresh: bool = False,
    *,
    tokenizer: str = "bytes",
    vocab_size: int | None = None,
    fmt: str | None = None,
    field: str | None = None,
) -> PreparedDataset:
    """Prepare (idempotently) a token dataset (imports numpy, array_record and the tokenizer when called).

    ``tokenizer``: bytes, bpe (of ``vocab_size``) or a tokenizer file; ``fmt`` and
    ``field``: the input format (None: detected) and the field or column of the text.
    """
    from training import data

    manifest = data.prepare(
        source,
        output,
        seq_len,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        fmt=fmt,
        field=field,
        max_bytes=max_bytes,
        progress=progress,
        overwrite=refresh,
    )
    return PreparedDataset(
        dataset=output,
        fingerprint=manifest["fingerprint"],
        train_records=manifest["splits"]["train"]["records"],
        validation_records=manifest["splits"]["validation"]["records"],
        seq_len=manifest["seq_len"],
        vocab_size=manifest.get("vocab_size", 256),
        tokenizer=tok["kind"] if (tok := manifest.get("tokenizer")) else "bytes",
    )


class PreparedDataset(TypedDict):
    """A prepared token dataset: where, its fingerprint, its splits' sizes and its tokens."""

    dataset: str
    fingerprint: str
    train_records: int
    validation_records: int
    seq_len: int
    vocab_size: int
    tokenizer: str  # the tokenizer's kind: bytes, bpe, huggingface, sentencepiece
