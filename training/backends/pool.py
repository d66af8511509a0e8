"""The shared-pool backend: a run submitted at a priority, placed and moved by its root's scheduler."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from training import api
from training.api import JobLook
from training.backends.base import BackendError, Log, PoolHandle, Provisioned, Released, Timeouts
from training.backends.local import LocalSliceBackend
from training.backends.spec import JobSpec
from training.service import commands


class SharedPoolBackend:
    """The local slice shared by runs: the job is submitted at a priority, and the root's scheduler places it.

    The scheduler (``rtrain queue`` shows it) gives the pool's hosts to runs by priority: this run may
    wait queued, shrink when a higher one arrives (after a preemption notice: no step lost) and grow
    back. Its job is launched by the scheduler, so a handle names the submission, and the job once
    placed: a queued run is alive (``queued``), not pending.
    """

    name = "local"

    def __init__(self, priority: str, log: Log | None = None, by: str = "Airflow") -> None:
        try:
            commands.priority_value(priority)
        except commands.PriorityError as e:
            raise BackendError(f"priority: {e}") from None
        self.priority = priority
        self.log = log
        self.by = by

    def _say(self, msg: str, *args: Any) -> None:
        if self.log is not None:
            self.log.info(msg, *args)

    def provision(self, job: JobSpec) -> Provisioned:
        """The pool is the root's: made as large as this run's ``max_workers`` when it has no size yet."""
        cfg = job.config
        pool = commands.ensure_pool(cfg.root, cfg.elastic.max_workers)
        if cfg.elastic.min_workers > pool:
            raise BackendError(
                f"min_workers={cfg.elastic.min_workers} never fits the pool of {pool} host(s) at {cfg.root} "
                "(rtrain submit --pool-hosts N resizes it)"
            )
        return {"backend": self.name, "pool": pool, "priority": self.priority, "run_uri": cfg.run_uri}

    def launch(self, job: JobSpec, attempt: int) -> PoolHandle:
        """Submit the run (or follow its live submission): the scheduler launches it when its minimum fits."""
        cfg = job.config
        handle = PoolHandle(
            backend=self.name,
            run_uri=cfg.run_uri,
            job="",
            attached=False,
            root=cfg.root,
            run_name=cfg.run_name,
            priority=self.priority,
            launched_at=time.time(),
            events_after=api.newest_event_key(cfg.run_uri) if api.run_exists(cfg.run_uri) else None,
        )
        try:
            row = commands.look(cfg.root, cfg.run_name)
        except commands.QueueError:
            row = None
        if row is not None and row.state not in commands.ENDED:
            self._say("Following %s in the queue of %s (%s, %s)", cfg.run_name, cfg.root, row.priority, row.state)
            return {**handle, "attached": True, "priority": row.priority, "job": row.job}
        sub = commands.submit(cfg, self.priority)
        self._say("Submitted %s to the queue of %s at priority %s", cfg.run_name, cfg.root, sub.priority)
        return handle

    def poll(self, handle: Mapping[str, Any], timeouts: Timeouts, now: float | None = None) -> JobLook:
        """One look: state, reason, status and the queue's row; ``queued`` while the run holds no host.

        A run still in the queue whose scheduler is gone (killed) gets a new one.
        """
        row = commands.watch(str(handle["root"]), str(handle["run_name"]))
        queue = row.to_dict()
        if row.job and row.state not in ("queued", "cancelling", *commands.ENDED):
            launched = {**handle, "job": row.job, "launched_at": row.launched_at or handle.get("launched_at")}
            return {**LocalSliceBackend(self.log).poll(launched, timeouts, now), "queue": queue}
        status = api.repair_status(str(handle["run_uri"])) or {}
        if row.state == "finished":
            return {"state": "finished", "reason": "", "status": status, "queue": queue}
        if row.state in ("stopped", "cancelled"):  # a person's stop or cancel: not a failure
            return {"state": row.state, "reason": row.reason or row.state, "status": status, "queue": queue}
        if row.state in commands.ENDED:
            why = f"{row.state} in the queue: {row.reason or 'no reason recorded'}"
            return {"state": "failed", "reason": why, "status": status, "queue": queue}
        return {"state": "queued", "reason": row.reason, "status": status, "queue": queue}

    def stop(self, handle: Mapping[str, Any], reason: str) -> None:
        """Cancel the submission: a placed job stops at a step boundary (resumable), a queued one never starts."""
        commands.cancel(str(handle["root"]), str(handle["run_name"]), reason)

    def release(self, job: JobSpec, handles: Sequence[Mapping[str, Any]]) -> Released:
        """Cancel the run if it is still in the queue (its job stops at a step boundary); the pool stays."""
        cfg = job.config
        try:
            row = commands.look(cfg.root, cfg.run_name)
        except commands.QueueError:
            return {"backend": self.name, "cancelled": False}
        if row.state in commands.ENDED:
            return {"backend": self.name, "cancelled": False, "ended": row.state}
        try:
            commands.cancel(cfg.root, cfg.run_name, f"cancelled by the {self.by} teardown")
        except commands.QueueError as e:  # it ended meanwhile
            return {"backend": self.name, "cancelled": False, "ended": str(e)}
        deadline = time.time() + 3 * cfg.elastic.lease_s + 30
        while time.time() < deadline and commands.look(cfg.root, cfg.run_name).state not in commands.ENDED:
            time.sleep(0.5)
        ended = commands.look(cfg.root, cfg.run_name).state
        self._say("Cancelled %s in the queue of %s: %s", cfg.run_name, cfg.root, ended)
        return {"backend": self.name, "cancelled": True, "ended": ended}
