"""The service's verbs: submit a run, list the queue (or one run of it), change a priority, cancel."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from training import api
from training.config import Config
from training.events import ALIVE_STATES, EventReader
from training.priorities import PRIORITIES, PriorityError, priority_value
from training.service import scheduler
from training.service.eta import (
    Eta,
    RunOutlook,
    forecast,
    resize_seconds,
    resume_seconds,
    start_seconds,
    starting_since,
    step_seconds_by_hosts,
)
from training.service.policy import allocate
from training.service.queue import Placement, Queue, QueueError, Submission

__all__ = [
    "ENDED",
    "PRIORITIES",
    "PriorityError",
    "QueueError",
    "QueueRow",
    "QueueView",
    "cancel",
    "ensure_pool",
    "look",
    "outlook",
    "priority_value",
    "set_priority",
    "submit",
    "view",
    "watch",
]

ENDED = ("finished", "failed", "stopped", "cancelled")  # the states of a run the queue is done with


@dataclass(frozen=True)
class QueueRow:
    """One run of the queue as ``rtrain queue`` shows it."""

    run: str
    priority: str
    state: str  # queued | starting | running | recovering | waiting_for_capacity | cancelling | finished | failed
    # | stopped (cancelled once its job ran; resumable) | cancelled (before any job of it ran)
    hosts: int  # training on now
    assigned: int  # what the scheduler gives it (or would, for a run not launched yet)
    min_hosts: int
    max_hosts: int
    step: int
    steps: int
    eta_s: float | None
    eta_notes: tuple[str, ...]
    reason: str
    job: str
    launched_at: float | None = None  # when the scheduler launched its job (None: not yet)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class QueueView:
    """The pool and every run submitted to it."""

    root: str
    pool: int
    rows: tuple[QueueRow, ...]


def ensure_pool(root: str, hosts: int) -> int:
    """The size of ``root``'s pool, set to ``hosts`` when it has none yet (two first callers agree on one)."""
    return Queue(root).pool_or_create(hosts)


def submit(cfg: Config, priority: str, pool_hosts: int | None = None) -> Submission:
    """Submit ``cfg``'s run at ``priority``; the scheduler launches it when its minimum fits."""
    priority_value(priority)
    q = Queue(cfg.root)
    if pool_hosts is not None:
        q.set_pool(pool_hosts)
    pool = ensure_pool(cfg.root, cfg.elastic.max_workers)
    if cfg.elastic.min_workers > pool:
        raise QueueError(f"min_workers={cfg.elastic.min_workers} never fits the pool of {pool} host(s) at {cfg.root}")
    api.plan(cfg)  # a config that cannot run is refused before anything is queued
    api.check_task(cfg)
    try:
        old = q.submission(cfg.run_name)
    except QueueError:
        old = None
    if old is not None and not q.placement(cfg.run_name).ended:
        raise QueueError(f"run {cfg.run_name!r} is already in the queue ({old.priority}); cancel it first")
    sub = Submission(
        run_name=cfg.run_name,
        run_uri=cfg.run_uri,
        priority=priority,
        min_hosts=cfg.elastic.min_workers,
        max_hosts=cfg.elastic.max_workers,
        hosts_per_slice=cfg.placement.hosts_per_slice,
        steps=cfg.optimizer.steps,
        config=cfg.to_json(),
        submitted_at=time.time(),
    )
    q.put_placement(Placement(run_name=cfg.run_name))  # a fresh placement: a resubmission starts over
    q.put_submission(sub)
    scheduler.ensure_running(cfg.root)
    return sub


def _open(root: str, run: str) -> tuple[Queue, Submission, Placement]:
    q = Queue(root)
    sub = q.submission(run)
    p = q.placement(run)
    if p.ended:
        raise QueueError(f"run {run!r} already ended ({p.ended}): nothing to change")
    return q, sub, p


def set_priority(root: str, run: str, priority: str) -> Submission:
    """Change a queued or running run's priority; the scheduler moves hosts at its next look."""
    priority_value(priority)
    q, sub, _p = _open(root, run)
    if sub.cancelled:
        raise QueueError(f"run {run!r} is being cancelled: nothing to change")
    sub.priority = priority
    sub.priority_changed_at = time.time()
    q.put_submission(sub)
    scheduler.ensure_running(root)
    return sub


