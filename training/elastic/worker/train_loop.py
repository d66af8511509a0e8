"""The training loop of one round: steps dispatched a step ahead of their reading, the guard, saves of both
tiers, the preemption notice, and the ways out.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypedDict, cast

from training.checkpoint.resume import DataPosition
from training.elastic.codes import WorkerExit
from training.elastic.wire import GuardFinding, ReportType
from training.elastic.worker import ahead, compile_once
from training.elastic.worker.link import Assignment, Reporter, leave
from training.elastic.worker.programs import StepMade, cache_hits
from training.elastic.worker.restore import Start, settle_local
from training.elastic.worker.saves import Saver, StopVote, stop_requested
from training.ready import wait_ready

if TYPE_CHECKING:
    from training.config import Config
    from training.data.pipeline import Example
    from training.sections import OptimizerSection
    from training.storage import Store
    from training.tasks import Task, TaskData
    from training.trainer import StepMetrics, Trainer

# This process's CPU time (all its threads) when it was assigned its round.
CPU_AT_ASSIGNMENT = [0.0]


def train_batches(
    optimizer: OptimizerSection, a: Assignment, task_data: TaskData, next_batch: int
) -> Iterator[Example]:
    """This process's training batches from global batch ``next_batch`` on (the exact data position)."""
    from training.data import pipeline

    return pipeline.batches(
        task_data.train,
        seed=optimizer.seed,
        global_batch=optimizer.global_batch,
        process_index=a.rank,
        process_count=a.processes,
        start_batch=next_batch,
    )


