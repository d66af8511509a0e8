"""The elastic agent: the supervisor that owns the worker processes of one job.

Level one of recovery (DESIGN.md §2).  A worker dies; the survivors'
collectives fail; the agent sees the exit at once (it waits on its children,
it does not poll a service once a minute), tears the group down, asks the
capacity source what is left, plans a mesh for it within
``min_workers..max_workers``, relaunches, and the workers restore the newest
committed checkpoint resharded onto the new mesh.  Capacity that comes back is
taken at the next checkpoint boundary.  ``max_failures`` bounds it all.

The agent is the only writer of the run's status and of the lifecycle events
(workers report to it through a pipe), so readers never see two writers race.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.capacity import CapacitySource, LocalCapacity
from training.chaos import WORKER_SIDE, parse_chaos
from training.config import Config, config_from_json
from training.events import EventLog, write_status
from training.ledger import Ledger, LockHeld, RunLock
from training.mesh import MeshPlan, choose_workers, plan_mesh
from training.storage import Store, open_store

POLL_S = 0.05
GUARD_EXIT = 17  # training.worker.GUARD_EXIT (not imported: the worker module imports JAX lazily)
LOCK_LEASE_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen[bytes]
    fd: int
    buf: bytes = b""
    eof: bool = False


@dataclass
class Outcome:
    kind: str  # finished | rescale | failure | guard
    reason: str = ""
    worker: int | None = None
    returncode: int | None = None
    detected_at: float = 0.0
    fault_at: float | None = None
    guard: dict[str, Any] | None = None


class LocalSlice:
    """The embedded backend: N simulated hosts, each a real JAX process with D CPU devices."""

    def __init__(self, cfg: Config, run_uri: str, log_dir: Path) -> None:
        self.cfg = cfg
        self.run_uri = run_uri
        self.log_dir = log_dir

    def launch(self, n: int, attempt: int, env_extra: dict[str, str]) -> list[Worker]:
        port = _free_port()
        logs = self.log_dir / f"attempt-{attempt:03d}"
        logs.mkdir(parents=True, exist_ok=True)
        workers = []
        for i in range(n):
            r, w = os.pipe()
            env = {
                **os.environ,
                **env_extra,
                "RTRAIN_RUN_URI": self.run_uri,
                "RTRAIN_COORDINATOR": f"127.0.0.1:{port}",
                "RTRAIN_NUM_PROCESSES": str(n),
                "RTRAIN_PROCESS_ID": str(i),
                "RTRAIN_ATTEMPT": str(attempt),
                "RTRAIN_CONTROL_FD": str(w),
                "JAX_PLATFORMS": "cpu",
                "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={self.cfg.devices_per_worker}",
                "TF_CPP_MIN_LOG_LEVEL": "2",
                "PYTHONUNBUFFERED": "1",
            }
            log = open(logs / f"worker-{i}.log", "wb")
            proc = subprocess.Popen(
                [sys.executable, "-m", "training.worker"],
                env=env,
                pass_fds=(w,),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # our own process group: a kill reaches its threads and children
            )
            log.close()
            os.close(w)
            os.set_blocking(r, False)
            workers.append(Worker(i, proc, r))
        return workers

    @staticmethod
    def kill(workers: list[Worker]) -> None:
        for w in workers:
            if w.proc.poll() is None:
                try:
                    os.killpg(w.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for w in workers:
            w.proc.wait()
            if not w.eof:
                w.eof = True
                os.close(w.fd)


@dataclass
class Agent:
    cfg: Config
    run_uri: str
    store: Store
    capacity: CapacitySource
    backend: LocalSlice
    display: Callable[[str], None] | None = print
    events: EventLog = field(init=False)
    status: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.events = EventLog(self.store, source="agent")
        self.ledger = Ledger(self.store)
        self.lock = RunLock(
            self.store, owner=f"agent-{socket.gethostname()}-{os.getpid()}", lease_s=LOCK_LEASE_S, events=self.events
        )
        self._lock_refreshed = 0.0
        self.faults = [parse_chaos(s) for s in self.cfg.chaos]
        self.fired = {e.get("spec") for e in self.events.read(types=("chaos",))}
        self.t_start = time.time()
        self._last_status = 0.0

    # --- status and events -----------------------------------------------------------
    def set_status(self, force: bool = True, **fields: Any) -> None:
        self.status.update(fields)
        now = time.time()
        if force or now - self._last_status > 1.0:
            write_status(self.store, **self.status)
            self._last_status = now

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        return self.events.emit(type_, **fields)

    def say(self, line: str) -> None:
        if self.display:
            self.display(line)

    # --- chaos applied by the agent (capacity changes) ------------------------------------
    def _capacity_faults(self, step: int | None) -> None:
        now = time.time() - self.t_start
        for f in self.faults:
            if f.action != "capacity" or f.spec in self.fired:
                continue
            due = (f.step is not None and step is not None and step >= f.step) or (
                f.get("after_s") is not None and now >= float(f.get("after_s") or 0)
            )
            if due:
                self.fired.add(f.spec)
                to = int(f.get("to") or 0)
                self.capacity.set(to, reason=f"chaos {f.spec}")
                self.emit("chaos", action="capacity", spec=f.spec, to=to)
                self.emit("capacity", available=to, reason="chaos")
                self.say(f"[chaos] capacity -> {to} hosts")

    def _worker_faults(self) -> list[str]:
        return [f.spec for f in self.faults if f.action in WORKER_SIDE and (f.repeats or f.spec not in self.fired)]

    # --- the main loop -----------------------------------------------------------------
    def run(self) -> int:
        try:
            self.lock.acquire()
        except LockHeld as e:
            self.say(f"[agent] refused: {e}")
            return 3
        self._lock_refreshed = time.monotonic()
        try:
            return self._run()
        finally:
            self.lock.release()

    def _run(self) -> int:
        cfg = self.cfg
        guards = 0
        failures = 0
        attempt = len(self.events.read(types=("launch",)))
        prev: MeshPlan | None = None
        resume = cfg.resume_from
        self.set_status(
            state="starting",
            run_uri=self.run_uri,
            steps_total=cfg.steps,
            failures=0,
            agent_pid=os.getpid(),
            host=socket.gethostname(),
            step=self.status.get("step", 0),
        )
        while True:
            n = self._wait_for_capacity()
            if n is None:
                reason = (
                    f"capacity stayed below min_workers={cfg.min_workers} for {cfg.capacity_timeout_s:.0f}s "
                    f"(available: {self.capacity.available()})"
                )
                self.emit("failed", reason=reason)
                self.set_status(state="failed", reason=reason)
                self.say(f"[agent] FAILED: {reason}")
                return 2
            plan = plan_mesh(cfg, n)
            if prev is not None and prev != plan:
                self.emit("resize", old_workers=prev.workers, new_workers=n, old_mesh=prev.shape, new_mesh=plan.shape)
                self.say(f"[agent] resize {prev.workers} -> {n} workers, mesh {prev.shape} -> {plan.shape}")
            self.emit("launch", attempt=attempt, workers=n, mesh=plan.shape, resume=resume)
            self.set_status(
                state="starting" if prev is None else "recovering", attempt=attempt, workers=n, mesh=plan.shape
            )
            self.say(
                f"[agent] launch attempt {attempt}: {n} workers x {cfg.devices_per_worker} devices, mesh {plan.shape}"
            )
            workers = self.backend.launch(
                n, attempt, {"RTRAIN_RESUME": resume, "RTRAIN_CHAOS": json.dumps(self._worker_faults())}
            )
            out = self._supervise(workers, attempt, plan)
            prev = plan
            attempt += 1
            resume = "latest"  # every relaunch resumes from the newest committed checkpoint
            if out.kind == "finished":
                self.emit(
                    "finished", step=self.status.get("step"), failures=failures, seconds=time.time() - self.t_start
                )
                self.set_status(state="finished")
                self.say(f"[agent] finished at step {self.status.get('step')} with {failures} failure(s)")
                return 0
            if out.kind == "rescale":
                continue
            if out.kind == "guard":
                guards += 1
                rc = self._guard_rollback(out.guard or {}, guards)
                if rc is not None:
                    return rc
                continue
            failures += 1
            self.emit(
                "failure",
                attempt=attempt - 1,
                reason=out.reason,
                worker=out.worker,
                returncode=out.returncode,
                fault_at=out.fault_at,
                detected_at=out.detected_at,
                detect_s=(out.detected_at - out.fault_at) if out.fault_at else None,
                failures=failures,
            )
            self.set_status(state="recovering", failures=failures)
            self.say(f"[agent] failure {failures}/{cfg.max_failures}: {out.reason}")
            if failures > cfg.max_failures:
                reason = (
                    f"failure budget spent: {failures} failures > max_failures={cfg.max_failures}; last: {out.reason}"
                )
                self.emit("failed", reason=reason)
                self.set_status(state="failed", reason=reason)
                self.say(f"[agent] FAILED: {reason}")
                return 1

    def _guard_rollback(self, guard: dict[str, Any], guards: int) -> int | None:
        """In-job rollback after a non-finite or spiking loss: back to the last good
        checkpoint, past the batches that led here.  Returns an exit code when the job
        must stop, None to relaunch."""
        from training.api import committed_steps

        cfg = self.cfg
        step, reason = int(guard.get("step", -1)), guard.get("reason", "bad loss")
        states = self.ledger.states()
        good = [
            s
            for s in committed_steps(self.run_uri)
            if s < step and states.get(s, {}).get("state") not in ("rejected", "quarantined", "pruned")
        ]
        if guards > cfg.max_guard_rollbacks or not good:
            why = (
                f"{guards - 1} rollback(s) did not help (max_guard_rollbacks={cfg.max_guard_rollbacks})"
                if good
                else "no committed checkpoint before it to roll back to"
            )
            msg = f"in-training guard: {reason} at step {step} (metric {guard.get('metric', 'loss')}); {why}"
            self.emit("failed", reason=msg, step=step)
            self.set_status(state="failed", reason=msg)
            self.say(f"[agent] FAILED: {msg}")
            return 4
        target = max(good)
        how: dict[str, Any] = {"lr_scale": cfg.rollback_lr_scale}
        if cfg.rollback_skip_data:
            how["skip_to_batch"] = int(guard["next_batch"])
        self.ledger.set_pointer(target, f"guard: {reason} at step {step}", resume=how)
        self.emit(
            "rollback",
            from_step=step,
            to_step=target,
            reason=f"guard: {reason}",
            kind="in-job",
            resume=how,
            attempt_no=guards,
        )
        self.say(
            f"[agent] guard: {reason} at step {step}; rolling back to step {target} "
            f"(skipping to batch {how.get('skip_to_batch')})"
        )
        return None

    def _wait_for_capacity(self) -> int | None:
        n = choose_workers(self.cfg, self.capacity.available())
        if n is not None:
            return n
        avail = self.capacity.available()
        self.emit("waiting_for_capacity", available=avail, min_workers=self.cfg.min_workers)
        self.set_status(state="waiting_for_capacity", available=avail)
        self.say(f"[agent] waiting for capacity: {avail} hosts available, need {self.cfg.min_workers}")
        deadline = time.monotonic() + self.cfg.capacity_timeout_s
        while time.monotonic() < deadline:
            self._capacity_faults(None)
            n = choose_workers(self.cfg, self.capacity.available())
            if n is not None:
                self.emit("capacity", available=self.capacity.available())
                return n
            time.sleep(0.2)
        return None

    def _supervise(self, workers: list[Worker], attempt: int, plan: MeshPlan) -> Outcome:
        sel = selectors.DefaultSelector()
        for w in workers:
            sel.register(w.fd, selectors.EVENT_READ, w)
        last_heard = time.monotonic()
        fault_at: float | None = None
        done: dict[str, Any] = {"finished": False, "rescale": False, "guard": None}
        rescale_asked = False
        self.store.delete("control.json")
        try:
            while True:
                for key, _ in sel.select(timeout=POLL_S):
                    w = key.data
                    for msg in self._read(w, sel):
                        last_heard = time.monotonic()
                        fa = self._handle(msg, done)
                        fault_at = fa or fault_at
                # Grown capacity is taken at the next checkpoint boundary.
                if not rescale_asked and not done["finished"]:
                    bigger = choose_workers(self.cfg, self.capacity.available())
                    if bigger is not None and bigger > plan.workers:
                        self.store.put(
                            "control.json", json.dumps({"action": "stop_at_checkpoint", "attempt": attempt}).encode()
                        )
                        rescale_asked = True
                        self.say(f"[agent] capacity for {bigger} workers: scaling up at the next checkpoint")
                self._capacity_faults(self.status.get("step"))
                if time.monotonic() - self._lock_refreshed > LOCK_LEASE_S / 3:
                    self.lock.refresh()
                    self._lock_refreshed = time.monotonic()
                codes = [w.proc.poll() for w in workers]
                bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    detected = time.time()
                    for w in workers:  # drain what the dead said before dying (e.g. a chaos report)
                        for msg in self._read(w):
                            fault_at = self._handle(msg, done) or fault_at
                    if done.get("guard") and all(c in (None, 0, GUARD_EXIT) for c in codes):
                        self._await_exit(workers, timeout=10)
                        return Outcome("guard", str(done["guard"]["reason"]), guard=done["guard"], detected_at=detected)
                    i, code = bad[0]
                    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                    return Outcome("failure", f"worker {i} {how}", i, code, detected, fault_at)
                if all(c == 0 for c in codes):
                    if done["rescale"]:
                        return Outcome("rescale")
                    if done["finished"]:
                        return Outcome("finished")
                    return Outcome("failure", "workers exited without finishing", None, 0, time.time(), fault_at)
                if time.monotonic() - last_heard > self.cfg.hang_timeout_s:
                    return Outcome(
                        "failure",
                        f"no progress for {self.cfg.hang_timeout_s:.0f}s (hang)",
                        None,
                        None,
                        time.time(),
                        fault_at,
                    )
        finally:
            sel.close()
            self.backend.kill(workers)

    @staticmethod
    def _read(w: Worker, sel: selectors.BaseSelector | None = None) -> list[dict[str, Any]]:
        if w.eof:
            return []
        chunks = []
        while True:
            try:
                chunk = os.read(w.fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:  # the worker closed its end (exited)
                if sel is not None:
                    sel.unregister(w.fd)
                w.eof = True
                os.close(w.fd)
                break
            chunks.append(chunk)
        w.buf += b"".join(chunks)
        *lines, w.buf = w.buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    @staticmethod
    def _await_exit(workers: list[Worker], timeout: float) -> None:
        """Let every worker reach the same guard decision and exit on its own."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
            time.sleep(POLL_S)

    def _handle(self, msg: dict[str, Any], done: dict[str, Any]) -> float | None:
        t = msg.pop("type")
        fault_at = None
        if t == "progress":
            self.set_status(
                force=False, state="running", step=msg["step"], loss=msg["loss"], tokens_per_s=msg.get("tokens_per_s")
            )
            self._progress_line(msg)
        elif t == "checkpoint":
            if msg["committed"]:
                self.set_status(latest_committed=msg["step"])
                self.ledger.record(msg["step"], "committed", attempt=msg.get("attempt"))
                self.ledger.set_pointer(msg["step"], "committed")
        elif t == "guard":
            done["guard"] = dict(msg)
        elif t == "chaos":
            self.fired.add(msg["spec"])
            fault_at = float(msg["time"])
            if msg["action"] == "preempt":
                left = self.capacity.available() - 1
                self.capacity.set(max(left, 0), reason=f"chaos {msg['spec']}")
                self.say(f"[chaos] host of worker {msg['worker']} lost at step {msg['step']} ({left} hosts left)")
            else:
                self.say(f"[chaos] {msg['action']} worker {msg['worker']} at step {msg['step']}")
        elif t == "finished":
            done["finished"] = True
            return None
        elif t == "rescale_requested":
            done["rescale"] = True
        elif t in ("restore", "init"):
            self.say(
                f"[agent] {'restored step ' + str(msg['step']) if t == 'restore' else 'initialised'} on mesh "
                f"{msg['mesh']} in {msg['seconds']:.2f}s"
            )
            self.set_status(step=msg["step"])
        elif t == "resumed":
            self.set_status(state="running")
        self.emit(t, **msg)
        return fault_at

    def _progress_line(self, msg: dict[str, Any]) -> None:
        st = self.status
        tps = msg.get("tokens_per_s") or 0
        steps_left = self.cfg.steps - msg["step"]
        eta = steps_left * msg.get("step_time", 0)
        mesh = ",".join(f"{k}={v}" for k, v in (st.get("mesh") or {}).items())
        self.say(
            f"step {msg['step']:>5}/{self.cfg.steps}  loss {msg['loss']:.4f}  {tps:9.0f} tok/s  "
            f"eta {eta:6.1f}s  workers {st.get('workers')}  mesh {mesh}"
        )


def run_agent(run_uri: str, display: Callable[[str], None] | None = print) -> int:
    store = open_store(run_uri)
    cfg = config_from_json(store.get("config.json").decode())
    capacity = LocalCapacity(store, default=cfg.max_workers)
    log_dir = Path(run_uri) / "logs" if not run_uri.startswith("gs://") else Path("var/logs") / cfg.run_name
    agent = Agent(cfg, run_uri, store, capacity, LocalSlice(cfg, run_uri, log_dir), display=display)
    return agent.run()


def main() -> int:
    return run_agent(sys.argv[1])


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Agent", "LocalSlice", "run_agent"]
