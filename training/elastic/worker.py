"""One training process of the multi-controller program (one per host), started by its host agent.

The agent starts it ahead of need, as a standby that dies with its agent (``PR_SET_PDEATHSIG``), so
a recovery starts at ``jax.distributed`` and pays no imports or dataset checks.  Read top to bottom:
warm-up (imports, config, dataset; beside a training round, in a thread of the idle class); the
assignment (one JSON line on stdin: round, rank, processes, coordinator, resume, faults); set-up
(``jax.distributed``, the peer watch, the round's mesh and shardings); restore
(``training.checkpoint.resume``, its integrity check, Orbax's resharding restore); compile (AOT, a
persistent-cache hit on a mesh seen before, once per round on one machine); train (saves and the
stop-at-checkpoint decision at checkpoint steps).

Outcomes go to the agent as JSON lines over a pipe; the exit code says how it ended
(``training.elastic.codes.WorkerExit``).  On any error it reports the error line and leaves at once
with ``os._exit``, as it does (from the watch's thread, even inside a collective) when the peer
watch sees another process go: a clean ``jax.distributed`` shutdown would wait for the lost peer.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn

from training import procctl
from training.checkpoint.resume import DataPosition
from training.checkpoint.steps import is_committed
from training.elastic import ahead, compile_once
from training.elastic.codes import WorkerExit
from training.elastic.cpu_slice import TransportThreads
from training.elastic.peerwatch import looks_like_a_lost_peer
from training.elastic.wire import ReportType, report
from training.ready import wait_ready
from training.storage import scheme


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its agent dies (Linux), and check it has not already."""
    parent = int(os.environ.get("RTRAIN_AGENT_PID", "0"))
    try:
        procctl.prctl(procctl.PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the pipe to the agent still breaks when it dies
        pass
    if parent and os.getppid() != parent:
        os._exit(WorkerExit.ERROR)


class Reporter:
    """JSON lines to the agent through the pipe it passed (``RTRAIN_CONTROL_FD``)."""

    def __init__(self) -> None:
        fd = int(os.environ["RTRAIN_CONTROL_FD"])
        self.pipe = os.fdopen(fd, "w", buffering=1)
        self.rank = -1
        self.round = -1
        self.lock = threading.Lock()  # the loop and the peer watch's thread both report

    def send(self, type_: ReportType, *, everyone: bool = False, **fields: Any) -> None:
        """Report to the agent; most reports come from rank 0 only (``everyone``: from every rank)."""
        if self.rank != 0 and not everyone:
            return
        line = report(type_, self.round, self.rank, **fields).line()
        with self.lock:
            self.pipe.write(line)
            self.pipe.flush()


@dataclass(frozen=True)
class Assignment:
    round: int
    rank: int
    processes: int
    coordinator: str
    bind: str
    resume: str
    faults: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    watch_port: int = 0  # process 0: the peer watch's port (0: a free one)
    job: str = ""  # the job this round belongs to (its kept compiled steps are its own)

    @classmethod
    def read(cls, stream: Any) -> Assignment:
        line = stream.readline()
        if not line:
            os._exit(0)  # the agent closed the pipe before assigning anything: not needed
        a = json.loads(line)
        return cls(
            int(a["round"]),
            int(a["rank"]),
            int(a["processes"]),
            str(a["coordinator"]),
            str(a.get("bind") or ""),
            str(a["resume"]),
            tuple(a.get("faults") or ()),
            tuple(sorted((str(k), str(v)) for k, v in (a.get("env") or {}).items())),
            int(a.get("watch_port") or 0),
            str(a.get("job") or ""),
        )


# This process's hits in JAX's persistent compilation cache, by the thread that compiled (JAX reports a hit
# in the thread that looked it up): the step, a new model's init and the steps compiled ahead run side by side.
CACHE_HITS: collections.Counter[int] = collections.Counter()
# This process's CPU time (all its threads) when it was assigned its round.
CPU_AT_ASSIGNMENT = [0.0]


def count_cache_hits() -> None:
    """Count this process's persistent compilation cache hits in :data:`CACHE_HITS`."""
    from jax import monitoring

    def on_event(event: str, **_: str | int) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            CACHE_HITS[threading.get_ident()] += 1

    monitoring.register_event_listener(on_event)


def cache_hits() -> int:
    """The persistent cache hits of the calling thread's compiles."""
    return CACHE_HITS[threading.get_ident()]


def share_cpu_compilation_cache() -> None:
    """Let every process of a CPU slice find the program process 0 compiled.

    JAX keys its persistent compilation cache on, among others, the devices'
    topology fingerprint, and only process 0 writes entries.  On TPU the
    fingerprint is the slice's, the same in every process, so all of them hit
    process 0's entry.  On CPU each process's fingerprint describes its own
    devices, so every other process misses and compiles again after each
    restart, and the group's first step waits for the slowest compile.  Here the
    CPU key is made of the global device ids instead, as TPU's is in effect:
    the same SPMD program, the same key.  Nothing changes for other platforms.
    """
    from jax._src import cache_key

    original = cache_key._hash_accelerator_config

    def global_devices(hash_obj: Any, accelerators: Any) -> None:
        devices = list(accelerators.flat)
        if devices and all(d.platform == "cpu" for d in devices):
            hash_obj.update(repr(sorted((d.id, d.process_index) for d in devices)).encode())
        else:
            original(hash_obj, accelerators)

    cache_key._hash_accelerator_config = global_devices


# This process's end of the round's peer watch (:mod:`training.elastic.peerwatch`), once it has one.
WATCH: Any = None
# How long process 0, at the end of its program (finished, or stopped at a checkpoint), waits for the
# others to go first: they may still be finishing the last save, and its coordination service goes with it.
OUTLAST_S = 60.0
# How long an error that looks like a vanished peer's waits for the peer watch to name it.
PEER_CONFIRM_S = 0.5
# This process's local checkpoint tier (:class:`training.checkpoint.local.LocalTier`), once it has one, and how
# long a process that leaves lets its local copy in flight finish: a round that breaks keeps that copy.
TIER: Any = None
LOCAL_WRITE_GRACE_S = 2.0


def leave(rep: Reporter, code: WorkerExit, error: str = "", **fields: Any) -> NoReturn:
    """Report and exit at once.  An orderly end says bye to the peer watch first; an error does not,
    so the round's other processes leave at once too instead of waiting in a collective for this one."""
    if WATCH is not None:
        if code not in (WorkerExit.ERROR, WorkerExit.TASK):
            WATCH.bye()
        elif "peer_lost" not in fields and (
            # The collective's broken connection can reach this thread before the watch's own: give the watch
            # a moment to name the peer, not to report a failure of ours.
            WATCH.lost is not None or (looks_like_a_lost_peer(error) and WATCH.wait_lost(PEER_CONFIRM_S))
        ):
            # This error is what a vanished peer left behind (a collective that failed, the task's code's own
            # computation too): say so, and the job recovers from it.
            code = WorkerExit.ERROR
            peer, why = WATCH.lost
            fields["peer_lost"] = peer
            error = f"{error} (peer process {peer} is gone: {why})"
    if TIER is not None:
        TIER.finish_writing(LOCAL_WRITE_GRACE_S)  # before the report: the agent describes what is on disk
    if error:
        try:
            rep.send(ReportType.ERROR, everyone=True, error=error, **fields)
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


@dataclass
class Warm:
    """What a standby made ready before its assignment: the run's store and config, the task and its data."""

    store: Any = None
    cfg: Any = None
    built: Any = None  # the task and its data (taskbuild.Built); None: built once the round has joined
    failure: BaseException | None = None  # the warm-up failed: raised once this worker has a round


def import_libraries() -> None:
    """Import what a round needs (JAX, Orbax, the trainer, the tasks), while nothing waits for this process.

    Imports only: no JAX backend, no threads, so a process that did this can still be forked
    (:mod:`training.elastic.forkserver`)."""
    # Orbax's optional Cloud Logging logger is not used here: with its library marked absent, orbax leaves
    # it out (it guards that import), and each worker is spared 0.4 s of importing at its start.
    sys.modules.setdefault("google.cloud.logging", None)  # type: ignore[arg-type]  # None: "absent"
    import jax  # noqa: F401

    import training.checkpoint.manager
    import training.tasks.lm  # the built-in task (a user's task module is imported with the config)
    import training.trainer  # noqa: F401


def warm_up(run: str, warm: Warm) -> None:
    """Imports, the run's config, the compilation cache, the task and its (checked) data, into ``warm``.

    The task is built here only if that leaves JAX's backend untouched (:mod:`training.elastic.taskbuild`):
    the backend is fenced off in every thread of this process until the round has joined.
    """
    import_libraries()
    import jax

    from training.config import config_from_json
    from training.elastic.taskbuild import build_in_standby, fence_backend
    from training.layout import CONFIG
    from training.storage import open_store

    fence_backend()  # in every thread of this process; lifted in set_up, once the round has joined
    warm.store = open_store(run)
    cfg = warm.cfg = config_from_json(warm.store.get(CONFIG).decode())
    # The persistent compilation cache makes a relaunch on a mesh seen before skip XLA compilation.
    jax.config.update("jax_compilation_cache_dir", cfg.compilation_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    share_cpu_compilation_cache()
    count_cache_hits()
    compile_once.watch_cache_hits()  # to serialize a program from the cache whole (compile_once.whole)
    # For the saves' reports: measured in the idle class, off the path to the round's first step (a save
    # that comes first measures it itself).
    threading.Thread(target=measure_copy_bandwidth, name="rtrain-bandwidth", daemon=True).start()
    try:
        warm.built = build_in_standby(cfg)
    except Exception as e:  # noqa: BLE001 - raised once this worker has a round, and reported then
        warm.failure = e


WARM_UP_THREAD = "rtrain-warm-up"  # the OS name of a standby's warm-up thread (as ``top -H`` shows it)


def name_this_thread(name: str) -> None:
    """Give the calling thread an OS name (Linux: up to 15 bytes); a no-op elsewhere."""
    with contextlib.suppress(OSError):
        procctl.prctl(procctl.PR_SET_NAME, name.encode()[:15])


def measure_copy_bandwidth() -> None:
    """This host's memory copy bandwidth (:func:`training.checkpoint.manager.copy_bandwidth`), in the idle class."""
    from training.background import idle_this_thread
    from training.checkpoint.manager import copy_bandwidth

    idle_this_thread()
    copy_bandwidth()


def warm_up_in_background(run: str, warm: Warm) -> threading.Thread:
    """:func:`warm_up` in a thread of the idle class: a standby started beside a training round.

    The round's first steps come first; the warm-up takes the CPU they leave.  Only
    this thread is lowered (and the threads it starts): the main thread, which runs
    the round once assigned, keeps its priority, which an unprivileged process
    could not raise again.  Numpy is imported first, here, so its BLAS threads are
    started at the main thread's priority.
    """
    import numpy  # noqa: F401

    from training.background import idle_this_thread

    def run_lowered() -> None:
        idle_this_thread()
        name_this_thread(WARM_UP_THREAD)
        try:
            warm_up(run, warm)
        except BaseException as e:  # noqa: BLE001 - raised once this worker has a round, and reported then
            warm.failure = e

    thread = threading.Thread(target=run_lowered, name="warm-up", daemon=True)
    thread.start()
    return thread


def main() -> int:
    die_with_parent()
    Notice.install()  # from now on a SIGTERM is a preemption notice: stop at a step boundary, save, leave
    rep = Reporter()
    run = os.environ["RTRAIN_RUN_URI"]
    host, job = os.environ.get("RTRAIN_HOST", "?"), os.environ.get("RTRAIN_JOB", "?")
    procctl.set_title(procctl.job_title("standby", run, job, host), name="rtrain-worker")

    # --- 1. warm-up ----------------------------------------------------------------------------
    warm, warming = Warm(), None
    if os.environ.get("RTRAIN_WARM_BACKGROUND") == "1":
        warming = warm_up_in_background(run, warm)
    else:
        warm_up(run, warm)

    # --- 2. assignment -------------------------------------------------------------------------
    a = Assignment.read(sys.stdin)
    rep.rank, rep.round = a.rank, a.round
    procctl.set_title(procctl.job_title("worker", run, a.job or job, host, f"r{a.round}"))
    if warming is not None:
        warming.join()
    try:
        if warm.failure is not None:
            raise warm.failure
        from training.checkpoint.ledger import Ledger

        return train(warm.cfg, run, warm.store, a, rep, warm.built, Ledger(warm.store))
    except BaseException as e:  # noqa: BLE001 - every error leaves the same way: reported, at once
        traceback.print_exc()  # the whole traceback, a task's own code's included, in this worker's log
        code, line = error_line(e)
        leave(rep, code, line)


def error_line(e: BaseException) -> tuple[WorkerExit, str]:
    """How a worker leaves on ``e``, and the one line it reports.

    An exception from the task's own code, at any stage (its import, its factory, ``init``, ``loss``,
    ``data()``...), ends the job at once (``TASK``): another round would run the same code again.
    """
    from training.data.errors import DatasetError
    from training.tasks import TaskError

    text = str(e).strip()
    if isinstance(e, TaskError):
        return WorkerExit.TASK, text
    first = text.splitlines()[0] if text else ""
    if isinstance(e, DatasetError):
        return WorkerExit.ERROR, f"dataset: {first}"
    return WorkerExit.ERROR, f"{type(e).__name__}: {first}"


def train(cfg: Any, run: str, store: Any, a: Assignment, rep: Reporter, built: Any, ledger: Any) -> int:
    """One round of this process: set up, restore, compile, then train until done, a notice or a stop request.

    ``built``: the task and its data, as the standby built them (None: built in the set-up, once joined).
    """
    t_assigned, CPU_AT_ASSIGNMENT[0] = time.time(), time.process_time()
    trainer, mngr, built = set_up(cfg, run, a, rep, built, t_assigned)
    task, task_data = built.task, built.data
    pins = Pins(store, a.rank, a.round)
    with ThreadPoolExecutor(1, thread_name_prefix="rtrain-step") as pool:
        making = pool.submit(make_step, cfg, trainer, store, a)  # while the state is restored
        start = restore(cfg, run, a, rep, trainer, mngr, ledger, task_data.fingerprint, pins)
        batches = FirstAhead(train_batches(cfg, a, task_data, start.next_batch))  # read while the step compiles
        t0 = time.time()
        step = making.result()
    rep.send(
        ReportType.COMPILED,
        step=start.step,
        seconds=time.time() - t0,
        compile_s=round(step.seconds, 3),
        cache_hit=step.cache_hit,
        loaded=step.loaded,
    )
    saver = Saver(run, mngr, rep, pins, trainer.abstract, background=cfg.async_checkpoint)
    loop = RoundLoop(cfg, store, a, rep, trainer, saver, start, t_assigned, task, step)
    return loop.run(task_data, batches)


@dataclass(frozen=True)
class StepMade:
    """How the round's step was made: loaded as this job kept it, or compiled (from the cache or not)."""

    loaded: bool
    cache_hit: bool
    seconds: float  # its own time, mostly hidden behind the restore it ran beside
    key: str | None  # its program's key (compile_once.program_key); None where this process did not lower it
    compiled: compile_once.Compiled | None  # as compiled here, to keep; None when loaded (kept, or passed on)


def make_step(cfg: Any, trainer: Any, store: Any, a: Assignment) -> StepMade:
    """Load the round's step as this job kept it (``compile_ahead``), else compile it (once in the round, on one
    machine: :mod:`training.elastic.compile_once`); run beside the restore."""
    t0, hits = time.time(), cache_hits()
    kept = load_kept(store, a, trainer) if ahead.enabled(cfg) else None
    loaded, key, compiled = kept is not None, kept.key if kept is not None else None, None
    if share_compiles(cfg, a):
        if a.rank == 0:
            compile_once.forget_earlier_rounds(store, a.job, a.round)
        if a.rank == 0 or not loaded:
            shared = compile_shared(cfg, store, a, "step", None if loaded else trainer.lower)
            if shared.compiled is not None:
                trainer.load(shared.compiled)
            loaded, key, compiled = loaded or shared.passed, shared.key or key, shared.made
    elif not loaded:
        lowered = trainer.lower()
        key = compile_once.program_key(lowered)
        compiled = compile_once.compile_here(lowered, None, cache_hits)
        trainer.load(compiled.executable)
    return StepMade(loaded, loaded or cache_hits() > hits, time.time() - t0, key, compiled)


def share_compiles(cfg: Any, a: Assignment) -> bool:
    """Whether the round's programs are compiled once, by process 0 (:mod:`training.elastic.compile_once`)."""
    return compile_once.enabled(cfg.backend, a.processes) and bool(a.job)


@dataclass(frozen=True)
class Shared:
    """A round's program compiled once (:func:`compile_shared`), as this process got it."""

    compiled: Any | None  # None: process 0 had the program already
    passed: bool  # loaded as process 0 compiled it
    key: str | None  # the program's key (compile_once.program_key, with its options); None where not known
    made: compile_once.Compiled | None = None  # process 0: as it compiled it


def compile_shared(
    cfg: Any,
    store: Any,
    a: Assignment,
    name: str,
    lower: Callable[[], Any] | None,
    options: dict[str, Any] | None = None,
) -> Shared:
    """Program ``name`` of the round, compiled once (:mod:`training.elastic.compile_once`) with the XLA ``options``.

    Process 0 lowers it (``lower``; None: it has the program already), announces its key, compiles it (or
    loads it from the persistent cache) and passes it on, serialized whole.  The others wait for it and load
    it, without lowering it at all; they lower and compile it themselves only when process 0 passes nothing on.
    """
    if a.rank == 0:
        if lower is None:
            compile_once.publish(store, a.job, a.round, name, None)
            return Shared(None, False, None)
        lowered = lower()
        key = compile_once.program_key(lowered, options)
        compile_once.announce(store, a.job, a.round, name, key)
        compiled = compile_once.compile_here(lowered, options, cache_hits)
        compile_once.publish(store, a.job, a.round, name, compiled.whole(cfg.compilation_cache))
        return Shared(compiled.executable, False, key, compiled)
    assert lower is not None
    wait_s = cfg.hang_timeout_s / 2
    announced = compile_once.announced(store, a.job, a.round, name, wait_s)
    got = None if announced is None else compile_once.fetch(store, a.job, a.round, name, wait_s=wait_s)
    if got is None:
        print(f"round {a.round} process {a.rank}: {name} compiled here: process 0 passed none on", file=sys.stderr)
        lowered = lower()
        return Shared(lowered.compile(compiler_options=options), False, compile_once.program_key(lowered, options))
    print(
        f"round {a.round} process {a.rank}: {name} loaded as process 0 passed it on, not lowered here", file=sys.stderr
    )
    return Shared(got, True, announced)


def init_once(cfg: Any, trainer: Any, store: Any, a: Assignment) -> Any:
    """A new model's state: its initialisation compiled once in the round (:mod:`training.elastic.compile_once`)."""
    if share_compiles(cfg, a):
        shared = compile_shared(cfg, store, a, "init", trainer.lower_init, trainer.init_compiler_options())
        trainer.load_init(shared.compiled)
    state = trainer.init()
    load = getattr(trainer.task, "initial_params", None)
    if cfg.init_from and load is not None:  # the optimizer's new state does not depend on the values
        state = {**state, "params": load(trainer.abstract["params"])}
        print(f"round {a.round} process {a.rank}: parameters from {cfg.init_from}", file=sys.stderr)
    return state


def load_kept(store: Any, a: Assignment, trainer: Any) -> ahead.Kept | None:
    """Load the step this job kept for a round of this size (``ahead``), if any (None when none was loaded)."""
    try:
        kept = ahead.load(store, a.job, a.processes) if a.job else None
    except Exception as e:  # noqa: BLE001 - compiled as usual instead (a hit in the persistent cache)
        print(f"could not load the kept step for {a.processes} hosts: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    if kept is not None:
        trainer.load(kept.compiled)
    return kept


def train_batches(cfg: Any, a: Assignment, task_data: Any, next_batch: int) -> Iterator[dict[str, Any]]:
    """This process's training batches from global batch ``next_batch`` on (the exact data position)."""
    from training.data import pipeline

    return pipeline.batches(
        task_data.train,
        seed=cfg.seed,
        global_batch=cfg.global_batch,
        process_index=a.rank,
        process_count=a.processes,
        start_batch=next_batch,
    )


class FirstAhead:
    """An iterator whose first item is read by a thread of its own at once: the input pipeline starts (its
    threads, its first reads) while the step compiles, not in the round's first step."""

    def __init__(self, it: Iterator[dict[str, Any]]) -> None:
        self.it = it
        self.first: list[dict[str, Any]] = []
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

    def __next__(self) -> dict[str, Any]:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            if self.error is not None:
                raise self.error
            return self.first.pop()
        return next(self.it)


JOIN_S = 120  # how long a process of a round has to join it (jax.distributed), from its set-up on


def wait_until_listening(address: str, timeout: float) -> bool:
    """Wait until something accepts connections at ``host:port`` (process 0's coordination service); False if
    nothing did in ``timeout`` s.

    A process that calls ``jax.distributed.initialize`` before process 0 listens is refused, and its client
    tries again only after gRPC's reconnect backoff (about a second): the whole round then starts that much
    later.  Dialling until the port answers, then initialising, joins within milliseconds of process 0.
    """
    import socket

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return True
        except OSError:  # refused, or the name does not resolve yet
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)


def set_up(cfg: Any, run: str, a: Assignment, rep: Reporter, built: Any, t_assigned: float) -> tuple[Any, Any, Any]:
    """Join the round (``jax.distributed``, the peer watch) and build its mesh, trainer and checkpoint manager;
    the task too, if the standby left it (``built`` None: it reaches for JAX's backend); those and the task.

    On a CPU slice, the collectives' transport threads (started with the backend) get the lowest priority.
    """
    import jax

    from training import trainer as tr
    from training.checkpoint import manager as ckpt
    from training.elastic import taskbuild
    from training.mesh import build_mesh, check_batch, plan_mesh

    os.environ.update(dict(a.env))  # e.g. MEGASCALE_* for TPU multislice: read when the backend starts, below
    transport = None
    if a.processes > 1:
        # JAX's own preemption notifier would take SIGTERM from our handler (Notice): the notice reaches the
        # whole group through the next step's flags instead, with no extra synchronisation per step.
        jax.config.update("jax_enable_preemption_service", False)
        deadline = time.monotonic() + JOIN_S  # one deadline for dialling process 0 and joining through it
        if a.rank != 0:
            wait_until_listening(a.coordinator, timeout=JOIN_S)
        jax.distributed.initialize(
            a.coordinator,
            a.processes,
            a.rank,
            coordinator_bind_address=a.bind or None,  # process 0 listens on this host's address only
            heartbeat_timeout_seconds=10,
            initialization_timeout=max(1, round(deadline - time.monotonic())),
            # The round says every process's place: JAX must not probe the cluster for it (in a pod it would
            # ask the Kubernetes API, which needs a service account token and pod-reading rights).
            cluster_detection_method="deactivate",
        )
        watch_peers(a, rep)
        transport = TransportThreads()  # before the backend starts (build_mesh): gloo's threads come with it
    if taskbuild.lift_fence():  # something reached for the backend in the standby: the task is built again
        built = None
    from training.gke.manifests import is_round_env

    rep.send(
        ReportType.WORKER_STARTED,
        everyone=True,
        seconds=time.time() - t_assigned,
        host=os.environ.get("RTRAIN_HOST"),
        pid=os.getpid(),
        # The TPU identity and Multislice values the runtime started with (this round's, none left of another).
        runtime_env={k: v for k, v in sorted(os.environ.items()) if is_round_env(k)},
    )
    plan = plan_mesh(cfg, a.processes)
    check_batch(cfg, plan)
    mesh = build_mesh(plan)
    if transport is not None and mesh.devices.flat[0].platform == "cpu":  # another platform's threads are its own
        transport.lower()
    if built is None:  # the task reached for JAX's backend in the standby: now that the round has joined, it may
        t0 = time.perf_counter()
        built = taskbuild.build(cfg)
        print(
            f"round {a.round} process {a.rank}: the task reached for JAX in the standby: built after the join, "
            f"in {time.perf_counter() - t0:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    return tr.Trainer(cfg, mesh, built.task), ckpt.checkpoint_manager(cfg, run), built


@dataclass
class Start:
    """Where a round starts: the train state, the step it holds (None: a new model), the data position."""

    state: Any
    restored: int | None
    next_batch: int
    lr_scale: float
    skipped: list[list[int]]
    dataset: str  # the fingerprint of the data trained on
    tier: Any  # this host's local checkpoint tier (None: off)
    chaos: Any  # the faults this process fires

    @property
    def step(self) -> int:
        return int(self.restored or 0)


def restore(
    cfg: Any, run: str, a: Assignment, rep: Reporter, trainer: Any, mngr: Any, ledger: Any, dataset: str, pins: Pins
) -> Start:
    """The round's starting point: a local copy, a committed checkpoint (resharded onto this mesh), or a new model.

    Every process computes the same decision from the same objects (committed steps, ledger,
    the round's local candidates and every process's verdict on its own copies).
    """
    from training.checkpoint.local import LocalTier, host_dir, parse_resume
    from training.checkpoint.resume import ResumeError, choose_resume
    from training.checkpoint.steps import committed_steps
    from training.elastic.chaos import WorkerChaos

    t0 = time.time()
    shape = trainer.mesh.shape
    local_dir = host_dir(cfg.local_checkpoint_dir, run, a.job, os.environ["RTRAIN_HOST"])
    global TIER
    tier = LocalTier(local_dir, cfg.local_keep, trainer.mesh, trainer.abstract) if cfg.local_checkpoint_every else None
    TIER = tier
    on = tier is not None and tier.enabled
    chaos = WorkerChaos(
        list(a.faults), a.rank, rep.send, local_dir, (lambda: settle_local(tier, rep, a)) if on else None
    )
    if tier is not None and not tier.enabled:
        rep.send(ReportType.LOCAL_TIER_OFF, reason=tier.reason)
    local_step = None
    if on and parse_resume(a.resume):
        # The leader judged "newer than any persistent checkpoint" from the ledger; a save that Orbax
        # finalised but whose record was not written yet (its process died) is a committed step too.
        try:
            persistent = choose_resume("latest", committed_steps(run), ledger.states(), None).step
        except ResumeError:
            persistent = None
        local_step = pick_local_step(parse_resume(a.resume), local_dir, a, rep, newer_than=persistent)
    decision = None
    if local_step is not None:
        assert tier is not None
        state, pos = tier.restore(local_step)
        step0: int | None = local_step
        rep.send(
            ReportType.RESTORE, step=local_step, tier="local", mesh=shape, workers=a.processes, seconds=time.time() - t0
        )
    else:
        try:
            resume = "latest" if a.resume.startswith("local:") else a.resume
            states = ledger.states()
            decision = choose_resume(resume, committed_steps(run), states, ledger.pointer_record())
        except ResumeError as e:
            leave(rep, WorkerExit.ERROR, str(e))
        step0 = decision.step
        if step0 is not None:
            state, pos = restore_persistent(run, step0, a, rep, trainer, mngr, ledger, states, pins)
            rep.send(
                ReportType.RESTORE,
                step=step0,
                tier="persistent",
                mesh=shape,
                workers=a.processes,
                seconds=time.time() - t0,
            )
        else:
            state, pos = init_once(cfg, trainer, pins.store, a), DataPosition(next_batch=0)
            rep.send(ReportType.INIT, step=0, mesh=shape, workers=a.processes, seconds=time.time() - t0)
    if step0 is not None and pos.get("dataset") not in (None, dataset):
        pos = data_changed(cfg, step0, pos, dataset, rep)
    if on:
        tier.forget_after(step0)  # type: ignore[union-attr]
    start = Start(
        state,
        step0,
        int(pos["next_batch"]),
        float(pos.get("lr_scale", 1.0)),
        list(pos.get("skipped", [])),
        dataset,
        tier,
        chaos,
    )
    if decision is not None and decision.hint is not None:
        follow_hint(start, decision.hint, rep)
    return start


def follow_hint(start: Start, hint: Any, rep: Reporter) -> None:
    """A rollback's hint for the resumed round: skip to its batch, scale the learning rate; reported."""
    if hint.skip_to_batch is not None and hint.skip_to_batch > start.next_batch:
        start.skipped.append([start.next_batch, hint.skip_to_batch])
        start.next_batch = hint.skip_to_batch
    start.lr_scale *= hint.lr_scale
    rep.send(
        ReportType.RESUMED_WITH,
        step=start.step,
        next_batch=start.next_batch,
        lr_scale=start.lr_scale,
        skipped=start.skipped,
    )


def data_changed(cfg: Any, step: int, pos: DataPosition, dataset: str, rep: Reporter) -> DataPosition:
    """The data position to go on from when checkpoint ``step`` was trained on another dataset (or leave)."""
    if cfg.on_dataset_change != "restart":
        leave(
            rep,
            WorkerExit.ERROR,
            f"checkpoint {step} was trained on dataset {pos.get('dataset')}, not {dataset} "
            "(on_dataset_change=restart continues on the new data)",
        )
    # Continual training on refreshed data: the model goes on, the data position starts over.
    rep.send(ReportType.DATA_REFRESHED, step=step, old=pos.get("dataset"), new=dataset)
    return DataPosition(next_batch=0, lr_scale=pos.get("lr_scale", 1.0))


def restore_persistent(
    run: str,
    step: int,
    a: Assignment,
    rep: Reporter,
    trainer: Any,
    mngr: Any,
    ledger: Any,
    states: dict[int, dict[str, Any]],
    pins: Pins,
) -> tuple[Any, DataPosition]:
    """Committed checkpoint ``step``, checked and resharded onto this round's mesh, and its data position.

    A checkpoint whose files fail their check, or whose data cannot be read, is reported corrupt and
    the worker leaves (the leader then resumes from an older one).
    """
    from training.checkpoint import manager as ckpt
    from training.checkpoint.retention import USABLE_STATES

    check_integrity(run, step, ledger, a, rep)
    pins.pin(step, "restore")
    try:
        state, pos = ckpt.restore(mngr, step, trainer.abstract)
    except Exception as e:  # noqa: BLE001 - unreadable data is a corrupt checkpoint; anything else an error
        if looks_unreadable(e):
            rep.send(ReportType.CORRUPT, step=step, reason=f"restore failed: {str(e).strip().splitlines()[0]}")
            leave(rep, WorkerExit.CORRUPT)
        raise
    pins.unpin(step)
    if a.rank == 0 and str(states.get(step, {}).get("state", "committed")) not in USABLE_STATES:
        # A later save of a step whose unusable one was moved out: its commit is on record from now on.
        ledger.record(step, "committed", reason="committed by Orbax; its writer did not live to record it")
    return state, pos


def settle_local(tier: Any, rep: Reporter, a: Assignment) -> None:
    """Finish this host's local saves in flight and report each one."""
    tier.wait()
    for done, seconds in tier.finished():
        rep.send(ReportType.LOCAL_CHECKPOINT, everyone=True, step=done, seconds=seconds, round=a.round)


class RoundLoop:
    """The training loop of one round: steps, the guard, saves of both tiers, and the ways out.

    The loop never waits for the device on an ordinary step: the metrics of step N are read
    (a host sync) after step N+1 is dispatched, so the device always has the next step queued.
    Before a persistent save, the newest step is read too: the guard decides before any save.
    """

    def __init__(
        self,
        cfg: Any,
        store: Any,
        a: Assignment,
        rep: Reporter,
        trainer: Any,
        saver: Saver,
        start: Start,
        t_assigned: float,
        task: Any,
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
            examples_consumed=(self.next_batch - sum(end - start for start, end in self.skipped)) * cfg.global_batch,
            global_batch=cfg.global_batch,
            seed=cfg.seed,
            dataset=self.dataset,
            lr_scale=self.lr_scale,
            skipped=self.skipped,
        )

    def run(self, task_data: Any, batches: Iterator[dict[str, Any]]) -> int:
        """Train to the last step (0), or leave: a notice, a guard verdict, a stop request at a checkpoint."""
        cfg, a = self.cfg, self.a
        self.validation = task_data.validation
        self.loop = Loop(cfg, self.rep, self.t_assigned, self.step, self.tokens_per_example)
        background_at = self.step + 2  # once the round's first step was read (below): it comes first
        while self.step < cfg.steps:
            self.one_step(batches)
            if (self.step + 1) % cfg.checkpoint_every == 0 and self.step + 1 < cfg.steps:
                self.stop_vote = StopVote.cast(self.store, self.a, self.step + 1)  # read at that save, not waited for
            save_now = self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps
            # Due by the config and the step alone, the same in every process (a process whose local
            # write failed has its tier off, and skips only the write).
            local_due = not save_now and self.tier_planned and self.step % cfg.local_checkpoint_every == 0
            # Read every step but the newest; before a persistent save (or at the end), the newest too: the
            # guard passes every step before it is saved.  A local copy is staged instead, and written once
            # its step is read.  Decided by the step alone, the same in every process: a process that read
            # the newest step (and saw a notice in it) a step before the others would stop while they train on.
            verdict = self.observe(keep=0 if save_now else 1)
            self.check(verdict.bad)
            if self.step == background_at:
                self.start_background()
            if verdict.notice and self.step < cfg.steps:
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
            elif local_due and self.tier_on and self.tier.can_save():  # each process's copy is its own
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
    def tier_on(self) -> bool:
        return self.tier is not None and self.tier.enabled

    @property
    def tier_planned(self) -> bool:
        """The tier could help on this round's mesh (the same in every process)."""
        return self.tier is not None and not self.tier.off_for_mesh

    def one_step(self, batches: Iterator[dict[str, Any]]) -> None:
        """Dispatch the next step (its metrics are read later), with its faults and its data ids traced if asked."""
        from training.layout import TRACE

        self.chaos.before_step(self.step)
        step_lr = self.lr_scale * self.chaos.learning_rate_scale(self.step)
        local = next(batches)  # after the step's faults: a notice they send has the batch's time to land
        if self.cfg.trace_data_ids:
            self.store.put(
                f"{TRACE}{self.step:08d}/a{self.a.round:03d}-p{self.a.rank:03d}.json",
                json.dumps({"ids": [int(i) for i in local["ids"]], "processes": self.a.processes}).encode(),
            )
        global_batch = self.trainer.global_batch(local)
        self.state, metrics = self.trainer.step(self.state, global_batch, step_lr, notice=NOTICE.at is not None)
        self.step += 1
        self.next_batch += 1
        self.loop.dispatched(self.step, metrics, self.next_batch)

    def check(self, bad: dict[str, Any] | None) -> None:
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
        if self.cfg.validate_on == "slice":
            self.evaluate_saved()
        vote, self.stop_vote = self.stop_vote, None
        stop = vote.agreed() if vote is not None and vote.step == self.step else None
        if self.step < self.cfg.steps and (stop if stop is not None else stop_requested(self.store, self.a)):
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
                batch=cfg.val_batch,
                max_batches=cfg.val_batches,
                process_index=a.rank,
                process_count=a.processes,
            )
            self.eval_batches = [self.trainer.global_batch(b, size=cfg.val_batch) for b in local]
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


@dataclass
class Verdict:
    bad: dict[str, Any] | None = None  # the guard's finding: step, metric, value, reason, next_batch
    notice: bool = False  # some process of the group was told to stop


class Loop:
    """The steps in flight, read one step late: the guard, the metrics and progress reports."""

    def __init__(self, cfg: Any, rep: Reporter, t_assigned: float, step: int, tokens_per_example: int) -> None:
        self.cfg = cfg
        self.rep = rep
        self.t_assigned = t_assigned
        self.inflight: list[tuple[int, dict[str, Any], int]] = []
        self.recent: list[float] = []  # read losses, for the spike guard's running median
        self.first = True
        self.t_last = time.time()
        self.since = 0  # steps read since the last progress report
        self.tokens_per_step = cfg.global_batch * tokens_per_example
        self.bad: dict[str, Any] | None = None
        self.passed: int | None = None  # the newest step read that the guard passed
        self.notice = False
        self.local_saves: list[float] = []

    def dispatched(self, step: int, metrics: dict[str, Any], next_batch: int) -> None:
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
            why = guard_verdict(loss, self.recent, self.cfg.spike_factor, self.cfg.spike_window)
            if why:
                self.bad = {"step": step, "metric": "loss", "value": loss, "reason": why, "next_batch": next_batch}
                break
            self.passed = step
            self.recent.append(loss)
            del self.recent[: -self.cfg.spike_window]
            self.notice = self.notice or m["notice"] > 0
            self.since += 1
            step_time = (now - self.t_last) / self.since
            values = {k: v for k, v in m.items() if k != "notice"}  # the engine's and the task's own metrics
            self.rep.send(ReportType.METRICS, step=step, step_time=step_time, loss=loss, values=values)
            common: dict[str, Any] = {k: values[k] for k in ("loss", "grad_norm", "accuracy", "lr") if k in values}
            if step % self.cfg.log_every == 0 or step == self.cfg.steps or self.first:
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


def pick_local_step(
    candidates: list[int], directory: Any, a: Assignment, rep: Reporter, newer_than: int | None = None
) -> int | None:
    """The newest candidate whose local copy every process holds intact (or None: the persistent tier).

    Each process checks its own copies against their manifests; the verdicts are
    gathered, so every process takes the same decision.  A copy that fails is
    stepped over, with an event naming it.  A candidate no newer than a committed
    persistent step (``newer_than``, as any process sees it) is not taken: the
    persistent tier has that state or a newer one.
    """
    import numpy as np

    from training.checkpoint.local import verify

    if not candidates:
        return None
    problems = [verify(directory, s) for s in candidates]
    ok = np.array([0 if p else 1 for p in problems] + [-1 if newer_than is None else newer_than], np.int32)
    if a.processes > 1:
        from jax.experimental import multihost_utils

        everyone = np.asarray(multihost_utils.process_allgather(ok)).reshape(a.processes, len(candidates) + 1)
    else:
        everyone = ok.reshape(1, -1)
    floor = int(everyone[:, -1].max())  # the newest committed persistent step any process sees (-1: none)
    chosen = next((s for i, s in enumerate(candidates) if s > floor and everyone[:, i].all()), None)
    for s, problem in zip(candidates, problems, strict=True):
        if problem and (chosen is None or s > chosen):  # stepped over (older candidates were not needed)
            rep.send(
                ReportType.LOCAL_CHECKPOINT_SKIPPED,
                everyone=True,
                step=s,
                host=os.environ.get("RTRAIN_HOST"),
                reason=problem,
            )
    return chosen


class Pins:
    """A running job pins the steps it reads or writes, so a pruner never deletes them underneath (rank 0)."""

    def __init__(self, store: Any, rank: int, round_: int) -> None:
        self.store = store
        self.rank = rank
        self.owner = f"worker{rank}-r{round_}-{os.getpid()}"
        self.keys: dict[int, str] = {}

    def pin(self, step: int, kind: str) -> None:
        from training.checkpoint.ledger import pin

        if self.rank == 0:
            self.keys[step] = pin(self.store, step, self.owner, kind)  # type: ignore[arg-type]

    def unpin(self, step: int) -> None:
        from training.checkpoint.ledger import unpin

        if step in self.keys:
            unpin(self.store, self.keys.pop(step))


class Saver:
    """The checkpoint pipeline: saves in a background thread, a commit reported once Orbax finalised it.

    A save costs the loop only the dispatch of a host copy of the state
    (:class:`training.checkpoint.manager.HostSnapshot`, compiled in the save thread after the round's first steps).
    Everything else happens in the save thread: the pin, Orbax's blocking part (its barriers,
    per-array bookkeeping and the transfer to host memory), then Orbax's own background write.
    Running Orbax off the loop's thread is safe because every barrier it takes is a barrier of the
    coordination service (see :func:`training.checkpoint.manager.checkpoint_manager`), never a device
    collective that could interleave with the training step's.  With ``async_checkpoint: false``
    the loop saves and waits itself, as it asked.

    Each commit reports what the save cost: the loop's pause (``blocking_s``), the save thread's
    share (``save_s``), the time to commit (``write_s``), and the bytes this process copied against
    the lower bound of that copy at the host's memory bandwidth (``copy_bound_s``).
    """

    def __init__(
        self, run: str, mngr: Any, rep: Reporter, pins: Pins, abstract: Any, *, background: bool = True
    ) -> None:
        from training.checkpoint.manager import BackgroundSave, packs_small, raise_failure, wait_saved

        self.run = run
        self.mngr = mngr
        self.rep = rep
        self.pins = pins
        self.pending: int | None = None
        self.last_saved: int | None = None
        self.committed_any = False
        self.bg = BackgroundSave(abstract, "rtrain-save", background=background, gather_small=packs_small(mngr))
        self.raise_failure, self.wait_saved = raise_failure, wait_saved  # a failed commit's error, seen every step
        self.nbytes: int | None = None
        self.cost: dict[str, Any] = {}

    def _commit(self, step: int) -> None:
        # An async save that failed raises here; a step is reported committed only when finalised.
        self.raise_failure(self.mngr)
        if not is_committed(self.run, step):  # that step alone: a listing of every step costs a look at each
            raise RuntimeError(f"checkpoint {step} did not commit (no finalised step directory){_why_not(self.mngr)}")
        cost, self.cost = self.cost, {}
        cost["write_s"] = round(time.time() - cost.pop("t0"), 4)
        self.rep.send(ReportType.CHECKPOINT, step=step, committed=True, **cost)
        self.pins.unpin(step)
        self.committed_any = True

    def _started(self, *, block: bool) -> bool:
        """Whether the save thread has handed the save to Orbax (its error, if any, raised here)."""
        started, took = self.bg.collect(block=block)
        if took is not None:
            self.cost["save_s"] = round(took, 4)
        return started

    def prepare_ahead(self) -> None:
        """Compile the save's host copy in the save thread now (after the round's first steps)."""
        self.bg.prepare_ahead()

    def poll(self) -> None:
        if self.pending is None or not self._started(block=False):
            return
        # A background write that failed (a full disk, a read-only root) raises now: Orbax may still count
        # the save as in progress, and the other processes wait for this one at its commit barrier.
        self.raise_failure(self.mngr)
        if not self.mngr.is_saving_in_progress():
            step, self.pending = self.pending, None
            self._commit(step)

    def wait(self) -> None:
        self._started(block=True)
        self.wait_saved(self.mngr)
        self.poll()

    def save(self, step: int, state: Any, data_pos: DataPosition, cfg: Any) -> None:
        from training.checkpoint import manager as ckpt

        if self.pending is not None:
            self.wait()
        t0 = time.time()
        if self.nbytes is None:
            self.nbytes = ckpt.local_bytes(state)  # the same at every save of this round's mesh
        nbytes, bandwidth = self.nbytes, ckpt.copy_bandwidth()
        self.cost = {
            "t0": t0,
            "bytes": nbytes,
            "copy_bound_s": round(nbytes / bandwidth, 6),
            "copy_GBps": round(bandwidth / 1e9, 2),
        }

        def start(state: Any) -> None:
            self.pins.pin(step, "save")
            ckpt.save(self.mngr, step, state, data_pos, cfg)

        self.pending = self.last_saved = step
        self.bg.start(start, state)
        blocking = time.time() - t0
        self.cost["blocking_s"] = round(blocking, 4)
        self.rep.send(ReportType.CHECKPOINT, step=step, committed=False, blocking_s=blocking)


def _why_not(mngr: Any) -> str:
    """A likely reason a save did not commit: a full disk (Orbax's background error does not always surface)."""
    directory = str(mngr.directory)
    if not scheme(directory).filesystem:  # no disk of ours to fill
        return ""
    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    return f": No space left on device ({free} bytes free)" if free < (1 << 20) else ""


def check_integrity(run: str, step: int, ledger: Any, a: Assignment, rep: Reporter) -> None:
    """Process 0 checks the step's files against its ledger record; every process learns the verdict."""
    import numpy as np
    from jax.experimental import multihost_utils

    from training.checkpoint.steps import verify

    problem = ""
    if a.rank == 0:
        record = ledger.state(step) or {}
        try:
            problem = verify(run, step, record.get("files"))
        except Exception as e:  # noqa: BLE001 - an unreadable step is as bad as a changed one
            problem = f"cannot check checkpoint {step}: {e}"
    bad = int(bool(problem))
    if a.processes > 1:
        bad = int(multihost_utils.broadcast_one_to_all(np.int32(bad)))
    if bad:
        if a.rank == 0:
            rep.send(ReportType.CORRUPT, step=step, reason=problem)
        leave(rep, WorkerExit.CORRUPT)


def looks_unreadable(e: BaseException) -> bool:
    """A restore error about the checkpoint's own bytes (not a vanished peer)."""
    text = f"{type(e).__name__} {e}".lower()
    return any(k in text for k in ("data_loss", "not_found", "error reading", "error opening", "corrupt", "decode"))


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


def watch_peers(a: Assignment, rep: Reporter) -> None:
    """Join the round's peer watch: when another process of the round is gone, this one leaves at once."""
    global WATCH
    from jax._src import distributed  # JAX's coordination service client (no public accessor)

    from training.elastic import peerwatch

    def lost(peer: int, why: str) -> None:
        leave(rep, WorkerExit.ERROR, f"peer process {peer} of round {a.round} is gone: {why}", peer_lost=peer)

    coordinator_host = a.coordinator.rsplit(":", 1)[0]
    WATCH = peerwatch.start(
        distributed.global_state.client,
        a.rank,
        a.processes,
        lost,
        bind_host=(a.bind.rsplit(":", 1)[0] if a.bind else "") or coordinator_host,
        advertise_host=coordinator_host,
        port=a.watch_port,
    )


def stop_requested(store: Any, a: Assignment) -> bool:
    """Did the leader ask this round to stop at this checkpoint (to grow the group)?

    Only process 0 reads the request; its answer is broadcast so that every
    process stops at the same step.
    """
    return StopVote.cast(store, a, 0).agreed()


def _read_stop_request(store: Any, a: Assignment) -> int:
    from training.layout import CONTROL
    from training.storage import NotFound

    try:
        req = json.loads(store.get(CONTROL))
        return int(req.get("action") == "stop_at_checkpoint" and req.get("round") == a.round)
    except (NotFound, ValueError):
        return 0


def _sum_over_processes(x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.sum(x, dtype=x.dtype, axis=0)


class StopVote:
    """Process 0's reading of a stop request, broadcast to every process for the save at ``step``.

    Cast a step before that save and read at it: the broadcast runs on the devices between the two
    steps, so the save waits for no collective of its own (a blocking broadcast there held every
    process's loop for it at each save).
    """

    def __init__(self, step: int, flag: Any) -> None:
        self.step, self.flag = step, flag

    @classmethod
    def cast(cls, store: Any, a: Assignment, step: int) -> StopVote:
        import jax
        import numpy as np
        from jax.experimental import multihost_utils
        from jax.sharding import Mesh
        from jax.sharding import PartitionSpec as P

        flag = _read_stop_request(store, a) if a.rank == 0 else 0
        if a.processes == 1:
            return cls(step, flag)
        devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
        mesh = Mesh(devices, ("processes", "local_devices"))
        mine = multihost_utils.host_local_array_to_global_array(np.full((1,), flag, np.int32), mesh, P("processes"))
        with jax.set_mesh(mesh):
            return cls(step, jax.jit(_sum_over_processes, out_shardings=P())(mine))

    def agreed(self) -> bool:
        """Whether every process stops at the save (waits for the broadcast if it is still running)."""
        import jax

        if isinstance(self.flag, int):
            return bool(self.flag)
        return bool(int(jax.device_get(self.flag.addressable_data(0))))


def run_main() -> NoReturn:
    """Run this worker and leave with its exit code (a process started as one, or forked to be one)."""
    code = main()
    sys.stdout.flush()
    if WATCH is not None:
        WATCH.bye()  # finished, or stopped at a checkpoint, as the whole group did
        WATCH.outlast(OUTLAST_S)
    os._exit(code)


if __name__ == "__main__":
    run_main()