class FirstAhead:
    """An iterator whose first item is read by a thread of its own at once: the input pipeline starts (its
    threads, its first reads) while the step compiles, not in the round's first step."""

    def __init__(self, it: Iterator[Example]) -> None:
        self.it = it
        self.first: list[Example] = []
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = threading.Thread(target=self._read, name="first-batch", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            self.first.append(next(self.it))
        except BaseException as e:  # noqa: BLE001 - raised where the batch is asked for
            self.error = e

    def __iter__(self) -> FirstAhead:
        return self

    def __next__(self) -> Example:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            if self.error is not None:
                raise self.error
            return self.first.pop()
        return next(self.it)


class RoundLoop:
    """The training loop of one round: steps, the guard, saves of both tiers, and the ways out.

    The loop never waits for the device on an ordinary step: the metrics of step N are read
    (a host sync) after step N+1 is dispatched, so the device always has the next step queued.
    Before a persistent save, the newest step is read too: the guard decides before any save.
    """

    def __init__(
        self,
        cfg: Config,
        store: Store,
        a: Assignment,
        rep: Reporter,
        trainer: Trainer,
        saver: Saver,
        start: Start,
        t_assigned: float,
        task: Task,
        made: StepMade,
    ) -> None:
        self.cfg, self.store, self.a, self.rep, self.trainer = cfg, store, a, rep, trainer
        self.saver, self.mngr = saver, saver.mngr
        self.restored, self.tier, self.chaos, self.dataset = start.restored, start.tier, start.chaos, start.dataset
        self.state, self.step = start.state, start.step
        self.next_batch, self.lr_scale, self.skipped = start.next_batch, start.lr_scale, start.skipped
        self.t_assigned, self.tokens_per_example = t_assigned, task.tokens_per_example()
        self.task = task
        self.loop: Loop  # made when the data pipeline is (run): the first step's clock starts there
        self.eval_batches: list[Any] | None = None  # validate_on: slice, made at the round's first evaluation
        self.kept_any = False  # process 0 has kept a compiled step (and deleted other jobs')
        self.made = made  # how the round's step was made (kept by process 0, unless it was loaded)
        self.validation: Any = None  # the task's validation source
        self.stop_vote: StopVote | None = None  # the next save's stop request, agreed a step before it

    def data_position(self) -> DataPosition:
        """The ``data`` item of a checkpoint of the newest step."""
        cfg = self.cfg
        return DataPosition(
            next_batch=self.next_batch,
            examples_consumed=(self.next_batch - sum(end - start for start, end in self.skipped))
            * cfg.optimizer.global_batch,
            global_batch=cfg.optimizer.global_batch,
            seed=cfg.optimizer.seed,
            dataset=self.dataset,
            lr_scale=self.lr_scale,
            skipped=self.skipped,
        )

    def run(self, task_data: TaskData, batches: Iterator[Example]) -> int:
        """Train to the last step (0), or leave: a notice, a guard verdict, a stop request at a checkpoint."""
        cfg, a = self.cfg, self.a
        self.validation = task_data.validation
        self.loop = Loop(cfg, self.rep, self.t_assigned, self.step, self.tokens_per_example)
        background_at = self.step + 2  # once the round's first step was read (below): it comes first
        while self.step < cfg.optimizer.steps:
            self.one_step(batches)
            if (self.step + 1) % cfg.checkpoint.checkpoint_every == 0 and self.step + 1 < cfg.optimizer.steps:
                self.stop_vote = StopVote.cast(self.store, self.a, self.step + 1)  # read at that save, not waited for
            save_now = self.step % cfg.checkpoint.checkpoint_every == 0 or self.step == cfg.optimizer.steps
            # Due by the config and the step alone, the same in every process (a process whose local
            # write failed has its tier off, and skips only the write).
            local_due = not save_now and self.tier_planned and self.step % cfg.checkpoint.local_checkpoint_every == 0
            # Read every step but the newest; before a persistent save (or at the end), the newest too: the
            # guard passes every step before it is saved.  A local copy is staged instead, and written once
            # its step is read.  Decided by the step alone, the same in every process: a process that read
            # the newest step (and saw a notice in it) a step before the others would stop while they train on.
            verdict = self.observe(keep=0 if save_now else 1)
            self.check(verdict.bad)
            if self.step == background_at:
                self.start_background()
            if verdict.notice and self.step < cfg.optimizer.steps:
                self.observe(keep=0)  # the newest step too, through the guard, before it is saved
                self.check(self.loop.bad)
                self.stop_here("preemption notice")
            self.saver.poll()
            if self.tier is not None:
                for done, seconds in self.tier.finished():
                    self.rep.send(ReportType.LOCAL_CHECKPOINT, everyone=True, step=done, seconds=seconds, round=a.round)
                if self.tier.failure:
                    self.rep.send(ReportType.LOCAL_TIER_OFF, reason=self.tier.failure)
                    self.tier.failure = ""
            if save_now:
                if self.save_and_maybe_stop():
                    return 0
            elif local_due and self.tier is not None and self.tier.enabled and self.tier.can_save():
                # each process's copy is its own
                blocking = self.tier.save(self.step, self.state, self.data_position())
                if blocking is not None:
                    self.loop.local_saves.append(blocking)
        self.observe(keep=0)
        self.saver.wait()
        if self.tier is not None:
            if self.tier.enabled:
                settle_local(self.tier, self.rep, a)
            self.tier.close()
        self.mngr.close()
        self.rep.send(ReportType.FINISHED, everyone=True, step=self.step)
        return 0

    def observe(self, keep: int) -> Verdict:
        """Read the steps in flight but the newest ``keep``; a staged local copy of a step the guard passed goes to be written."""
        verdict = self.loop.observe(keep)
        if self.tier is not None:
            self.tier.release(self.loop.passed)
        return verdict

    def start_background(self) -> None:
        """The round's background work, once its first step was read: the saves' host copies compiled, and (process 0)
        the step kept and compiled ahead for smaller sizes.

        Not before: the round's start is CPU-bound, and a background thread holding the interpreter lock at a low
        priority would keep the loop from reading that step (process 0's lateness delays every process's steps).
        """
        self.saver.prepare_ahead()
        if self.tier is not None:
            self.tier.prepare_ahead()
        if self.a.rank == 0:
            to = ahead.Ahead(self.compiled_ahead, self.keep_compiled, self.keeps, cache_hits)
            ahead.start(self.cfg, self.task, self.a.processes, self.made.compiled, self.made.key, to)

    def keep_compiled(self, workers: int, program: compile_once.Serialized, key: str) -> None:
        """Keep a compiled step (of program ``key``) on the run root for this job's later rounds of ``workers``
        hosts (process 0)."""
        job = self.a.job
        if not job:
            return
        try:
            if not self.kept_any:
                ahead.forget_other_jobs(self.store, job)
                self.kept_any = True
            ahead.keep(self.store, job, workers, program, key)
        except Exception as e:  # noqa: BLE001 - a later round then compiles from the persistent cache
            print(f"could not keep the step compiled for {workers} hosts: {type(e).__name__}: {e}", file=sys.stderr)

    def keeps(self, workers: int) -> bool:
        """Whether this job keeps a step for ``workers`` hosts (process 0)."""
        try:
            return bool(self.a.job) and ahead.kept(self.store, self.a.job, workers)
        except Exception:  # noqa: BLE001 - then it is compiled ahead again: a cache hit
            return False

    def compiled_ahead(self, workers: int, seconds: float, already: bool) -> None:
        """Report a smaller size's step compiled ahead, or found in the cache already (from the compiling thread)."""
        self.rep.send(ReportType.COMPILED_AHEAD, workers=workers, seconds=round(seconds, 3), already=already)

    @property
    def tier_planned(self) -> bool:
        """The tier could help on this round's mesh (the same in every process)."""
        return self.tier is not None and not self.tier.off_for_mesh

    def one_step(self, batches: Iterator[Example]) -> None:
        """Dispatch the next step (its metrics are read later), with its faults and its data ids traced if asked."""
        from training.layout import TRACE

        self.chaos.before_step(self.step)
        step_lr = self.lr_scale * self.chaos.learning_rate_scale(self.step)
        local = next(batches)  # after the step's faults: a notice they send has the batch's time to land
        if self.cfg.observability.trace_data_ids:
            self.store.put(
                f"{TRACE}{self.step:08d}/a{self.a.round:03d}-p{self.a.rank:03d}.json",
                json.dumps({"ids": [int(i) for i in local["ids"]], "processes": self.a.processes}).encode(),
            )
        global_batch = self.trainer.global_batch(local)
        self.state, metrics = self.trainer.step(self.state, global_batch, step_lr, notice=NOTICE.at is not None)
        self.step += 1
        self.next_batch += 1
        self.loop.dispatched(self.step, metrics, self.next_batch)

    def check(self, bad: GuardFinding | None) -> None:
        """A step the guard rejected: fail loudly with the step and the metric (the leader rolls back).

        A save still in flight holds a state from before the bad step: it is let commit first.
        """
        if bad is None:
            return
        self.saver.wait()
        self.rep.send(
            ReportType.GUARD,
            everyone=True,
            restored_from=self.restored,
            committed_since_restore=self.saver.committed_any,
            **bad,
        )
        leave(self.rep, WorkerExit.GUARD)

    def save_and_maybe_stop(self) -> bool:
        """Save the step (a persistent checkpoint); True when the leader asked the round to stop here."""
        if self.chaos.corrupts(self.step):
            self.state = self.trainer.corrupt(self.state)
        self.saver.save(self.step, self.state, self.data_position(), self.cfg)
        self.chaos.after_save_started(self.step)
        if self.cfg.checkpoint.validate_on == "slice":
            self.evaluate_saved()
        vote, self.stop_vote = self.stop_vote, None
        stop = vote.agreed() if vote is not None and vote.step == self.step else None
        if self.step < self.cfg.optimizer.steps and (stop if stop is not None else stop_requested(self.store, self.a)):
            self.saver.wait()
            self.rep.send(ReportType.RESCALE_REQUESTED, everyone=True, step=self.step, workers=self.a.processes)
            self.mngr.close()
            return True
        self.loop.reset_clock()  # saving time is not step time
        return False

    def evaluate_saved(self) -> None:
        """Evaluate the step just saved on this round's mesh, while its save is written; process 0 reports it.

        The evaluation set is the one a host validation reads (``eval_set``), laid out over the processes.
        """
        from training.data.pipeline import eval_set

        cfg, a = self.cfg, self.a
        if self.validation is None:
            return  # the task has none: validation says so
        t0 = time.perf_counter()
        if self.eval_batches is None:
            local = eval_set(
                self.validation,
                batch=cfg.checkpoint.val_batch,
                max_batches=cfg.checkpoint.val_batches,
                process_index=a.rank,
                process_count=a.processes,
            )
            self.eval_batches = [self.trainer.global_batch(b, size=cfg.checkpoint.val_batch) for b in local]
        sums: dict[str, float] = {}
        for batch in self.eval_batches:
            for k, v in self.trainer.evaluate(self.state["params"], batch).items():
                sums[k] = sums.get(k, 0.0) + float(v)
        metrics = {k: v / len(self.eval_batches) for k, v in sums.items()}
        shown = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}  # NaN is not JSON
        self.rep.send(ReportType.EVALUATED, step=self.step, metrics=shown, seconds=round(time.perf_counter() - t0, 3))

    def stop_here(self, why: str) -> NoReturn:
        """Save and commit the newest step (unless saved already), tell the agent, and leave."""
        t_stop = time.time()
        if self.saver.last_saved != self.step:
            self.saver.save(self.step, self.state, self.data_position(), self.cfg)
        self.saver.wait()
        if self.tier is not None:
            self.tier.wait()
        sync_processes(self.a, f"rtrain-stop-{self.a.round}-{self.step}")  # every process knows: the step is committed
        self.rep.send(
            ReportType.PREEMPTED,
            everyone=True,
            step=self.step,
            noticed=NOTICE.at is not None,
            notice_at=NOTICE.at,
            committed_at=time.time(),
            stop_s=time.time() - t_stop,
            reason=why,
        )
        self.mngr.close()
        leave(self.rep, WorkerExit.NOTICE)


