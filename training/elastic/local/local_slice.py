"""The local slice: N simulated hosts on this machine, each a host agent and its JAX worker.

This process plays Kubernetes' part and no more: a pool of ``capacity.json`` hosts with one agent
kept running per host (a lost agent of a host still there is restarted; a host taken away by chaos
or ``rtrain capacity`` is not; hosts given back get new agents).  The agents are forked by the
job's template (:mod:`training.elastic.local.template`), which imported their libraries once.  It is off
the training path: the agents meet, lead and recover through the run root, and train on if this
process is killed.

It also waits for the job's end and shows progress (``rtrain train``).  When no host is left, no
agent can lead, so this launcher holds the run (:mod:`training.elastic.local.run_hold`): it takes the
lease once the last leader's lapsed (or was handed to the job) and keeps ``status.json`` at
``waiting_for_capacity`` until capacity returns (it hands the lock back and starts agents, whose
leader's wait goes on from the same moment) or ``capacity_timeout_s`` fails the job.  Under a
scheduler's assignment (``rtrain submit``), hosts beyond it get a preemption notice instead of
being killed, and a job assigned no host is held, queued, with no timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

from training.config import Config, config_from_json
from training.elastic.capacity import LocalCapacity
from training.elastic.codes import AgentExit
from training.elastic.host.workerproc import cpu_slice_env
from training.elastic.local.run_hold import RunHold, keep_lasting_end
from training.elastic.local.template import Template
from training.elastic.status import kept_end, repair_status, stop_asked
from training.event_text import describe
from training.events import FINAL_STATES, EventLog, RunStatus, read_status
from training.layout import CONFIG, STOP, logs_base
from training.procctl import start_detached
from training.storage import expect_root, open_store

log = logging.getLogger("rtrain.local_slice")

POLL_S = 0.2
# Events worth a line on the console while the job runs.
SHOWN = frozenset(
    {
        "launch",
        "failure",
        "resize",
        "restore",
        "rollback",
        "chaos",
        "leader",
        "host_lost",
        "checkpoint_corrupt",
        "waiting_for_capacity",
        "finished",
        "failed",
        "stopped",
        "guard",
    }
)


class AgentProcess(Protocol):
    """A host agent's process, as the local slice sees it: forked by the template, or started on its own."""

    @property
    def pid(self) -> int: ...
    def running(self) -> bool: ...
    def wait(self) -> None: ...
    def send_signal(self, sig: int) -> None: ...


