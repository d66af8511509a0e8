"""The deferrable wait on a training job: its status document and its typed events.

The job recovers from lost hosts by itself; this trigger only decides when it is over for Airflow:
``finished``, ``failed`` (the agent gave up, the job is gone, or nothing was heard for
``stale_after_s``), or ``stopped`` (a person stopped the job, or cancelled the run before it ran).
A run of a shared pool that holds no host is alive (``queued``).  Meanwhile it tells the task log
each event of note (``RELAYED``), one sentence each, and every
``progress_every_s`` a progress line::

    step 120/300 (40%), loss 2.3141, 5400 tok/s, ETA 3m12s, 4 workers, mesh data4 x fsdp2

(the ETA from the last minute's pace, or a shared pool's queue forecast; a queued run's line says
why it waits).  It measures each recovery as Airflow sees it: from the failure (the fault, when
chaos recorded one) to the next ``resumed`` event.  Blocking reads run in a thread.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Generator, Mapping
from datetime import UTC, datetime
from typing import Any, NotRequired, Protocol, TypedDict, cast

from airflow.triggers.base import BaseTrigger, TriggerEvent

from training.api import Config, Event, EventReader, RecoveryRow, RunStatus, describe, duration, find_recoveries
from training.backends import Backend
from training.backends.base import JobHandle, Timeouts
from training.backends.watch import BY_REQUEST, Look, Outcome, Unreadable, WatchItem, timeouts, watch
from training.service import commands
from training.service.commands import QueueRow

CLASSPATH = "rtrain_airflow.triggers.training.RTrainTrainingJobTrigger"
RELAYED = (
    "launch",
    "init",
    "restore",
    "resumed_with",
    "data_refreshed",
    "compiled",
    "resumed",
    "recovered",
    "checkpoint",
    "checkpoint_corrupt",
    "failure",
    "resize",
    "waiting_for_capacity",
    "capacity",
    "chaos",
    "rollback",
    "guard",
    "rescale_requested",
    "preemption_notice",
    "local_checkpoint_skipped",
    "local_tier_off",
    "finished",
    "failed",
    "stopped",
    "cancelled",
    "leader",
    "host_joined",
    "host_lost",
)
STOPPED = BY_REQUEST  # the ends a person asked for (rtrain stop or cancel, the Training view, a teardown)
PROGRESS_EVERY_S = 10.0
PACE_WINDOW_S = 60.0  # the ETA follows the pace of the steps of the last minute


class Progress:
    """What the progress line says, kept up to date from the events and the status of one watch."""

    def __init__(self) -> None:
        self.workers: Any = None
        self.mesh: Any = None
        self.pace: list[tuple[float, int]] = []  # (event time, step) of this round's progress events
        self.logged_step: Any = None
        self.logged_at: float | None = None

    def see(self, ev: Event) -> None:
        t = ev["type"]
        if t == "launch":
            self.workers, self.mesh, self.pace = ev.get("workers"), ev.get("mesh"), []
        elif t == "failure":
            self.pace = []  # the time to recover is not the pace of training
        elif t == "progress" and isinstance(ev.get("step"), int):
            self.pace.append((float(ev["time"]), int(ev["step"])))
            newest = self.pace[-1][0]
            self.pace = [p for p in self.pace if p[0] >= newest - PACE_WINDOW_S]

    def seconds_per_step(self, ev: Event) -> float | None:
        if len(self.pace) >= 2 and self.pace[-1][1] > self.pace[0][1]:
            (t0, s0), (t1, s1) = self.pace[0], self.pace[-1]
            return (t1 - t0) / (s1 - s0)
        step_time = ev.get("step_time")
        return float(step_time) if isinstance(step_time, int | float) and step_time > 0 else None

    def line(self, ev: Event, status: RunStatus, outlook: QueueRow | None = None) -> str:
        """The progress line of a progress event (``describe`` with what the watch knows besides).

        The ETA is the service's forecast when the run is in a shared pool (``outlook``: it knows
        the resizes ahead), else the pace of the last minute times the steps left.
        """
        total = status.get("steps_total")
        fields: dict[str, Any] = {
            **ev,
            "steps_total": total,
            "workers": self.workers if self.workers is not None else status.get("workers"),
            "mesh": self.mesh or status.get("mesh"),
        }
        per_step = self.seconds_per_step(ev)
        if outlook is not None and outlook.eta_s is not None:
            fields["eta_s"] = outlook.eta_s
        elif isinstance(total, int) and isinstance(ev.get("step"), int) and total > ev["step"] and per_step is not None:
            fields["eta_s"] = (total - ev["step"]) * per_step
        return describe(fields)


class SeenRecovery(RecoveryRow):
    """A recovery as a watch saw it: ``seen_after_s`` after the job was training again."""

    seen_after_s: float


class WatchEnd(TypedDict):
    """The trigger's one event: how the job ended for Airflow, where it stood, the recoveries the watch saw."""

    status: Outcome  # success, failed, stopped (a person's stop or cancel)
    run_uri: str
    state: str | None  # None: the run could not be read any more
    step: int | None
    latest_committed: int | None
    failures: NotRequired[int | None]
    recoveries: list[SeenRecovery]
    events_after: str | None  # the newest event read: a later watch goes on from there
    message: NotRequired[str]  # why it failed or was stopped
    handle: NotRequired[dict[str, Any]]  # the polling sensor's: the job it watched
    retry: NotRequired[bool]  # False: a retry of the task cannot help (a setting to fix first)


