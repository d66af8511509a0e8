"""The run's status as readers should see it: never "running" for a job that is gone.

``status.json`` has one writer at a time, the holder of the run lock: the job's
leader, or, while no host of the job is left, the launcher's local slice holding
the job ``waiting_for_capacity``.  The holder writes it at least every second and
writes the final state on every way a job ends.  When nobody can (every host of
the job was killed at once, an OOM took them all, the launcher too), the status
would say "running" forever; so whoever looks next with ``repair_status`` (``rtrain status``, the
Airflow sensor, the local slice) checks: a status that says alive, not written
for longer than the run's heartbeat timeout, no host of the job beating within
it (nor an agent of it running on this machine, cut off from the run root for a
while), and no job holding the run lock (its lease lapsed, by the reader's own
clock too) belongs to a job that is gone.  The reader then takes the lock and records the final state with the
reason, as an event too.

A job whose run root takes no write at all (read-only, or vanished) cannot record its own end there: its
leader (or its local slice) keeps the end on this machine instead (``keep_end_here``).  Readers here see
that end (``repair_status``), and the first look after the root takes writes again records it there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from training.checkpoint.lock import LockHeld, RunLock
from training.elastic.rendezvous import Rendezvous
from training.events import ALIVE_STATES, EventLog, RunState, RunStatus, read_status, write_status
from training.layout import CONFIG, STOP
from training.storage import NotFound, Store, open_store, scheme

log = logging.getLogger("rtrain.status")

# How long a status may go unwritten before a job with no lease holder counts as gone, when the run's
# config cannot be read (else its heartbeat_timeout_s: a live holder writes the status every second).
STALE_STATUS_S = 15.0
# How long a look waits for a gone job's lease to lapse by its own clock before recording the job lost.
REPAIR_WAIT_S = 15.0


def _stored_seconds(store: Store, key: str, default: float) -> float:
    """A number of seconds from the run's stored config, written in sections or flat (older runs)."""
    try:
        doc = json.loads(store.get(CONFIG))
        found = doc.get(key)
        for section in doc.values():
            if found is None and isinstance(section, dict):
                found = section.get(key)
        return float(found or default)
    except (NotFound, ValueError, TypeError, AttributeError):
        return default


def stale_after_s(store: Store) -> float:
    """The run's heartbeat timeout: no status, heartbeat or lease for this long means no live agent."""
    return _stored_seconds(store, "heartbeat_timeout_s", STALE_STATUS_S)


def _heartbeat_s(store: Store) -> float:
    """How often the run's hosts beat (1 s when the config cannot be read)."""
    return _stored_seconds(store, "heartbeat_s", 1.0)


def _pulse(store: Store, job: Any) -> tuple[Any, ...]:
    """What a live job keeps changing: its status's time and each of its hosts' heartbeat (agent, sequence)."""
    st = read_status(store) or {}
    try:
        beats = sorted((r.host, r.started, r.seq) for r in Rendezvous(store).hosts(str(job)).values())
    except (NotFound, OSError):
        beats = []
    return (st.get("updated_at"), st.get("state"), *beats)


def _beating(store: Store, job: Any, within_s: float, now: float, run_uri: str = "") -> list[str]:
    """Hosts of ``job`` whose heartbeat is newer than ``within_s`` (a leader may be taking over), or whose
    agent runs on this machine (alive, but cut off from the run root for a while)."""
    try:
        recs = Rendezvous(store).hosts(str(job)).values()
    except (NotFound, OSError):
        return []
    here = socket.gethostname()
    return sorted(
        r.host
        for r in recs
        if r.state != "gone"
        and (
            now - float(r.time) < within_s
            or (r.node == here and _agent_runs(r.pid, {store.uri, run_uri} - {""}, str(job)))
        )
    )


def _agent_runs(pid: int, run_uris: set[str], job: str) -> bool:
    """Is ``pid`` this job's host agent, running (not stopped, not a zombie) on this machine?"""
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            argv = f.read().replace(b"\0", b" ").split()  # its arguments, or the words of its title
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return False
    # An agent by its title (``rtrain agent h2 <run> --job <job>``), or by its command line before it set that:
    # started on its own, or forked by the local slice's template (whose title it has until then).
    titled = argv[:2] in ([b"rtrain", b"agent"], [b"rtrain", b"template"])
    agent = titled or b"training.elastic.host.agent" in argv or b"training.elastic.local.template" in argv
    mine = agent and job.encode() in argv and any(u.encode() in argv for u in run_uris)
    return mine and state not in (b"T", b"t", b"Z", b"X")


def status(run_uri: str) -> RunStatus | None:
    """The run's status document as written (None before any job wrote one); nothing is written."""
    return read_status(open_store(run_uri))


