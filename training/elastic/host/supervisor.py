"""A host's worker supervisor: the standby warming up and the round's worker; spawned, assigned, read, killed.

The agent keeps one warmed-up standby worker ready (imports, config, dataset), hands it its round
as a JSON line on its stdin, reads its reports from its pipe, and kills it when the round is over
for this host.  Its workers are forked by one fork server per agent, started with the first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from training.config import Config
from training.elastic.host.workerproc import ForkServer, WorkerProc, spawn_worker, worker_env
from training.elastic.peerwatch import peer_watch_port
from training.elastic.rendezvous import Round
from training.elastic.wire import WorkerReport
from training.placement_traits import traits

log = logging.getLogger("rtrain.agent")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class WorkerSupervisor:
    """This host's worker processes: at most one standby and one worker of the current round."""

    def __init__(
        self,
        cfg: Config,
        run_uri: str,
        host: str,
        job: str,
        log_dir: Path,
        *,
        coordinator_host: str,
        coordinator_port: int,
        bind_host: str,
        server: ForkServer | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_uri = run_uri
        self.host = host
        self.job = job
        self.log_dir = log_dir  # the workers' logs
        log_dir.mkdir(parents=True, exist_ok=True)
        self.coordinator_host = coordinator_host  # the address peers reach this host on
        self.coordinator_port = coordinator_port  # 0: a free port for each round (the local slice)
        self.bind_host = bind_host  # the address rank 0's coordinator binds
        self.worker: WorkerProc | None = None
        self.standby: WorkerProc | None = None
        self.spawned = 0
        self.env = worker_env(cfg, run_uri, host, job)
        self.server = server  # None: started with the first worker

    def coordinator_address(self) -> str:
        """Where this host's worker would serve jax.distributed as rank 0 (a free port each time, unless fixed)."""
        port = self.coordinator_port or free_port(self.coordinator_host)
        return f"{self.coordinator_host}:{port}"

    def spawn(self, background: bool = False) -> WorkerProc:
        """A standby worker: it warms up (imports, config, dataset) and waits for its assignment.

        ``background``: a round trains on this host meanwhile, and the warm-up takes only the CPU it leaves.
        """
        self.spawned += 1
        log_path = self.log_dir / f"worker-{os.getpid()}-{self.spawned}.log"
        if self.server is None:
            try:
                self.server = ForkServer.start(self.env, self.log_dir / f"forkserver-{os.getpid()}.log")
            except OSError as e:  # each worker then imports its libraries itself
                log.warning("[%s] no fork server: %s", self.host, e)
        return spawn_worker(self.env, log_path, background=background, server=self.server)

    def warm(self) -> None:
        """Start a standby unless one is there, beside this host's training round."""
        if self.standby is None:
            self.standby = self.spawn(background=True)

    def drop_standby(self) -> None:
        if self.standby is not None:
            self.standby.kill()
            self.standby = None

    def stop_worker(self) -> WorkerProc | None:
        """Kill the round's worker, if there is one; the worker that was."""
        w = self.worker
        if w is not None:
            w.kill()
            self.worker = None
        return w

    def kill_all(self) -> None:
        self.stop_worker()
        self.drop_standby()
        if self.server is not None:
            self.server.close()

    def notice(self) -> bool:
        """Pass a preemption notice to the worker that trains (SIGTERM); False when none does."""
        w = self.worker
        if w is None or not w.assigned or w.proc.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            w.proc.send_signal(signal.SIGTERM)
        return True

    def assign(self, rnd: Round, rank: int) -> str:
        """Start this host's part in ``rnd`` on the standby (else a new process); why it could not ('' if it did)."""
        w = self.standby if self.standby is not None and self.standby.proc.poll() is None else self.spawn()
        self.standby = None
        w.round, w.rank, w.plan = rnd.round, rank, rnd
        bind = self.bind_host if rank == 0 else ""
        assignment = {
            "round": rnd.round,
            "rank": rank,
            "processes": rnd.workers,
            "coordinator": rnd.coordinator,
            "bind": f"{bind}:{rnd.coordinator.rsplit(':', 1)[1]}" if bind else "",
            "resume": asdict(rnd.resume),
            "faults": rnd.faults,
            "env": self.round_env(rnd, rank),
            # Process 0's peer watch listens next to the coordinator (a fixed port on GKE, declared in the pod).
            "watch_port": peer_watch_port(self.coordinator_port) if rank == 0 else 0,
            "job": self.job,
        }
        try:
            assert w.proc.stdin is not None
            w.proc.stdin.write((json.dumps(assignment) + "\n").encode())
            w.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            w.kill()
            return f"worker could not be started: {e}"
        self.worker = w
        return ""

    def round_env(self, rnd: Round, rank: int) -> dict[str, str]:
        """What the worker's runtime must know of this round before it starts (TPU identity, Multislice).

        On GKE every value is this round's: the worker was started without the pod's own TPU_WORKER_* and
        MEGASCALE_* (``worker_base_env`` in ``spawn_worker``), which GKE's webhook set for the JobSet as created.
        """
        if not traits(self.cfg.placement.backend).round_tpu_env:
            return {}
        from training.gke.worker_env import round_env

        return round_env(
            rnd.members, rank, self.cfg.placement.hosts_per_slice, rnd.coordinator, os.environ.get("MEGASCALE_PORT")
        )

    def pump(self, handle: Callable[[WorkerProc, WorkerReport], None]) -> tuple[WorkerProc, int] | None:
        """Hand each report the worker wrote to ``handle``; the worker and its exit code once it has ended."""
        if self.standby is not None and self.standby.proc.poll() is not None:
            log.warning(
                "[%s] the standby worker exited (%s); see %s", self.host, self.standby.proc.returncode, self.standby.log
            )
            self.drop_standby()
        w = self.worker
        if w is None:
            return None
        for msg in w.read(self.host):
            handle(w, msg)
        code = w.proc.poll()
        if code is None:
            return None
        for msg in w.read(self.host):  # what it said before it went
            handle(w, msg)
        w.kill()
        self.worker = None
        return w, code