def cancel(root: str, run: str, reason: str = "cancelled") -> Submission:
    """Cancel a run: a queued one never starts (``cancelled``), a running one stops (``stopped``; resumable by a new
    submit)."""
    q, sub, _p = _open(root, run)
    sub.cancelled = reason or "cancelled"
    q.put_submission(sub)
    scheduler.ensure_running(root)
    return sub


def view(root: str, events: EventReader | None = None) -> QueueView:
    """Every submitted run: state, hosts, step and its ETA under the scheduler's policy.

    ``events``: a reader kept from earlier looks (only new events are read); a fresh one by default.
    """
    events = events or EventReader()
    q = Queue(root)
    pool = q.pool() or 0
    subs = q.submissions()
    places = {s.run_name: q.placement(s.run_name) for s in subs}
    statuses = {s.run_name: api.status(s.run_uri) or {} for s in subs}
    waiting = [s for s in subs if not places[s.run_name].ended and not s.cancelled]
    planned = allocate(pool, [s.demand() for s in waiting])
    outlooks = []
    for s in waiting:
        evs = events.read(s.run_uri)
        st = statuses[s.run_name]
        step = int(st.get("step") or 0) if st.get("job") == places[s.run_name].job else 0
        begun = starting_since(evs)
        outlooks.append(
            RunOutlook(
                demand=s.demand(),
                steps_left=max(s.steps - step, 0),
                hosts=places[s.run_name].hosts,
                step_s=step_seconds_by_hosts(evs),
                resize_s=resize_seconds(evs),
                start_s=start_seconds(evs),
                resume_s=resume_seconds(evs),
                starting_for=time.time() - begun if begun is not None else None,
            )
        )
    etas = forecast(pool, outlooks)
    rows = tuple(_row(s, places[s.run_name], statuses[s.run_name], planned, etas.get(s.run_name)) for s in subs)
    return QueueView(root=root, pool=pool, rows=rows)


def outlook(root: str, run: str, events: EventReader | None = None) -> QueueRow | None:
    """``run``'s row of the whole queue, with its ETA (the forecast reads every waiting run's events)."""
    return next((r for r in view(root, events).rows if r.run == run), None)


def look(root: str, run: str) -> QueueRow:
    """One submitted run as the queue shows it, cheaply: no ETA, and no hosts planned for a run not launched yet.

    QueueError if ``run`` was never submitted to ``root``.
    """
    q = Queue(root)
    sub = q.submission(run)
    return _row(sub, q.placement(run), api.status(sub.run_uri) or {}, {}, None)


def watch(root: str, run: str) -> QueueRow:
    """``look``, and start a scheduler for ``root`` if the run still needs one and none is alive (one was killed)."""
    row = look(root, run)
    if row.state not in ENDED:
        scheduler.ensure_running(root)
    return row


def _row(s: Submission, p: Placement, st: Mapping[str, Any], planned: dict[str, int], eta: Eta | None) -> QueueRow:
    mine = bool(p.job) and st.get("job") == p.job
    return QueueRow(
        run=s.run_name,
        priority=s.priority,
        state=_state(s, p, st if mine else {}),
        hosts=int(st.get("workers") or 0) if mine and st.get("state") in ALIVE_STATES else 0,
        assigned=p.hosts if p.job else planned.get(s.run_name, 0),
        min_hosts=s.min_hosts,
        max_hosts=s.max_hosts,
        step=int(st.get("step") or 0) if mine else 0,
        steps=s.steps,
        eta_s=eta.seconds if eta is not None else None,
        eta_notes=eta.assumptions if eta is not None else (),
        reason=p.reason or (str(st.get("reason") or "") if mine else ""),
        job=p.job,
        launched_at=p.history[0][0] if p.job and p.history else None,
    )


def _state(s: Submission, p: Placement, st: Mapping[str, Any]) -> str:
    if p.ended:
        return p.ended
    if s.cancelled:
        return "cancelling"
    if not p.job or p.hosts == 0:
        return "queued"
    return str(st.get("state") or "starting")