class Recoveries:
    """The failures a watch has read, and the recoveries it paired them with (as the sensor counts them)."""

    def __init__(self) -> None:
        self.measured: list[Event] = []  # what the recoveries are measured from (find_recoveries)
        self.recoveries: list[SeenRecovery] = []
        self.told = (
            False  # the engine's own "recovered" event told the last recovery (the trigger's line is not needed)
        )

    def see(self, ev: Event) -> SeenRecovery | None:
        """The recovery this event completes (a ``resumed`` after failures), if it does."""
        if ev["type"] in ("failure", "rollback", "restore", "init", "resumed"):
            self.measured.append(ev)
        if ev["type"] == "failure" or (ev["type"] == "rollback" and ev.get("kind") == "in-job"):
            self.told = False
        elif ev["type"] == "recovered":
            self.told = True
        elif ev["type"] == "resumed":
            # Measured as `rtrain report` and the Training view measure it: one function for all three (one
            # recovery may absorb several failures: a fault during a recovery).
            done = [r for r in find_recoveries(self.measured) if r["resumed_at"] is not None]
            if len(done) <= len(self.recoveries):
                return None
            recovered = SeenRecovery(**done[-1], seen_after_s=round(time.time() - ev["time"], 3))
            self.recoveries.append(recovered)
            return recovered
        return None


def _gist(waiting: str) -> str:
    """A line of why pods wait without the messages in parentheses (they change while nothing else does)."""
    return re.sub(r" \([^()]*\)", "", waiting)


def queued_line(row: QueueRow) -> str:
    """What the task log says of a run of the shared pool that holds no host."""
    why = row.reason or "waiting for hosts"
    eta = f", ETA {duration(row.eta_s)}" if row.eta_s is not None else ""
    return (
        f"queued at priority {row.priority} ({why}): needs {row.min_hosts}..{row.max_hosts} host(s), "
        f"step {row.step}/{row.steps}{eta}"
    )


def written_at(ev: Event) -> dict[str, str]:
    """A log line's ``timestamp`` for an event it tells: when the engine wrote it, not when a look read it.

    A look reads the events of several seconds at once; stamped by the logger, each line would carry the
    time of the look.  Airflow keeps a timestamp a line brings (its task logs stamp only lines without one).
    """
    t = ev.get("time")
    if not isinstance(t, int | float):
        return {}
    return {"timestamp": datetime.fromtimestamp(float(t), tz=UTC).isoformat().replace("+00:00", "Z")}


def final_event(found: Look, run_uri: str, story: Recoveries) -> TriggerEvent | None:
    """The trigger's event for a job that is over (finished, failed, or stopped by a person); None while it lives."""
    outcome = found.outcome
    if outcome is None:
        return None
    st = found.status
    end = WatchEnd(
        status=outcome,
        run_uri=run_uri,
        state=found.state,
        step=st.get("step"),
        latest_committed=st.get("latest_committed"),
        failures=st.get("failures"),
        recoveries=story.recoveries,
        events_after=found.cursor,
    )
    if outcome != "success":
        end["message"] = found.reason or ("the job failed" if outcome == "failed" else f"the run was {found.state}")
    if not found.retry:
        end["retry"] = False
    return TriggerEvent(end)


class WatchSettings(Protocol):
    """How a task watches a job: seconds between looks, how long a launched job may stay silent, progress lines."""

    poll_interval: float
    start_timeout_s: float
    progress_every_s: float