def _kept_path(store: Store) -> Path:
    """Where this machine keeps the end of the run's newest job that its run root refused (one file a run)."""
    digest = hashlib.sha256(store.uri.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "rtrain-job-ends" / f"{digest}.json"


def keep_end_here(store: Store, job: str, reason: str, step: Any = None) -> RunStatus:
    """Keep ``job``'s failed end on this machine, its run root refusing it (read-only, gone); the status it shows.

    The first end kept for a job stands (its leader's, before the other hosts' that found no one to lead)."""
    with contextlib.suppress(OSError, ValueError):
        kept: RunStatus = json.loads(_kept_path(store).read_text())
        if kept.get("job") == job:
            return kept
    doc = RunStatus(state=RunState.FAILED.value, reason=reason, job=job, run_uri=store.uri, updated_at=time.time())
    if step is not None:
        doc["step"] = int(step)
    path = _kept_path(store)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not keep the end of job %s on this machine either: %s", job, e)
    return doc


def kept_end(store: Store, st: RunStatus | None) -> RunStatus | None:
    """The end kept here of the job that ``st`` (the run root's status) shows alive, or of any job where the root
    shows none (gone); None when the root shows that job's end, another job, or a status written after it."""
    try:
        kept: RunStatus = json.loads(_kept_path(store).read_text())
    except (OSError, ValueError):
        return None
    if st is None:
        return kept
    if st.get("job") != kept.get("job") or st.get("state") not in ALIVE_STATES:
        _kept_path(store).unlink(missing_ok=True)  # recorded, or the run went on with another job
        return None
    return kept if float(st.get("updated_at", 0)) <= float(kept.get("updated_at", 0)) else None


def _record_kept(store: Store, st: RunStatus | None, kept: RunStatus) -> RunStatus:
    """Record a kept end in the run root if it takes writes now (then forget it here); what readers see."""
    if st is None or (scheme(store.uri).filesystem and not os.access(store.uri, os.W_OK)):
        return kept  # gone, or read-only still
    lock = RunLock(store, owner="status check", lease_s=10.0)
    try:
        _gen, holder = lock.newest()  # the job's last lease: its leader could not give it back
        if holder is not None and lock.lapses_in(holder) <= REPAIR_WAIT_S:
            lock.wait_lapse(holder)  # lapsed by this reader's clock too
        lock.acquire()
    except (LockHeld, OSError):
        return kept
    try:
        EventLog(store, source="status-check").failed(str(kept.get("reason")), step=kept.get("step"))
        st = write_status(store, **{**st, "state": RunState.FAILED.value, "reason": kept.get("reason")})
    except OSError:
        return kept
    finally:
        with contextlib.suppress(Exception):
            lock.release()
    _kept_path(store).unlink(missing_ok=True)
    return st


def stop_asked(store: Store) -> str | None:
    """The reason of the stop a person asked of the run's job (``rtrain stop``, a cancel), None if none.

    The request has an object of its own, which the run's next launch clears: the leader's requests to its
    workers (the control object) are rewritten every round, and one written over a stop lost it.
    """
    try:
        req = json.loads(store.get(STOP))
    except (NotFound, ValueError):
        return None
    return (
        str(req.get("reason") or "asked to stop") if isinstance(req, dict) and req.get("action") == "stop_job" else None
    )


def repair_status(run_uri: str) -> RunStatus | None:
    """The run's status, after recording the job's end when it is gone (the checks above; this may write): failed,
    or stopped when a person had asked it to stop."""
    store = open_store(run_uri)
    st = read_status(store)
    kept = kept_end(store, st)
    if kept is not None:
        return _record_kept(store, st, kept)
    if st is None or st.get("state") not in ALIVE_STATES:
        return st
    now = time.time()
    within = stale_after_s(store)
    age = now - float(st.get("updated_at", 0))
    if age < within or _beating(store, st.get("job"), within, now, run_uri):
        return st  # a holder wrote it lately, or a host of the job beats (a new leader is taking over)
    # The times above are the job's clocks read on this one: a reader whose clock runs ahead of the job's
    # sees a live job's status and beats as old.  So it watches, on its own clock, before it judges: the
    # lease must lapse (watched for its length, see RunLock.lapses_in), and nothing of the job may move.
    t0 = time.monotonic()
    pulse = _pulse(store, st.get("job"))
    events = EventLog(store, source="status-check")
    lock = RunLock(store, owner="status check", lease_s=10.0, on_event=events.emit)
    _gen, holder = lock.newest()
    if holder is not None and (lock.lapses_in(holder) > REPAIR_WAIT_S or lock.wait_lapse(holder) is not None):
        return st  # held for a while yet, or renewed, released or taken meanwhile: not this look's to judge
    time.sleep(max(2 * _heartbeat_s(store) - (time.monotonic() - t0), 0.0))
    if _pulse(store, st.get("job")) != pulse:
        return st  # a host beat, or the status was written, while this look watched: the job is alive
    try:
        lock.acquire()
    except (LockHeld, OSError):  # taken meanwhile; or the run root refuses writes (a full disk)
        return st
    try:
        st = read_status(store)
        if st is not None and st.get("state") in ALIVE_STATES:
            age = time.time() - float(st.get("updated_at", 0))
            reason = (
                f"job {st.get('job')} is gone: no host agent is left and nobody holds the run (status "
                f"{st.get('state')!r} last written {age:.0f}s ago, its lease lapsed; every host was lost or "
                "killed). Launch again to resume from the newest committed checkpoint."
            )
            if st.get("state") == RunState.WAITING_FOR_CAPACITY.value:
                reason = (
                    f"job {st.get('job')} waited for capacity since its last host left and none came back "
                    f"within capacity_timeout_s (status last written {age:.0f}s ago). Launch again to resume "
                    "from the newest committed checkpoint."
                )
            end = RunState.FAILED
            asked = stop_asked(store)
            if asked is not None:  # a person's stop, its agents gone (killed) before the job recorded it
                end = RunState.STOPPED
                reason = f"{asked} (its hosts ended before the job recorded the stop: {reason})"
            events.ended(end, reason, step=st.get("step"), lost=True)
            st = write_status(store, **{**st, "state": end.value, "reason": reason})
    finally:
        lock.release()
    return st
