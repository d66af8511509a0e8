"""The local slice: N simulated hosts on this machine, each a host agent and its JAX worker.

This process plays the part Kubernetes plays on GKE, and nothing more: a node
pool of ``capacity.json`` hosts and a controller that keeps one agent running
per host (a lost agent of a host that is still there is started again, as a
failed pod is recreated; a host taken away by chaos or by ``rtrain capacity``
is not; hosts given back get new agents, which join the rendezvous).  It is not
on the training path: the agents meet, lead and recover among themselves
through the run root, exactly as they do in pods, and they keep training if
this process is killed.

It also waits for the job's end and shows its progress (``rtrain train``).
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
from typing import Any

from training.config import Config, config_from_json
from training.elastic.capacity import LocalCapacity
from training.elastic.status import status
from training.events import FINAL_STATES, EventLog, describe, read_status
from training.layout import CONFIG, CONTROL, LOGS
from training.storage import is_gcs, join, open_store

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
        "guard",
    }
)


def log_dir_for(cfg: Config, job: str) -> Path:
    base = join(cfg.run_uri, LOGS) if not is_gcs(cfg.run_uri) else os.path.join("var", "logs", cfg.run_name)
    return Path(base) / job


class LocalSlice:
    """Keeps ``capacity`` host agents of one job running until the job ends (see the module docstring)."""

    def __init__(
        self,
        cfg: Config,
        job: str,
        *,
        on_line: Callable[[str], None] | None = None,
        on_status: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.job = job
        self.store = open_store(cfg.run_uri)
        self.capacity = LocalCapacity(self.store, default=cfg.max_workers)
        self.events = EventLog(self.store)
        self.on_line = on_line
        self.on_status = on_status
        self.logs = log_dir_for(cfg, job)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self._cursor: str | None = None
        self._stopping = False
        self._final: dict[str, Any] | None = None

    # --- agents ---------------------------------------------------------------------------------

    def _host(self, i: int) -> str:
        h = self.cfg.hosts_per_slice
        return f"h{i}" if h == 1 else f"s{i // h}-h{i % h}"

    def _spawn(self, host: str) -> None:
        out = open(self.logs / f"agent-{host}.log", "ab")
        self.agents[host] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "training.elastic.agent",
                self.cfg.run_uri,
                "--job",
                self.job,
                "--host",
                host,
                "--local-capacity",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a host: its agent, worker and standby are one process group
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        out.close()

    def _reconcile(self) -> None:
        """One agent per host of the pool: start the missing ones, stop those beyond the pool's size."""
        for host, proc in list(self.agents.items()):
            if proc.poll() is not None:
                del self.agents[host]
        if self._final is not None or self._stopping:
            return
        want = min(self.capacity.available(), self.cfg.max_workers)
        leaving = set(self.capacity.leaving())  # told to go: they leave by themselves, and come back as new hosts
        hosts = [self._host(i) for i in range(self.cfg.max_workers)]
        running = [h for h in hosts if h in self.agents and h not in leaving]
        for host in reversed(running[want:]):  # the pool shrank: its newest hosts go
            self._kill(host)
            running.remove(host)
        for host in hosts:
            if len(running) >= want:
                break
            if host not in self.agents and host not in leaving:
                self._spawn(host)
                running.append(host)

    def _kill(self, host: str) -> None:
        proc = self.agents.pop(host, None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def kill_all(self) -> None:
        for host in list(self.agents):
            self._kill(host)

    # --- the job's end --------------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        """Ask the job's leader to stop the job (Ctrl-C); the agents exit when it has."""
        self._stopping = True
        with contextlib.suppress(Exception):
            self.store.put(CONTROL, json.dumps({"action": "stop_job", "reason": reason}).encode())

    def _look(self) -> dict[str, Any] | None:
        st = read_status(self.store)
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
                    stop_deadline = stop_deadline or time.monotonic() + 3 * self.cfg.lease_s + 5
                    if time.monotonic() > stop_deadline:
                        break
                if not self.agents and self._final is None and self.capacity.available() == 0:
                    stop_deadline = (
                        stop_deadline or time.monotonic() + self.cfg.capacity_timeout_s + 3 * self.cfg.lease_s
                    )
                    if time.monotonic() > stop_deadline:
                        break
                time.sleep(POLL_S)
        finally:
            self.kill_all()
        st = self._look() or {}
        if st.get("state") not in FINAL_STATES:
            st = status(self.cfg.run_uri) or {}  # records the final state of a job nobody leads any more
        return 0 if st.get("state") == "finished" else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.elastic.local_slice")
    p.add_argument("run")
    p.add_argument("--job", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = config_from_json(open_store(args.run).get(CONFIG).decode())
    slice_ = LocalSlice(cfg, args.job, on_line=lambda line: print(line, flush=True))
    signal.signal(signal.SIGTERM, lambda *_: slice_.stop("SIGTERM to the local slice"))
    return slice_.run()


if __name__ == "__main__":
    sys.exit(main())
