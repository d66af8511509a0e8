"""The deferrable wait on a training job: its status document and its typed events.

The job (the elastic agent and its workers, or a JobSet on GKE) recovers from
lost hosts by itself, in seconds.  This trigger only decides when the job is
*over* for Airflow:

* ``finished``: success;
* ``failed``: the agent gave up (failure budget spent, capacity below the minimum
  past its timeout, guard rollbacks exhausted), or the job is gone (the agent
  was killed, the JobSet failed or vanished), or nothing was heard for
  ``stale_after_s``.

Meanwhile it relays what the job does (launches, failures, resizes, restores,
rollbacks) into the task log, and measures each recovery as Airflow sees it:
from the failure (the fault, when chaos recorded one) to the next ``resumed``
event.  The blocking reads (a local file or a GCS object) run in a thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from training.api import describe

CLASSPATH = "rtrain_airflow.triggers.training.RTrainTrainingJobTrigger"
RELAYED = (
    "launch",
    "failure",
    "resize",
    "restore",
    "resumed",
    "waiting_for_capacity",
    "capacity",
    "chaos",
    "rollback",
    "guard",
    "finished",
    "failed",
    "leader",
    "host_lost",
    "checkpoint_corrupt",
)


class RTrainTrainingJobTrigger(BaseTrigger):
    """Poll a training job until it finishes or is gone for good.

    Yields one event: ``{"status": "success", "run_uri", "state", "step", "latest_committed",
    "failures", "recoveries", "events_after"}`` or ``{"status": "failed", "run_uri", "message",
    "state", "step", "latest_committed", "recoveries", "events_after"}``.

    :param run_uri: the run's root (``<root>/<run_name>``).
    :param handle: what the launch returned (backend, agent pid / JobSet name, launched_at, ...).
    :param poll_interval: seconds between looks.
    :param start_timeout_s: a launched agent that never reports is failed after this long.
    :param stale_after_s: no status update for this long while alive is a failure (the
        agent's own hang detection normally fires first).
    :param events_after: relay only events whose key sorts after this one.
    """

    def __init__(
        self,
        run_uri: str,
        handle: dict[str, Any],
        poll_interval: float = 5.0,
        start_timeout_s: float = 300.0,
        stale_after_s: float = 900.0,
        events_after: str | None = None,
    ) -> None:
        super().__init__()
        self.run_uri = run_uri
        self.handle = dict(handle)
        self.poll_interval = float(poll_interval)
        self.start_timeout_s = float(start_timeout_s)
        self.stale_after_s = float(stale_after_s)
        self.events_after = events_after

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
            },
        )

    # --- one look (blocking; runs in a thread) --------------------------------------------------

    def _look(self, cursor: str | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        from rtrain_airflow.hooks.training import RTrainHook

        hook = RTrainHook()
        backend = hook.backend(self.handle.get("backend", "local"), self.handle.get("gke"))
        found = backend.poll(
            self.handle, {"start_timeout_s": self.start_timeout_s, "stale_after_s": self.stale_after_s}
        )
        new = hook.events(self.run_uri, after=cursor)
        return found, new

    async def run(self) -> AsyncIterator[TriggerEvent]:
        cursor = self.events_after
        failures: list[dict[str, Any]] = []
        recoveries: list[dict[str, Any]] = []
        errors = 0
        while True:
            try:
                found, new = await asyncio.to_thread(self._look, cursor)
                errors = 0
            except Exception as e:  # noqa: BLE001 - a transient read error (GCS 5xx) is retried a few times
                errors += 1
                self.log.warning("Reading run %s failed (%d/5): %s", self.run_uri, errors, e)
                if errors >= 5:
                    yield TriggerEvent(
                        {
                            "status": "failed",
                            "run_uri": self.run_uri,
                            "message": f"cannot read the run: {e}",
                            "state": None,
                            "step": None,
                            "latest_committed": None,
                            "recoveries": recoveries,
                            "events_after": cursor,
                        }
                    )
                    return
                await asyncio.sleep(self.poll_interval)
                continue
            for ev in new:
                cursor = ev["_key"]
                if ev["type"] == "failure" or (ev["type"] == "rollback" and ev.get("kind") == "in-job"):
                    failures.append(ev)
                elif ev["type"] == "resumed" and failures:
                    f = failures.pop(0)
                    failures.clear()  # one recovery may absorb several failures (a fault during a recovery)
                    start = float(f.get("fault_at") or f["time"])
                    rec = {
                        "cause": f.get("reason"),
                        "failed_at": start,
                        "resumed_at": ev["time"],
                        "recovery_s": round(ev["time"] - start, 3),
                        "resumed_step": ev.get("step"),
                        "seen_after_s": round(time.time() - ev["time"], 3),
                    }
                    recoveries.append(rec)
                    self.log.info(
                        "[rtrain] recovered: %s -> training again at step %s after %.1fs",
                        rec["cause"],
                        rec["resumed_step"],
                        rec["recovery_s"],
                    )
                if ev["type"] in RELAYED:
                    self.log.info("[rtrain] %s", describe(ev))
            st = found.get("status") or {}
            base = {
                "run_uri": self.run_uri,
                "state": found["state"],
                "step": st.get("step"),
                "latest_committed": st.get("latest_committed"),
                "failures": st.get("failures"),
                "recoveries": recoveries,
                "events_after": cursor,
            }
            if found["state"] == "finished":
                yield TriggerEvent({"status": "success", **base})
                return
            if found["state"] == "failed":
                yield TriggerEvent({"status": "failed", "message": found.get("reason") or "the job failed", **base})
                return
            await asyncio.sleep(self.poll_interval)
