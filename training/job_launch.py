"""Beginning a job of a run: the checks that refuse a config first, then the run lock, the config, the handoff.

A *job* is one incarnation of a run: :func:`begin_job` takes the run lock,
writes the config (only then: a refused launch writes nothing), and hands the
lock to the job's host agents, which take it from there (``training.elastic``).
:func:`stop_job` asks it to stop.  ``training.api`` is the door to these.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from typing import TypedDict

from training.checkpoint.lock import LockHeld, LockRecord, RunLock
from training.checkpoint.steps import committed_steps
from training.config import Config, config_from_json
from training.elastic.capacity import LocalCapacity
from training.elastic.rendezvous import Rendezvous
from training.elastic.status import STALE_STATUS_S
from training.events import EventLog, RunState, read_status, write_status
from training.layout import CONFIG, CONFIG_HISTORY, CONTROL, RDV_EVENT_RESERVE, RDV_RESERVE, STOP
from training.mesh import MemoryEstimate, MeshPlan, PlanReport, plan_report
from training.mesh import check_fit as _check_fit
from training.placement_traits import traits
from training.records import stamp
from training.storage import NotFound, Store, open_store, scheme

RESERVE_BYTES = 1 << 20
EVENT_RESERVE_BYTES = 1 << 16  # a full disk's final event, written in these blocks (no space to race for)
# How long a job's agents have to claim the run lock from its launcher.


class LaunchError(RuntimeError):
    """The job cannot be launched as asked (the message says why and what to do)."""


class LaunchRefused(LaunchError):
    """Another job holds the run (the message names the holder); nothing was written."""

    def __init__(self, message: str, holder: LockRecord | None = None) -> None:
        super().__init__(message)
        self.holder = holder


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
    me = f"{os.environ.get('USER', 'someone')}@{socket.gethostname()} pid {os.getpid()}"
    who = f"{by}, {me}" if by else me
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
        if traits(backend).hosts_here and provision:
            LocalCapacity(store, default=cfg.elastic.max_workers).set(
                cfg.elastic.max_workers, reason=f"job {job} launched"
            )
        write_status(store, state=RunState.PENDING.value, job=job, run_uri=cfg.run_uri, steps_total=cfg.optimizer.steps)
        lock.handoff(job, traits(backend).handoff_s)
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