def check_watch_settings(poll_interval: float, start_timeout_s: float, progress_every_s: float) -> None:
    """Refuse watch settings no watch can keep (each task that watches a job checks its own as it is made)."""
    if poll_interval <= 0:
        raise ValueError(f"poll_interval: must be > 0, got {poll_interval}")
    if start_timeout_s <= 0:
        raise ValueError(f"start_timeout_s: must be > 0, got {start_timeout_s}")
    if progress_every_s < 0:
        raise ValueError(f"progress_every_s: must be >= 0 (0: no progress lines), got {progress_every_s}")


class RTrainTrainingJobTrigger(BaseTrigger):
    """Poll a training job until it finishes or is gone for good.

    Yields one event: ``{"status": "success", "run_uri", "state", "step", "latest_committed",
    "failures", "recoveries", "events_after"}`` or ``{"status": "failed" | "stopped", "run_uri", "message",
    "state", "step", "latest_committed", "recoveries", "events_after"}`` (``stopped``: state ``stopped`` or
    ``cancelled``, a person's request).

    :param run_uri: the run's root (``<root>/<run_name>``).
    :param handle: what the launch returned (backend, agent pid / JobSet name, launched_at, ...).
    :param poll_interval: seconds between looks.
    :param start_timeout_s: a launched agent that never reports is failed after this long.
    :param stale_after_s: no status update for this long while alive is a failure (the
        agent's own hang detection normally fires first).
    :param events_after: relay only events whose key sorts after this one.
    :param progress_every_s: at most one progress line per this many seconds, when the step
        moved (0: no progress lines; the other events are relayed all the same).
    """

    def __init__(
        self,
        run_uri: str,
        handle: dict[str, Any],
        poll_interval: float = 5.0,
        start_timeout_s: float = 300.0,
        stale_after_s: float = 900.0,
        events_after: str | None = None,
        progress_every_s: float = PROGRESS_EVERY_S,
    ) -> None:
        super().__init__()
        self.run_uri = run_uri
        self.handle = dict(handle)
        self.poll_interval = float(poll_interval)
        self.start_timeout_s = float(start_timeout_s)
        self.stale_after_s = float(stale_after_s)
        self.events_after = events_after
        self.progress_every_s = float(progress_every_s)
        self._pool_events = EventReader()  # the shared pool's runs' events, each read once across looks

    @classmethod
    def for_job(
        cls,
        cfg: Config,
        handle: Mapping[str, Any],
        *,
        poll_interval: float,
        start_timeout_s: float,
        progress_every_s: float = PROGRESS_EVERY_S,
    ) -> RTrainTrainingJobTrigger:
        """The trigger that watches the job of ``handle``, a job of a run of ``cfg`` (the engine's timeouts)."""
        limits = timeouts(cfg.elastic, start_timeout_s)
        return cls(
            run_uri=cfg.run_uri,
            handle=dict(handle),
            poll_interval=poll_interval,
            start_timeout_s=limits["start_timeout_s"],
            stale_after_s=limits["stale_after_s"],
            events_after=handle.get("events_after"),
            progress_every_s=progress_every_s,
        )

    @classmethod
    def for_task(cls, task: WatchSettings, cfg: Config, handle: Mapping[str, Any]) -> RTrainTrainingJobTrigger:
        """The trigger a task defers to, to watch the job of ``handle`` with the task's watch settings."""
        return cls.for_job(
            cfg,
            handle,
            poll_interval=task.poll_interval,
            start_timeout_s=task.start_timeout_s,
            progress_every_s=task.progress_every_s,
        )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            CLASSPATH,
            {
                "run_uri": self.run_uri,
                "handle": self.handle,
                "poll_interval": self.poll_interval,
                "start_timeout_s": self.start_timeout_s,
                "stale_after_s": self.stale_after_s,
                "events_after": self.events_after,
                "progress_every_s": self.progress_every_s,
            },
        )

    # --- one look (blocking; runs in a thread) --------------------------------------------------

    def _tell(self, ev: Event, recovered: SeenRecovery | None, told: bool) -> None:
        """Log the event's sentence, or the recovery it completes (unless the engine ``told`` it), dated by the event."""
        if recovered is not None and not told:
            self.log.info(
                "[rtrain] recovered from %s: training again at step %s, %.1fs after the fault",
                recovered["cause"],
                recovered["resumed_step"],
                recovered["recovery_s"],
                **written_at(ev),
            )
        # A save that starts is not told: its commit follows.
        if ev["type"] in RELAYED and recovered is None and (ev["type"] != "checkpoint" or ev.get("committed")):
            self.log.info("[rtrain] %s", describe(ev), **written_at(ev))

    def _outlook(self) -> QueueRow | None:
        """This run's row of its shared pool's queue, with the ETA (None: not in a pool, or unreadable now)."""
        if not self.handle.get("priority"):
            return None
        try:
            return commands.outlook(str(self.handle["root"]), str(self.handle["run_name"]), self._pool_events)
        except Exception as e:  # noqa: BLE001 - the ETA is a nicety: a failed read leaves the line without it
            self.log.warning("Reading the queue of %s failed: %s", self.handle.get("root"), e)
            return None

    def _record_waiting(self, waiting: str) -> None:
        """Put why the pods wait (or that none does now) on the run's record: the Training view's timeline shows it."""
        from training import api

        try:
            api.record_pods_waiting(self.run_uri, waiting, job=self.handle.get("job"))
        except Exception as e:  # noqa: BLE001 - the record is an extra: the log line above says it already
            self.log.warning("Recording why pods wait in %s failed: %s", self.run_uri, e)

    def _unreadable(self, e: Exception, story: Recoveries, cursor: str | None) -> TriggerEvent:
        """The end of a watch that cannot read its run any more."""
        end = WatchEnd(
            status="failed",
            run_uri=self.run_uri,
            message=f"cannot read the run: {e}",
            state=None,
            step=None,
            latest_committed=None,
            recoveries=story.recoveries,
            events_after=cursor,
        )
        return TriggerEvent(end)

    def _backend(self) -> Backend:
        """The watch's backend, made by the hook (one per watch; GKE: one cluster and its clients)."""
        from rtrain_airflow.hooks.training import RTrainHook

        h = self.handle
        return RTrainHook().backend(h.get("backend", "local"), h.get("gke"), h.get("priority"))

    async def run(self) -> AsyncIterator[TriggerEvent]:
        limits = Timeouts(start_timeout_s=self.start_timeout_s, stale_after_s=self.stale_after_s)
        looks = watch(
            self._backend, cast(JobHandle, self.handle), limits, events_after=self.events_after, sleep=_no_wait
        )
        try:
            async for event in self._tell_looks(looks):
                yield event
        finally:
            await asyncio.to_thread(looks.close)  # the watch closes its backend's clients

    async def _tell_looks(self, looks: Generator[WatchItem]) -> AsyncIterator[TriggerEvent]:
        """Each look of the engine's watch told in the task log; the final one as the trigger's event."""
        cursor = self.events_after
        story = Recoveries()
        progress = Progress()
        assumed: tuple[str, ...] = ()  # the ETA's assumptions last logged
        waiting = ""  # why the job's pods wait (GKE), as last logged
        while True:
            found = await asyncio.to_thread(next, looks)  # blocking reads run in a thread
            if isinstance(found, Unreadable):  # a transient read error (GCS 5xx) is borne a few times
                self.log.warning("Reading run %s failed (%d/5): %s", self.run_uri, found.failures, found.error)
                if found.failures >= 5:
                    yield self._unreadable(found.error, story, cursor)
                    return
                await asyncio.sleep(self.poll_interval)
                continue
            st = found.status
            if _gist(found.waiting) != _gist(waiting):  # the reasons and counts, not the messages
                waiting = found.waiting
                self.log.info("[rtrain] %s", f"pods waiting: {waiting}" if waiting else "no pod waits any more")
                await asyncio.to_thread(self._record_waiting, waiting)
            now = time.monotonic()
            due = self.progress_every_s > 0 and (
                progress.logged_at is None or now - progress.logged_at >= self.progress_every_s
            )
            new = found.events
            newest = max((i for i, ev in enumerate(new) if ev["type"] == "progress"), default=None)
            outlook = (
                await asyncio.to_thread(self._outlook)
                if due and (newest is not None or found.state == "queued")
                else None
            )
            if outlook is not None and outlook.eta_notes != assumed:
                assumed = outlook.eta_notes
                if assumed:
                    self.log.info("[rtrain] the ETA assumes: %s", "; ".join(assumed))
            if found.state == "queued" and due and outlook is not None:
                self.log.info("[rtrain] %s", queued_line(outlook))
                progress.logged_at = now
            cursor = found.cursor
            for i, ev in enumerate(new):
                progress.see(ev)
                self._tell(ev, story.see(ev), story.told)
                if i == newest and due and ev.get("step") != progress.logged_step:
                    self.log.info("[rtrain] %s", progress.line(ev, st, outlook))
                    progress.logged_step, progress.logged_at = ev.get("step"), now
            end = final_event(found, self.run_uri, story)
            if end is not None:
                yield end
                return
            await asyncio.sleep(self.poll_interval)


def _no_wait(_seconds: float) -> None:
    """The watch's wait between looks, left to the trigger (``asyncio.sleep``: it holds no thread)."""
