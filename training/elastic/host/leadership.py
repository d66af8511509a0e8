"""A host agent's part in leading its job: taking the run lock's lease when it is free, leading, stepping down.

It is also what the leader uses of its host (``LeaderHost``): the run's records, the lease, the
capacity, the events.  A leader whose run root fails for now leads on at the next tick; one whose
lease is lost steps down; one that fails otherwise ends the job with the reason.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from training.cadence import Cadence
from training.checkpoint.lock import LeaseKeeper, LockHeld, LockLost, LockRecord, RunLock
from training.elastic.codes import AgentExit
from training.elastic.host.hostctx import HostContext
from training.elastic.host.hostwatch import HostWatch
from training.elastic.host.jobstatus import Phase
from training.elastic.host.leader import Leader
from training.elastic.status import keep_end_here
from training.storage import LASTING_WRITE_ERRORS, RootGone, is_transient

log = logging.getLogger("rtrain.agent")


@dataclass(frozen=True)
class LeadTick:
    """What a tick of leading means for the agent: a round it just opened, or the exit it must make."""

    opened: bool = False  # this host's own part in the round it just opened: look at once
    exit: AgentExit | None = None


class Leadership:
    """Leads the job while this agent holds the lease (``leader``), and tries to take the lease while it does not."""

    def __init__(
        self,
        ctx: HostContext,
        *,
        cadence: Cadence,
        stop_worker_at_step: Callable[[int], bool] = lambda _round: False,
    ) -> None:
        cfg, store, job, host, emit, heart = ctx.cfg, ctx.store, ctx.job, ctx.host, ctx.emit, ctx.heart
        self.cfg = cfg
        self.store = store
        self.rdv = ctx.rdv
        self.ledger = ctx.ledger
        self.events = ctx.events
        rec = heart.record
        self.lock = RunLock(
            store,
            owner=f"agent {host} of job {job}",
            lease_s=cfg.elastic.lease_s,
            job=job,
            on_event=emit,
            contact={"host": host, "started": rec.started, "watch": rec.watch},
        )
        self.host_watch = HostWatch()  # connections to other agents (they survive a change of leader)
        self.run_uri = ctx.run_uri
        self.job = job
        self.host = host
        self.capacity = ctx.capacity
        self.cadence = cadence
        self.heart = heart  # this host's heartbeat record: it says whether this host leads
        self._emit = emit
        self._stop_worker_at_step = stop_worker_at_step
        self.keeper: LeaseKeeper | None = None
        self.leader: Leader | None = None  # while this agent leads
        self.store_failure = ""  # why the run root refuses writes for good (a full disk, a read-only one), once seen
        self._next_try = 0.0
        self._failing_since: float | None = None  # leading has met a run root failing for now since

    def emit(self, type_: str, **fields: Any) -> None:
        """Write an event now, naming this host."""
        self._emit(type_, **fields)

    def stop_worker_at_step(self, round_: int) -> bool:
        """Tell this host's worker of ``round_`` to stop its group at the next step and commit it (a person's stop)."""
        return self._stop_worker_at_step(round_)

    def look_soon(self) -> None:
        """Something happened: is there still a leader?  Look at the next turn of the loop."""
        self._next_try = 0.0

    def maybe_lead(self) -> AgentExit | None:
        """Take the lease when its holder is gone (at most every heartbeat); SUPERSEDED when another job holds the run."""
        now = time.monotonic()
        if self.leader is not None or now < self._next_try:
            return None
        self._next_try = now + self.cfg.elastic.heartbeat_s
        try:
            holder = self.lock.held_by()
        except Exception as e:  # noqa: BLE001 - try again at the next beat
            log.warning("[%s] cannot read the run lock: %s", self.host, e)
            return None
        if holder is not None and holder.get("job") != self.job:
            log.warning("[%s] the run now belongs to job %s; this job's agents stop", self.host, holder.get("job"))
            return AgentExit.SUPERSEDED
        exited: int | None = None
        if holder is not None and holder.get("action") != "handoff":
            exited = self._holder_exited(holder)
            if exited is None:
                return None  # a live leader of this job
        try:
            self.lock.acquire(holder_exited=exited)
        except LockHeld:
            return None
        except OSError as e:
            log.warning("[%s] cannot take the lease: %s", self.host, e)
            seen = self.store_failure
            self.store_error(e)
            if seen and self.store_failure:  # refused again (after any room was made): nobody can lead the job
                keep_end_here(self.lock.store, self.job, self.store_failure, self.heart.record.step)
                return AgentExit.FAILED
            return None
        self.keeper = LeaseKeeper(
            self.lock, on_lost=lambda why: log.warning("[%s] %s", self.host, why), on_error=self.store_error
        ).start()
        self.heart.update(leader=True)
        self._failing_since = None
        self.leader = Leader(self)
        log.warning("[%s] leads job %s (lease generation %s)", self.host, self.job, self.lock.gen)
        return None

    def _holder_exited(self, holder: LockRecord) -> int | None:
        """The lease's generation when its holder's agent has exited: its host-watch connection was closed, or
        it is an earlier agent of this very host (this one replaced it) and nothing listens at its address."""
        contact = holder.get("contact")
        own = self.heart.record.started
        if contact is None or not contact.get("watch") or contact.get("started") == own:
            return None
        host, started = str(contact["host"]), float(contact["started"])
        self.host_watch.watch(host, started, str(contact["watch"]))
        exited = self.host_watch.exited(host, started)
        # A refused dial is no proof of death in general (a network can refuse a live host), but an earlier agent
        # of this host was replaced because it stopped: its listener refusing says it has exited.
        predecessor = host == self.host and started < own and self.host_watch.refused(host, started)
        return int(holder["gen"]) if exited or predecessor else None

    def store_error(self, e: Exception) -> None:
        """The run root refused a write.  One it will keep refusing ends the job: room is made for its last words."""
        why = store_failure(e, self.run_uri)
        if why and not self.store_failure:
            self.store_failure = why
            if isinstance(e, OSError) and e.errno == errno.ENOSPC and self.rdv.free_reserve():
                log.warning("[%s] the run root is full: freed the space held back for the job's end", self.host)

    def tick(self) -> LeadTick:
        """Lead for one turn of the agent's loop (nothing while this agent does not lead)."""
        leader = self.leader
        if leader is None:
            return LeadTick()
        opened = leader.round.round if leader.round else None
        try:
            leader.tick()
        except LockLost as e:
            self._step_down(str(e))
        except Exception as e:  # noqa: BLE001 - leading failed: the job still ends with the reason
            now = time.monotonic()
            if not is_transient(e) or now - (self._failing_since or now) > self.cfg.elastic.heartbeat_timeout_s * 3:
                return LeadTick(exit=self._failed(leader, e))
            # The run root fails for now: lead on at the next tick (a lease that lapses meanwhile is lost).
            self._failing_since = self._failing_since or now
            log.warning("[%s] leading: the run root fails for now: %s", self.host, e)
        else:
            self._failing_since = None
            return LeadTick(opened=(leader.round.round if leader.round else None) != opened)
        return LeadTick()

    def _failed(self, leader: Leader, e: Exception) -> AgentExit:
        """Leading raised: the job ends, with the reason (a full disk: the space held back is freed first)."""
        log.error("[%s] leading the job failed", self.host, exc_info=e)
        self.store_error(e)
        why = self.store_failure or f"the leader ({self.host}) failed: {type(e).__name__}: {e}"
        recorded = not self.store_failure  # a failing run root may have cut the end's records short already
        try:
            leader.fail(why)
        except Exception:  # noqa: BLE001 - nothing more to do there; whoever looks next records it
            log.exception("[%s] could not record the job's end", self.host)
            recorded = False
        if not recorded:  # kept on this machine: the launcher and readers here see it, a later look records it
            keep_end_here(self.lock.store, self.job, why, leader.status.step)
        return AgentExit.FAILED

    def _step_down(self, why: str) -> None:
        log.warning("[%s] no longer leads: %s", self.host, why)
        self._failing_since = None
        if self.keeper is not None:
            self.keeper.stop()
        self.keeper = None
        self.leader = None
        self.lock.forget()  # a refresh the stopped keeper still has under way leaves it forgotten too
        self.heart.update(leader=False)

    def last_host_leaves(self) -> float:
        """This leading host leaves, no other host of the job is left: how long the lease waits for hosts (0: none).

        Where the hosts come back by themselves (no local pool: pods that their Job makes again), the job
        waits for them, the lease handed to its next agents; on the local slice the job ends, resumable,
        unless a scheduler took the hosts (the local slice then holds the run, queued, until they return).
        """
        leader = self.leader
        if leader is None:
            return 0.0
        queued = self.capacity is not None and self.capacity.assigned()
        if leader.phase == Phase.DONE or (leader.view.fresh() - {self.host}) or queued:
            return 0.0
        if self.capacity is None:
            return leader.wait_for_returning_hosts()
        leader.fail(
            "every host of the job left after a preemption notice; a relaunch resumes from the newest "
            "committed checkpoint"
        )
        return 0.0

    def release(self, hand_over_s: float) -> None:
        """Stop keeping the lease and give it up: handed to the job's next agents for ``hand_over_s``, else released."""
        if self.keeper is not None:
            self.keeper.stop()
        with contextlib.suppress(Exception):
            if hand_over_s and self.keeper is not None and self.keeper.valid():
                self.lock.handoff(self.job, hand_over_s)  # the job's next agents claim it
                log.warning("[%s] no host of the job is left: it waits %.0fs for its hosts", self.host, hand_over_s)
            else:
                self.lock.release()  # a no-op unless this agent still holds it


def store_failure(e: Exception, run_uri: str) -> str:
    """The job's end reason for a write error the run root will keep giving ('' for any other error)."""
    if isinstance(e, RootGone):
        return str(e.strerror)  # the run root, and how it is gone
    if not isinstance(e, OSError) or e.errno not in LASTING_WRITE_ERRORS:
        return ""
    writing = f", writing {e.filename}" if e.filename else ""
    if e.errno == errno.ENOSPC:
        return f"no space left on {run_uri} (No space left on device{writing})"
    return (
        f"the run root {run_uri} refuses writes ({e.strerror or errno.errorcode.get(e.errno or 0, 'error')}{writing})"
    )