class StartedAgent:
    """An agent started as a process of its own (where the template cannot fork one)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid = proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self) -> None:
        self.proc.wait()

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)


def log_dir_for(cfg: Config, job: str) -> Path:
    return Path(logs_base(cfg.run_uri, cfg.run_name)) / job


class LocalSlice:
    """Keeps ``capacity`` host agents of one job running until the job ends (see the module docstring)."""

    def __init__(
        self,
        cfg: Config,
        job: str,
        *,
        on_line: Callable[[str], None] | None = None,
        on_status: Callable[[RunStatus], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.job = job
        self.store = open_store(cfg.run_uri)
        self.capacity = LocalCapacity(self.store, default=cfg.elastic.max_workers)
        self.events = EventLog(self.store)
        self.own_events = EventLog(self.store, source="local-slice")  # what it does while it holds the run
        self.on_line = on_line
        self.on_status = on_status
        self.logs = log_dir_for(cfg, job)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.agents: dict[str, AgentProcess] = {}
        self._template: Template | None = None  # forks the agents, started with the first
        self._noticed: set[str] = set()  # hosts told to go by a scheduler's assignment, still on their way out
        self._cursor: str | None = None
        self._stopping = False
        self._final: RunStatus | None = None
        self._stop_reason = ""
        # The run, held by this process while no host of the job is left.
        self.hold = RunHold(cfg, job, self.store, self.capacity, self.own_events)

    # --- agents ---------------------------------------------------------------------------------

    def _host(self, i: int) -> str:
        h = self.cfg.placement.hosts_per_slice
        return f"h{i}" if h == 1 else f"s{i // h}-h{i % h}"

    def _spawn(self, host: str) -> None:
        argv = [self.cfg.run_uri, "--job", self.job, "--host", host, "--local-capacity"]
        # (Agents forked from the template have its environment; one started on its own gets the same.)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **cpu_slice_env(self.cfg.placement)}
        if self._template is None:
            try:
                self._template = Template(self.cfg.run_uri, self.job, env, self.logs / "template.log")
            except OSError as e:
                log.warning("no template process (%s): agents start as processes of their own", e)
        with open(self.logs / f"agent-{host}.log", "ab") as out:
            forked = self._template.fork(argv, env, out.fileno()) if self._template is not None else None
            self.agents[host] = forked or StartedAgent(self._start_agent(argv, env, out))

    @staticmethod
    def _start_agent(argv: list[str], env: dict[str, str], out: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "training.elastic.host.agent", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            # A host: its agent, worker and standby are one process group.  In the caller's session, not a new one:
            # Linux shares the CPU fairly between sessions (autogroups) before it looks at priorities, and the
            # hosts of one machine would each get a fair share, whatever their threads' priorities say.
            process_group=0,
            env=env,
        )

    def _reconcile(self) -> None:
        """One agent per host of the pool: start the missing ones, stop those beyond the pool's size."""
        for host, proc in list(self.agents.items()):
            if not proc.running():
                del self.agents[host]
                self._noticed.discard(host)
        if self._final is not None or self._stopping or self.hold.holding:
            return
        want = min(self.capacity.available(), self.cfg.elastic.max_workers)
        leaving = set(self.capacity.leaving())  # told to go: they leave by themselves, and come back as new hosts
        hosts = [self._host(i) for i in range(self.cfg.elastic.max_workers)]
        running = [h for h in hosts if h in self.agents and h not in leaving and h not in self._noticed]
        notice = self.capacity.assigned()  # a scheduler moves hosts: each goes with a notice, losing no step
        for host in reversed(running[want:]):  # the pool shrank: its newest hosts go
            log.info("the pool has %d host(s): host %s goes (%s)", want, host, "a notice" if notice else "killed")
            (self._notice if notice else self._kill)(host)
            running.remove(host)
        for host in hosts:
            if len(running) >= want:
                break
            if host not in self.agents and host not in leaving:
                try:
                    self._spawn(host)
                except OSError as e:  # its log cannot be opened: the run root (where the logs are) may refuse it
                    return keep_lasting_end(self.store, self.job, e, self.hold.step)
                running.append(host)

    def _kill(self, host: str) -> None:
        proc = self.agents.pop(host, None)
        if proc is not None and proc.running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def _notice(self, host: str) -> None:
        """Tell ``host`` to go (SIGTERM to its agent, as Kubernetes deletes a pod): it commits and leaves."""
        proc = self.agents.get(host)
        if proc is not None and proc.running():
            proc.send_signal(signal.SIGTERM)
            self._noticed.add(host)

    def kill_all(self) -> None:
        for host in list(self.agents):
            self._kill(host)

    # --- no host left: holding the run for the job ------------------------------------------------

    def _no_host_left(self) -> None:
        """No agent of the job runs and the pool has no host for one: hold the run until capacity returns."""
        final = self.hold.look(self._stop_reason if self._stopping else None)
        if final is not None:
            self._final = final

    # --- the job's end --------------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        """Ask the job's leader to stop the job (Ctrl-C, SIGTERM; a stop asked already keeps its reason)."""
        self._stopping = True
        self._stop_reason = reason
        with contextlib.suppress(Exception):
            if stop_asked(self.store) is None:
                self.store.put(STOP, json.dumps({"action": "stop_job", "reason": reason}).encode())

    def _look(self) -> RunStatus | None:
        st = read_status(self.store)
        st = kept_end(self.store, st) or st  # the end its leader kept here: the run root refused it
        if st is None or st.get("job") != self.job:
            return None
        if self.on_status is not None:
            self.on_status(st)
        if self.on_line is not None:
            for ev in self.events.read(after_key=self._cursor):
                self._cursor = ev["_key"]
                if ev["type"] in SHOWN:
                    self.on_line(f"[{ev.get('source', '')}] {describe(ev)}")
        return st

    def run(self) -> int:
        """Run the job to its end; 0 when it finished."""
        stop_deadline: float | None = None
        allowance_s = self.cfg.stop_allowance_s
        try:
            while True:
                self._reconcile()
                st = self._look()
                if st is not None and st.get("state") in FINAL_STATES and self._final is None:
                    self._final = st
                    grace = time.monotonic() + 10.0
                if self._final is not None and (not self.agents or time.monotonic() > grace):
                    break
                if self._stopping:
                    stop_deadline = stop_deadline or time.monotonic() + allowance_s
                    if time.monotonic() > stop_deadline:
                        log.warning("job %s not stopped %.0fs after the stop asked: killed", self.job, allowance_s)
                        break
                if not self.agents and self._final is None and (self.hold.holding or not self._stopping):
                    self._no_host_left()  # may hand the run back: the agents start at the next look
                    if self._final is not None:
                        break
                time.sleep(POLL_S)
        finally:
            self.hold.let_go()
            self.kill_all()
            if self._template is not None:
                self._template.close()
        st = self._look() or {}
        if st.get("state") not in FINAL_STATES:
            st = repair_status(self.cfg.run_uri) or {}  # records the final state of a job nobody leads any more
        return {"finished": 0, "stopped": int(AgentExit.STOPPED)}.get(str(st.get("state")), 1)


def spawn(cfg: Config, job: str) -> int:
    """Start the local slice of ``job`` in a process of its own (outliving the caller: a task, a shell); its pid."""
    log = log_dir_for(cfg, job) / "local-slice.log"
    return start_detached("training.elastic.local.local_slice", [cfg.run_uri, "--job", job], log)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.elastic.local.local_slice")
    p.add_argument("run")
    p.add_argument("--job", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    expect_root(args.run)  # the job began there: a run root that vanishes is not made anew by this process
    cfg = config_from_json(open_store(args.run).get(CONFIG).decode())
    slice_ = LocalSlice(cfg, args.job, on_line=lambda line: print(line, flush=True))
    signal.signal(signal.SIGTERM, lambda *_: slice_.stop("SIGTERM to the local slice"))
    return slice_.run()


if __name__ == "__main__":
    sys.exit(main())
