"""The small API the CLI, the backends and the Airflow plugin call: plan, begin a job, look, stop, the checkpoint lifecycle.

This is the one door into ``training`` for the Airflow side (``plugins/`` imports
nothing else of ours but the shared pool's verbs, ``training.service.commands``),
so it stays cheap to import: no JAX, Orbax or grain at module level.  The calls
that need them (validation, listing committed steps with Orbax's rule, dataset
preparation) import them when they run, which is inside a task's ``execute()``
or a CLI command.

A *job* is one incarnation of a run: :func:`begin_job` takes the run lock,
writes the config (only then: a refused launch writes nothing), and hands the
lock to the job's host agents, which take it from there (``training.elastic``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
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
from training.checkpoint.lock import LockHeld, LockRecord, RunLock
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
from training.elastic.status import STALE_STATUS_S
from training.elastic.status import repair_status as run_repair_status
from training.elastic.status import status as run_status
from training.events import (
    ALIVE_STATES,
    FINAL_STATES,
    Event,
    EventLog,
    EventReader,
    RunState,
    RunStatus,
    describe,
    duration,
    floor_key,
    mesh_text,
    read_status,
    readable,
    write_status,
)
from training.faults import ACTIONS as CHAOS_ACTIONS
from training.faults import ChaosError, parse_chaos, spec_pattern
from training.gke.launch import GKESettings
from training.layout import AIRFLOW, CAPACITY, CONFIG, CONFIG_HISTORY, CONTROL, RDV_EVENT_RESERVE, RDV_RESERVE, STOP
from training.mesh import MemoryEstimate, MeshPlan, PlanEnd, PlanError, PlanReport, plan_report
from training.mesh import check_fit as _check_fit
from training.records import JSONObject, stamp
from training.storage import AlreadyExists, NotFound, Store, open_store, scheme
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

RESERVE_BYTES = 1 << 20
EVENT_RESERVE_BYTES = 1 << 16  # a full disk's final event, written in these blocks (no space to race for)
# How long a job's agents have to claim the run lock from its launcher.
HANDOFF_S = {"local": 120.0, "gke": 900.0}  # GKE: pods must be scheduled and pull their image first


class LaunchError(RuntimeError):
    """The job cannot be launched as asked (the message says why and what to do)."""


class LaunchRefused(LaunchError):
    """Another job holds the run (the message names the holder); nothing was written."""

    def __init__(self, message: str, holder: LockRecord | None = None) -> None:
        super().__init__(message)
        self.holder = holder


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
    gke: GKESettings
    priority: str | None  # None: the run has its capacity to itself; a level: it joins the root's shared pool


def new_job_id() -> str:
    return time.strftime("j%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def plan(cfg: Config, compiled: bool = False) -> PlanReport:
    """Mesh plans and the memory-fit check; raises PlanError with the numbers.

    ``compiled``: also measure the compiled step's per-device memory (seconds to a
    minute, in a child process); a task other than the built-in one is always measured.
    With ``remat: auto`` and ``compiled``, the report's ``remat`` is the policy chosen
    (:mod:`training.rematfit`) and its memory the chosen step's.
    """
    from training.memfit import compiled_memory
    from training.rematfit import choose_remat

    return plan_report(cfg, compiled, compiled_memory, choose_remat)


def check_fit(cfg: Config, compiled: bool = False) -> tuple[MeshPlan, MemoryEstimate | None]:
    """Refuse a config that cannot run at its minimum topology; see :func:`plan` for ``compiled``."""
    from training.memfit import compiled_memory
    from training.rematfit import choose_remat

    return _check_fit(cfg, compiled, compiled_memory, choose_remat)


def resolve_remat(cfg: Config, on_line: Callable[[str], None] | None = None) -> Config:
    """The config with ``remat: auto`` replaced by the policy the compiled steps choose (``on_line`` told why);
    any other config as it is.  Raises PlanError when no policy fits."""
    from training.mesh import remat_auto

    if not remat_auto(cfg):
        return cfg
    choice = plan(cfg, compiled=True)["remat"]
    if on_line is not None:
        on_line(str(choice["reason"]))
    return cfg.model_copy(update={"model.remat": choice["policy"]})


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


# --- launching ---------------------------------------------------------------------------------------

FIXED_KEYS = (
    "task",
    "seq_len",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "vocab_size",
    "param_dtype",
    "global_batch",
    "dataset",
)


def _check_dataset(cfg: Config) -> None:
    from training import data as data_lib

    try:
        data_lib.load_manifest(cfg.data.dataset)
    except Exception as e:  # noqa: BLE001 - any failure to read it means the same thing
        raise LaunchError(
            f"dataset {cfg.data.dataset} is not prepared ({e}); prepare it with: "
            f"rtrain prepare --output {cfg.data.dataset} --seq-len {cfg.model.seq_len}"
            + (
                ""
                if cfg.data.tokenizer == "bytes"
                else f" --tokenizer {cfg.data.tokenizer} --vocab-size {cfg.model.vocab_size}"
            )
        ) from None


def check_task(cfg: Config, data: bool = True) -> None:
    """Build the config's task and open its data, as every worker will (imports JAX); TaskError naming it.

    ``data=False`` builds the task alone (a token dataset that is prepared later).
    """
    from training.tasks import TaskError, load_task
    from training.tasks.lm import TokenTask

    if data and cfg.prepared_tokens:
        _check_dataset(cfg)  # with the command that prepares it
    task = load_task(cfg)
    if not data:
        return
    try:
        if isinstance(task, TokenTask):
            task.check_manifest()  # its shards are checked by every worker as it opens them
        else:
            task.data()
    except TaskError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's data source may raise anything: name it in one line
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TaskError(f"task {cfg.task!r}: its data cannot be opened: {type(e).__name__}: {text}") from e


def _write_config(cfg: Config, store: Store, job: str, by: str) -> list[str]:
    """config.json for this job (under the run lock), and a history record of who changed what."""
    try:
        old: Config | None = config_from_json(store.get(CONFIG).decode())
    except NotFound:
        old = None
    if old is not None and cfg.checkpoint.resume_from == "none":
        raise LaunchError(
            f"run {cfg.run_name!r} already exists at {cfg.run_uri} and resume_from=none; "
            "pick another run_name or resume_from=latest"
        )
    changed: list[str] = []
    if old is not None:
        fixed = tuple(k for k in FIXED_KEYS if not (k == "dataset" and cfg.data.on_dataset_change == "restart"))
        bad = [k for k in fixed if getattr(old, k) != getattr(cfg, k)]
        if bad:
            raise LaunchError(
                f"run {cfg.run_name!r} exists with different {', '.join(bad)}; "
                "these cannot change on resume (start a new run_name)"
            )
        before = old.flat()
        changed = [k for k, v in cfg.flat().items() if before.get(k) != v]  # section.key
    data = cfg.to_json().encode()
    store.put(CONFIG, data)
    record = {"by": by, "job": job, "time": time.time(), "changed": changed, "config": cfg.model_dump(mode="json")}
    store.create(f"{CONFIG_HISTORY}{stamp():020d}.json", json.dumps(record, sort_keys=True).encode())
    EventLog(store, source="launcher").emit("config", by=by, job=job, changed=changed)
    return changed


def begin_job(
    cfg: Config,
    *,
    backend: str = "local",
    by: str | None = None,
    provision: bool = False,
    on_line: Callable[[str], None] | None = None,
) -> str:
    """Take the run for a new job: lock, config, a fresh rendezvous, then hand the lock to the job.

    ``provision`` (the local slice, ``rtrain train``): give the slice its ``max_workers`` hosts.
    Otherwise the pool is what it is (Airflow's provision task sets it; chaos and
    ``rtrain capacity`` change it), as a node pool is on GKE.

    A lease that is not refreshed any more (every agent of the last job was killed) is
    waited out, saying so through ``on_line``, and taken over when it lapses.

    Raises LaunchRefused (nothing written) when another job holds the run, and
    LaunchError (nothing written) when the config cannot resume this run.
    """
    plan(cfg)  # a config that cannot run is refused before anything is written
    check_task(cfg)  # a task that cannot be built, or data it cannot open: refused the same way
    # remat: auto becomes the policy the compiled steps choose, in the config the job's workers read
    cfg = resolve_remat(cfg, on_line or (lambda line: print(line, file=sys.stderr, flush=True)))
    store = open_store(cfg.run_uri)
    job = new_job_id()
    who = by or f"{os.environ.get('USER', 'someone')}@{socket.gethostname()} pid {os.getpid()}"
    lock = RunLock(store, owner=f"launcher of job {job} ({who})", lease_s=60.0)
    _take_run_lock(lock, on_line)
    try:
        if cfg.checkpoint.resume_from.isdigit() and int(cfg.checkpoint.resume_from) not in (
            steps := committed_steps(cfg.run_uri)
        ):
            raise LaunchError(
                f"resume_from={cfg.checkpoint.resume_from}: not a committed checkpoint of {cfg.run_uri} (committed: {steps})"
            )
        _write_config(cfg, store, job, who)
        Rendezvous(store).clear()
        if scheme(cfg.run_uri).filesystem:
            # Space held back on a local disk: if it fills up, the leader frees this to record the end.
            store.put(RDV_RESERVE, bytes(RESERVE_BYTES))
            store.put(RDV_EVENT_RESERVE, bytes(EVENT_RESERVE_BYTES))
        store.delete(CONTROL)
        store.delete(STOP)
        if backend == "local" and provision:
            LocalCapacity(store, default=cfg.elastic.max_workers).set(
                cfg.elastic.max_workers, reason=f"job {job} launched"
            )
        write_status(store, state=RunState.PENDING.value, job=job, run_uri=cfg.run_uri, steps_total=cfg.optimizer.steps)
        lock.handoff(job, HANDOFF_S.get(backend, 120.0))
    except BaseException:
        lock.release()
        raise
    return job


# A lease with more than this left is not waited out (a job's launch handed it over moments ago).
LAPSE_WAIT_MAX_S = 60.0


def _take_run_lock(lock: RunLock, on_line: Callable[[str], None] | None) -> None:
    """Acquire the run lock, waiting out a lease that is lapsing; LaunchRefused for a holder that refreshes.

    A live holder writes a new generation every ``lease_s / 4``; one whose generation stays
    put while its lease runs out is gone (its agents were killed): wait for the lease and the
    takeover margin to pass, then take it over.  Another owner that appears meanwhile (a status
    check repairing the run) is waited out the same way, within ``LAPSE_WAIT_MAX_S`` in all.
    """
    say = on_line or (lambda line: print(line, file=sys.stderr, flush=True))
    start = time.time()
    said: set[int] = set()
    while True:
        try:
            lock.acquire()
            if said:
                say(f"the lease lapsed after {time.time() - start:.1f}s: run {lock.store.uri} taken over")
            return
        except LockHeld as e:
            held = e
        rec = held.holder
        now = time.time()
        if rec is None:
            raise LaunchRefused(f"refused: {held}") from None
        left = lock.lapses_in(rec, now)
        if left > LAPSE_WAIT_MAX_S or now - start + left > LAPSE_WAIT_MAX_S + lock.margin_s:
            raise LaunchRefused(f"refused: {held}", rec) from None
        gen = int(rec.get("gen") or 0)
        if gen not in said:
            said.add(gen)
            say(
                f"run {lock.store.uri} is held by {rec['owner']!r} (host {rec.get('host')}, pid {rec.get('pid')}), "
                f"its lease lapsing in {left:.1f}s: waiting for it to lapse, then taking the run over "
                "(refused if the holder refreshes it)"
            )
        cur = lock.wait_lapse(rec, poll_s=min(0.2, max(lock.margin_s / 2, 0.05)))
        if cur is not None and cur.get("token") == rec.get("token") and cur["action"] != "release":
            raise LaunchRefused(f"refused: {lock.message(cur)}", cur) from None  # it refreshes: alive
        # Lapsed, released, or another owner: look again.


class Begun(TypedDict):
    """A job of the run begun here (``attached`` False), or the live job that holds the run, to follow."""

    job: str
    attached: bool
    events_after: str | None  # the run's newest event before it: a watch tells only those after


def begin_or_follow(
    cfg: Config,
    *,
    allow_attach: bool = False,
    provision: bool = False,
    backend: str = "local",
    by: str | None = None,
    on_line: Callable[[str], None] | None = None,
) -> Begun:
    """Take the run for a new job (:func:`begin_job`); never starts over, never overwrites.

    ``allow_attach``: when a live job holds the run, name it instead of refusing (an Airflow retry
    re-attaches to the job its first try started); a holder whose job is gone and whose lease lapsed
    is taken over.  Where the job's hosts run is the backend's (``training.backends``).
    """
    store = open_store(cfg.run_uri)
    after = EventLog(store).newest_key()
    try:
        job = begin_job(cfg, backend=backend, provision=provision, by=by, on_line=on_line)
    except LaunchRefused as e:
        holder = e.holder or LockRecord()
        if allow_attach and holder.get("job") and not _job_alive(store, str(holder["job"])) and _lease_lapses(store):
            # The holder's job is gone and its lease lapsed (a retry right after the job died).
            return begin_or_follow(
                cfg, allow_attach=allow_attach, provision=provision, backend=backend, by=by, on_line=on_line
            )
        if allow_attach and holder.get("job"):
            return Begun(job=str(holder["job"]), attached=True, events_after=after)
        raise
    return Begun(job=job, attached=False, events_after=after)


def _job_alive(store: Store, job: str) -> bool:
    """Has ``job`` shown life lately (its status written, or its launch just handed the lock over)?"""
    st = read_status(store) or {}
    return st.get("job") == job and time.time() - float(st.get("updated_at", 0)) < STALE_STATUS_S


def _lease_lapses(store: Store) -> bool:
    """Wait for the run lock's lease to lapse, by this machine's clock too; False when its holder renews
    it (alive, whatever the status's age says on this clock) or another holder's lasts beyond 30 s more."""
    lock = RunLock(store, owner="launcher", lease_s=60.0)
    _gen, rec = lock.newest()
    deadline = time.monotonic() + (lock.lapses_in(rec) if rec is not None else 0.0) + 30.0
    while rec is not None:
        if lock.lapses_in(rec) > deadline - time.monotonic():
            return False
        newer = lock.wait_lapse(rec, poll_s=0.5)
        if newer is None:
            return True
        if newer.get("token") == rec.get("token") and newer["action"] != "release":
            return False  # renewed
        rec = newer  # released, or another owner: wait that one out too
    return True


def stop_job(run_uri: str, reason: str = "asked to stop") -> None:
    """Ask the run's job to stop: its leader ends it as ``stopped`` with ``reason``; a later launch resumes it."""
    open_store(run_uri).put(STOP, json.dumps({"action": "stop_job", "reason": reason}).encode())


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