class Notice:
    """A preemption notice (SIGTERM): when it came, if it did."""

    at: float | None = None

    @classmethod
    def install(cls) -> None:
        def on_term(_signum: int, _frame: Any) -> None:
            if cls.at is None:
                cls.at = time.time()

        signal.signal(signal.SIGTERM, on_term)


NOTICE = Notice


class Headline(TypedDict, total=False):
    """A progress report's headline metrics: those of them the step has."""

    loss: float
    grad_norm: float
    accuracy: float
    lr: float


@dataclass
class Verdict:
    bad: GuardFinding | None = None  # the guard's finding
    notice: bool = False  # some process of the group was told to stop


class Loop:
    """The steps in flight, read one step late: the guard, the metrics and progress reports."""

    def __init__(self, cfg: Config, rep: Reporter, t_assigned: float, step: int, tokens_per_example: int) -> None:
        self.cfg = cfg
        self.rep = rep
        self.t_assigned = t_assigned
        self.inflight: list[tuple[int, StepMetrics, int]] = []
        self.recent: list[float] = []  # read losses, for the spike guard's running median
        self.first = True
        self.t_last = time.time()
        self.since = 0  # steps read since the last progress report
        self.tokens_per_step = cfg.optimizer.global_batch * tokens_per_example
        self.bad: GuardFinding | None = None
        self.passed: int | None = None  # the newest step read that the guard passed
        self.notice = False
        self.local_saves: list[float] = []

    def dispatched(self, step: int, metrics: StepMetrics, next_batch: int) -> None:
        self.inflight.append((step, metrics, next_batch))

    def reset_clock(self) -> None:
        """Start the step-time window afresh (after a save): the steps read before it are not in the next report."""
        self.t_last, self.since = time.time(), 0

    def observe(self, keep: int) -> Verdict:
        """Read the metrics of the steps in flight but the newest ``keep``; stop at the first bad one."""
        import jax

        while len(self.inflight) > keep and self.bad is None:
            step, metrics, next_batch = self.inflight.pop(0)
            wait_ready(list(metrics.values()))  # not in JAX's wait, which delays the next steps
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}  # the host sync, one step late
            now = time.time()
            loss = m["loss"]
            why = guard_verdict(loss, self.recent, self.cfg.checkpoint.spike_factor, self.cfg.checkpoint.spike_window)
            if why:
                self.bad = GuardFinding(step=step, metric="loss", value=loss, reason=why, next_batch=next_batch)
                break
            self.passed = step
            self.recent.append(loss)
            del self.recent[: -self.cfg.checkpoint.spike_window]
            self.notice = self.notice or m["notice"] > 0
            self.since += 1
            step_time = (now - self.t_last) / self.since
            values = {k: v for k, v in m.items() if k != "notice"}  # the engine's and the task's own metrics
            self.rep.send(ReportType.METRICS, step=step, step_time=step_time, loss=loss, values=values)
            common = cast(Headline, {k: values[k] for k in Headline.__annotations__ if k in values})
            if step % self.cfg.observability.log_every == 0 or step == self.cfg.optimizer.steps or self.first:
                self.rep.send(
                    ReportType.PROGRESS,
                    step=step,
                    tokens_per_s=self.tokens_per_step / max(step_time, 1e-9),
                    step_time=step_time,
                    local_save_blocking_s=sum(self.local_saves) if self.local_saves else None,
                    **common,
                )
                self.local_saves = []
                if self.first:
                    # From every process: each agent starts its next standby now (its round has started).
                    # This process's CPU time in set-up, restore and compile: a compile it was spared shows.
                    cpu_s = round(time.process_time() - CPU_AT_ASSIGNMENT[0], 3)
                    self.rep.send(
                        ReportType.RESUMED, everyone=True, step=step, seconds=now - self.t_assigned, cpu_s=cpu_s
                    )
                    print(
                        f"round {self.rep.round} process {self.rep.rank}: step {step} done {now - self.t_assigned:.1f}s"
                        f" after the assignment, with {cpu_s:.1f}s of CPU",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.first = False
                self.t_last, self.since = now, 0
        return Verdict(self.bad, self.notice)


def sync_processes(a: Assignment, name: str) -> None:
    if a.processes > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def guard_verdict(loss: float, recent: list[float], factor: float, window: int) -> str:
    """Why this loss must not be trained on ('' when it is fine)."""
    import math
    import statistics

    if not math.isfinite(loss):
        return f"loss is {loss}"
    if factor > 0 and len(recent) >= 3:
        median = statistics.median(recent[-window:])
        if loss > factor * median:
            return f"loss {loss:.4g} > {factor:g} x running median {median:.4g}"
    return ""
