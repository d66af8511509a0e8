"""What a host's agent does with its worker's reports: heartbeat fields, events, commits, chaos, the round's end.

The worker writes one JSON object a line on its pipe (``training.elastic.worker.main``).  Rank 0's
steps go into the heartbeat and the run's TensorBoard scalars; a commit goes into the ledger; the
reports the run keeps become events; host and storage faults are carried out here; how the worker
ended becomes this host's report of the round.  Writes to the run root go through the agent's
writer, in order, except those that must be on record before what follows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from training import storage
from training.background import idle_this_thread
from training.checkpoint import local as local_tier
from training.checkpoint.steps import file_checksums, recorded_checksums
from training.elastic.host.hostctx import HostContext
from training.elastic.host.outcomes import last_error, recovery_cost, worker_outcome
from training.elastic.host.workerproc import WorkerProc
from training.elastic.host.writer import Writer
from training.elastic.rendezvous import Outcome, RecoveryRecord, Report
from training.elastic.wire import ReportFields, ReportType, WorkerReport
from training.faults import KINDS, Fault, parse_chaos
from training.scalars import ScalarLog
from training.storage import is_transient

log = logging.getLogger("rtrain.agent")

SCALARS_FLUSH_S = 5.0  # step scalars reach the run's TensorBoard files this often (and at each round's end)
# Worker reports that become events (rank 0's; worker_started and chaos come from every rank).
EVENT_REPORTS = frozenset(
    {
        ReportType.WORKER_STARTED,
        ReportType.RESTORE,
        ReportType.INIT,
        ReportType.COMPILED,
        ReportType.COMPILED_AHEAD,
        ReportType.RESUMED,
        ReportType.RESUMED_WITH,
        ReportType.DATA_REFRESHED,
        ReportType.PROGRESS,
        ReportType.CHECKPOINT,
        ReportType.EVALUATED,
        ReportType.GUARD,
        ReportType.CHAOS,
        ReportType.RESCALE_REQUESTED,
        ReportType.LOCAL_CHECKPOINT_SKIPPED,
        ReportType.LOCAL_TIER_OFF,
    }
)


class ReportHandler:
    """Handles one host's worker reports, and reports the worker's end to the rendezvous."""

    def __init__(
        self,
        ctx: HostContext,
        *,
        local_dir: Path,
        step_beat_s: float,
        writer: Writer,
        leaving_at: Callable[[], float | None],
        warm: Callable[[], None],
    ) -> None:
        self.local_tier = bool(ctx.cfg.checkpoint.local_checkpoint_every)  # this host saves local copies
        self.store = ctx.store
        self.rdv = ctx.rdv
        self.ledger = ctx.ledger
        self.run_uri = ctx.run_uri
        self.host = ctx.host
        self.heart = ctx.heart  # this host's heartbeat record
        self.writer = writer  # the agent's writes, in order, off the main loop
        self.emit = ctx.emit  # write an event now
        self.capacity = ctx.capacity  # the local slice's pool (a preempted host leaves it)
        self.leaving_at = leaving_at  # when this host got a preemption notice (None: it did not)
        self.warm = warm  # start the next worker warming up (unless this host is leaving)
        self.local_dir = local_dir  # this host's local checkpoint tier
        self.step_beat_s = step_beat_s  # rank 0's step is written at most this often
        self.scalars: ScalarLog | None = None
        self.stopping = False  # the notice to this host's worker is a person's stop (the job's `stopped` event says so)
        self._scalars_at = 0.0
        self._step_beat_at = 0.0
        self._ahead: threading.Thread | None = None  # checking a local copy whole, ahead of a restore
        self._ahead_step = -1
        self._ahead_lock = threading.Lock()  # (copies are described from the writer thread and the main loop)

    def emit_later(self, type_: str, *, reported_at: float | None = None, **fields: Any) -> None:
        """Write an event from the writer thread, in order: the main loop does not wait for the store."""
        self.writer.put(lambda: self.emit(type_, reported_at=reported_at, **fields))

    # --- a worker's reports -------------------------------------------------------------------

    def handle(self, w: WorkerProc, rep: WorkerReport) -> None:
        """One report of the worker: the heartbeat, the ledger, what the worker's end is judged by, the events."""
        t, msg = rep.type.value, dict(rep.fields)
        if t == "metrics":
            self._metrics(w, msg)
            return
        if t == "progress":
            self.heart.update(now=False, tokens_per_s=msg.get("tokens_per_s"))
            if self.scalars is not None and msg.get("tokens_per_s") is not None:
                self.scalars.add(int(msg["step"]), {"tokens_per_s": float(msg["tokens_per_s"])})
        elif t == "checkpoint" and msg.get("committed"):
            step = int(msg["step"])
            self.writer.put(lambda: self._committed(step, msg))
        elif t in ("finished", "rescale_requested", "guard", "corrupt", "error"):
            w.seen[t] = msg
        elif t == "chaos":
            w.seen["fault_at"] = msg.get("at") or msg.get("time")
        elif t == "preempted":
            self._preempted(w, msg)
        elif t == "local_checkpoint":
            round_ = int(msg.get("round", w.round))
            # Advertised with the next beat: a round that ends describes and beats at once (below).
            self.writer.put(lambda: self.describe_local(round_, now=False))
        elif t in ("worker_started", "restore", "compiled"):
            w.seen[t] = dict(msg)
        if t == "resumed":
            if w.rank == 0:
                self.heart.update(step=msg.get("step"))
                self._recovered(w, msg)
            # The next worker warms up now, while this one trains: a recovery then starts at
            # jax.distributed, not at `import jax`; it warms up at the lowest priority, after this round's steps.
            self.warm()
        self._event(t, msg)

    def _metrics(self, w: WorkerProc, msg: ReportFields) -> None:
        """Every step (rank 0): the heartbeat's step and loss, and the TensorBoard scalars."""
        # Rank 0's step is what the status shows: beat soon after it moves, at most every step_beat_s.
        soon = w.rank == 0 and time.monotonic() - self._step_beat_at >= self.step_beat_s
        if soon:
            self._step_beat_at = time.monotonic()
        self.heart.update(now=soon, step=msg.get("step"), loss=msg.get("loss"), step_time=msg.get("step_time"))
        if self.scalars is None:
            self.scalars = ScalarLog(self.run_uri, self.host, store=self.store)
        values = {k: float(v) for k, v in (msg.get("values") or {}).items() if isinstance(v, int | float)}
        values["workers"] = w.plan.workers if w.plan is not None else 0
        if "metrics" not in w.seen:
            w.seen["metrics"] = True
            self.scalars.restart(int(msg["step"]))  # what an earlier round wrote from here on is superseded
        self.scalars.add(int(msg["step"]), values, wall_time=msg.get("time"))

    def _preempted(self, w: WorkerProc, msg: ReportFields) -> None:
        w.seen["notice"] = msg
        if msg.get("noticed") and not self.stopping:
            at = self.leaving_at()
            at = at if at is not None else msg.get("notice_at")
            seconds = float(msg["committed_at"]) - float(at) if at else None
            self.emit_later(
                "preemption_notice",
                step=msg.get("step"),
                seconds=seconds,
                committed=True,
                stop_s=msg.get("stop_s"),
                round=w.round,
            )

    def _event(self, t: str, msg: ReportFields) -> None:
        """The reports the run keeps become events; a host or storage fault is carried out once on record."""
        kind = KINDS.get(str(msg.get("action"))) if t == "chaos" else None
        by_agent = kind is not None and bool(kind.by_agent)  # carried out by this agent: on the host, or its storage
        committed = t == "checkpoint" and bool(msg.get("committed"))  # its event follows the ledger record
        if t in EVENT_REPORTS and not committed and (msg.get("process_id") == 0 or t in ("worker_started", "chaos")):
            # The event is timed when the worker reported it (the same host's clock), not when this agent's
            # loop read the report and its writer wrote it: step times and a round's phases stay exact.
            sent = msg.pop("time", None)
            if by_agent:
                self.emit(t, reported_at=sent, **msg)  # on record before the host goes down, or loses its run root
            else:
                self.emit_later(t, reported_at=sent, **msg)
        if by_agent and kind is not None:
            fault = parse_chaos(str(msg.get("spec")))
            log.warning("[%s] chaos %s: carried out by this host's agent (%s)", self.host, fault.spec, kind.by_agent)
            kind.on_agent(fault, self)

    def _committed(self, step: int, msg: ReportFields) -> None:
        """Rank 0's agent records a commit (writer thread): the step's file checksums go into the ledger.

        They are the record written into the step as it committed; a step without one is summed now.
        """
        try:
            try:
                files = recorded_checksums(self.run_uri, step)
            except ValueError:  # unreadable: what is there now is all there is
                files = None
            files = files or file_checksums(self.run_uri, step)
        except Exception as e:  # noqa: BLE001 - the step stays usable, just unverified
            log.warning("[%s] could not checksum checkpoint %s: %s", self.host, step, e)
            files = None
        self.ledger.record(step, "committed", attempt=msg.get("attempt"), files=files)
        self.ledger.set_pointer(step, "committed")
        self.heart.update(committed=step)
        fields = {k: v for k, v in msg.items() if k != "time"}
        self.emit("checkpoint", **fields)

    def disturb_storage(self, fault: Fault, for_s: float, latency_s: float) -> None:
        """Chaos on this agent's link to the run root: every call fails (or is slow) for a while."""
        log.warning("[%s] chaos %s: the run root is %s for %ss", self.host, fault.spec, fault.action, for_s)
        storage.disturb(self.run_uri, for_s, latency_s)

    def leave_pool(self, fault: Fault) -> None:
        """This host leaves the pool, and no other: lowering the pool's size alone would let the local slice stop
        another host too, when it looks before this one's agent is gone."""
        if self.capacity is not None:
            self.capacity.leave(self.host, reason=f"chaos {fault.spec}: host {self.host} lost")
            self.emit("capacity", available=self.capacity.available(), reason=f"host {self.host} preempted")

    # --- the worker's end -----------------------------------------------------------------------

    def worker_ended(self, w: WorkerProc, code: int) -> None:
        """Report how the worker ended (a failure at once: the survivors are waiting)."""
        seen = w.seen
        outcome, reason = worker_outcome(seen, code, w.rank, self.host)
        error = str(seen.get("error", {}).get("error", "")) or (last_error(w.log) if outcome == Outcome.FAILED else "")
        fields = dict(
            returncode=code,
            reason=reason,
            error=error,
            log=str(w.log),
            step=self.heart.record.step,
            guard=seen.get("guard"),
            corrupt=seen.get("corrupt"),
            fault_at=seen.get("fault_at"),
            notice=seen.get("notice"),
            peer_lost=seen.get("error", {}).get("peer_lost"),
        )
        if self.local_tier:
            # Local saves this worker finished but did not live to report, and the copies it pruned
            # since its last report: described now, before the report, so the leader forming the next
            # round (and this host's record) knows exactly what is on disk.
            self.describe_local(w.round)
        if outcome == Outcome.FAILED:
            if self.local_tier:
                self.heart.beat()  # the copies on record before the report: the leader forms the next round from both
            self.report(w.round, w.rank, outcome, **fields)  # at once: the survivors are waiting
        else:
            # An orderly end is reported after what the worker said before it (its commit records):
            # the leader's next decision reads them.
            self.writer.put(lambda: self.report(w.round, w.rank, outcome, **fields))
        if self.scalars is not None:
            self.writer.put(self.scalars.flush)
            self._scalars_at = time.monotonic()

    def report(self, round_: int, rank: int, outcome: Outcome, **fields: Any) -> None:
        """This host's report of how its worker ended round ``round_``."""
        rep = Report(round=round_, host=self.host, rank=rank, outcome=outcome.value, **fields)
        try:
            self.rdv.report(rep)
        except Exception as e:  # noqa: BLE001 - the heartbeat carries it
            log.warning("[%s] could not report round %s: %s", self.host, round_, e)
            # A heartbeat is rewritten in place: it gets through where a new file cannot (a full disk).
            carried = replace(rep, reason=f"{rep.reason} (its report could not be written: {e})")
            self.heart.update(unreported=asdict(carried))
            if is_transient(e):  # the writer tries again while the root fails
                self.writer.put(lambda: self.writer.until_written(lambda: self.rdv.report(rep)))

    # --- the local tier, TensorBoard scalars, recoveries --------------------------------------

    def describe_local(self, round_: int, *, now: bool = True) -> None:
        """Describe this host's finalised local copies (manifests with checksums) and advertise them (``now``: beat)."""
        try:
            steps = local_tier.describe_new(self.local_dir, round_)
        except OSError as e:
            log.warning("[%s] cannot describe the local checkpoints in %s: %s", self.host, self.local_dir, e)
            return
        self.advertise_local(steps, now=now)
        self.check_ahead(max(steps, default=-1))

    def check_ahead(self, step: int) -> None:
        """Check local copy ``step`` whole in a background thread in the idle class, once, unless a check is running.

        A worker that restores it then finds the verdict and does not sum its bytes again.
        """
        with self._ahead_lock:
            if step <= self._ahead_step or (self._ahead is not None and self._ahead.is_alive()):
                return
            self._ahead_step = step
            self._ahead = threading.Thread(target=self._check, args=(step,), name="rtrain-local-ahead", daemon=True)
            self._ahead.start()

    def _check(self, step: int) -> None:
        idle_this_thread()
        problem = local_tier.check_ahead(self.local_dir, step)
        if problem:
            log.warning("[%s] local copy %s fails its check: %s", self.host, step, problem)

    def advertise_local(self, steps: dict[int, local_tier.LocalStep], *, now: bool = True) -> None:
        self.heart.update(now=now, local=sorted([s.step, s.round] for s in steps.values()))

    def flush_scalars(self) -> None:
        if self.scalars is not None and time.monotonic() - self._scalars_at >= SCALARS_FLUSH_S:
            self._scalars_at = time.monotonic()
            if self.scalars.pending:
                self.writer.put(self.scalars.flush)

    def _recovered(self, w: WorkerProc, resumed: ReportFields) -> None:
        """Rank 0's first step after a failure or a notice: what the recovery cost, phase by phase."""
        recovery: RecoveryRecord = w.plan.recovery if w.plan is not None else {}
        if not recovery:
            return
        cost = recovery_cost(recovery, w.seen, float(resumed.get("time") or time.time()))
        self.emit_later(
            "recovered",
            cause=recovery.get("cause"),
            kind=recovery.get("kind"),
            round=w.round,
            step=resumed.get("step"),
            resume_step=cost.resume_step,
            tier=cost.tier,
            compile_cached=cost.compile_cached,
            steps_lost=cost.steps_lost,
            lost_s=asdict(cost.lost_s),
            seconds=cost.lost_s.total,
        )
