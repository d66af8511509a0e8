"""The run's status as readers should see it: never "running" for a job that is gone.

``status.json`` has one writer, the job's leader, which writes the final state
on every way a job ends.  When nobody can (every host of the job was killed at
once, an OOM took them all), the status would say "running" forever; so
whoever looks next (``rtrain status``, the Airflow sensor, the local slice)
checks: a status that says alive, not written for a while, with no job holding
the run lock (its lease lapsed) belongs to a job that is gone.  The reader then
takes the lock and records the final state with the reason, as an event too.
"""

from __future__ import annotations

import time
from typing import Any

from training.checkpoint.lock import LockHeld, RunLock
from training.events import ALIVE_STATES, EventLog, RunState, read_status, write_status
from training.storage import open_store

# A status older than this with no job holding the run lock belongs to a job that is gone.
# (A live leader writes it every second; a new leader takes over within a lease.)
STALE_STATUS_S = 15.0


def status(run_uri: str, repair: bool = True) -> dict[str, Any] | None:
    store = open_store(run_uri)
    st = read_status(store)
    if not repair or st is None or st.get("state") not in ALIVE_STATES:
        return st
    if time.time() - float(st.get("updated_at", 0)) < STALE_STATUS_S:
        return st  # a leader wrote it lately (or one is taking over: a lease is short)
    lock = RunLock(store, owner="status check", lease_s=10.0)
    if lock.held_by() is not None:
        return st
    try:
        lock.acquire()
    except (LockHeld, OSError):  # taken meanwhile; or the run root refuses writes (a full disk)
        return st
    try:
        st = read_status(store)
        if st is not None and st.get("state") in ALIVE_STATES:
            reason = (
                f"job {st.get('job')} is gone: no host agent holds the run any more (its lease lapsed; "
                "every host was lost or killed). Launch again to resume from the newest committed checkpoint."
            )
            EventLog(store, source="status-check").emit("failed", reason=reason, step=st.get("step"))
            st = write_status(store, **{**st, "state": RunState.FAILED.value, "reason": reason})
    finally:
        lock.release()
    return st
