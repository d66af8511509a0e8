"""A host's worker process: started as a standby, read through its report pipe, killed.

The agent starts one worker at a time ahead of need (a standby that imports JAX, reads the
config and opens the dataset), hands it a round, reads its reports (one JSON object a line on a
pipe of its own) and kills it when the round is over for this host.  Workers are forked by the
agent's fork server (:mod:`training.elastic.worker.forkserver`), their libraries already imported; a
worker is started as a process of its own when the server cannot start or has gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from training import procctl
from training.config import Config
from training.cpu_devices import cpu_process_env
from training.elastic.forking import FORKSERVER, FORKSERVER_FD_ENV, start_server, stop_server
from training.elastic.rendezvous import Round
from training.elastic.wire import WorkerReport, decode
from training.placement_traits import traits
from training.sections import PlacementSection

log = logging.getLogger("rtrain.agent")
ANSWER_S = 120.0  # the longest the fork server may take to answer (its first answer waits for its imports)


class Process(Protocol):
    """What the agent does with a worker's process (a ``subprocess.Popen``, or a :class:`ForkedProcess`)."""

    @property
    def stdin(self) -> IO[bytes] | None: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def pid(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self) -> int: ...
    def kill(self) -> None: ...
    def send_signal(self, sig: int) -> None: ...


@dataclass
class WorkerProc:
    """A worker process: a standby until assigned, then this round's worker."""

    proc: Process
    fd: int
    log: Path
    round: int = -1
    rank: int = -1
    buf: bytes = b""
    eof: bool = False
    seen: dict[str, Any] = field(default_factory=dict)  # finished / rescale / guard / corrupt / error / chaos
    plan: Round | None = None  # the round it was assigned

    @property
    def assigned(self) -> bool:
        return self.round >= 0

    def live_pid(self) -> int | None:
        """Its pid while it runs (None once it has ended, or while its fork server has not answered yet)."""
        if self.proc.poll() is not None:
            return None
        return self.proc.pid or None

    def kill(self) -> None:
        """Kill the process (if it still runs), reap it and close its pipes."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        self.proc.wait()
        if not self.eof:
            self.eof = True
            os.close(self.fd)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def read(self, host: str) -> list[WorkerReport]:
        """The whole reports that arrived since the last read (without waiting)."""
        if self.eof:
            return []
        chunks = []
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                os.close(self.fd)
                break
            chunks.append(chunk)
        self.buf += b"".join(chunks)
        *lines, self.buf = self.buf.split(b"\n")
        out = []
        for line in lines:
            if line.strip():
                try:
                    out.append(decode(line))
                except ValueError as e:
                    log.warning("[%s] unreadable report from the worker (%s): %r", host, e, line[:200])
        return out


def worker_env(cfg: Config, run_uri: str, host: str, job: str) -> dict[str, str]:
    """The environment of this agent's workers (and of its fork server)."""
    from training.gke.worker_env import worker_base_env  # without a round's TPU variables: the round sets them

    env = {
        **worker_base_env(os.environ),
        "RTRAIN_RUN_URI": run_uri,
        "RTRAIN_HOST": host,
        "RTRAIN_JOB": job,
        "RTRAIN_AGENT_PID": str(os.getpid()),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONUNBUFFERED": "1",
    }
    if traits(cfg.placement.backend).hosts_here:
        env.update(cpu_slice_env(cfg.placement))
    return env


def cpu_slice_env(placement: PlacementSection) -> dict[str, str]:
    """JAX's settings on the local slice: each simulated host is a JAX process with D CPU devices, gloo collectives."""
    return cpu_process_env(placement.devices_per_worker)


def spawn_worker(
    env: dict[str, str], log_path: Path, background: bool = False, server: ForkServer | None = None
) -> WorkerProc:
    """Start a standby worker with ``env``, its output going to ``log_path``: forked by ``server`` if it
    runs, else a process of its own.

    ``background``: it warms up at the lowest priority, beside a round training on this host.
    """
    r, w = os.pipe()
    env = {**env, "RTRAIN_CONTROL_FD": str(w), "RTRAIN_WARM_BACKGROUND": "1" if background else "0"}
    proc: Process | None = None
    with open(log_path, "wb") as out:
        if server is not None and server.alive:
            proc = server.fork(env, control=w, log_fd=out.fileno())
        if proc is None:
            proc = subprocess.Popen(
                [sys.executable, "-m", "training.elastic.worker.main"],
                env=env,
                pass_fds=(w,),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
    os.close(w)
    os.set_blocking(r, False)
    return WorkerProc(proc, r, log_path)


FAILED = 1  # the exit code of a worker the fork server could not fork (as a worker's start-up error)


class ForkServer:
    """The agent's end of its fork server (:mod:`training.elastic.worker.forkserver`): it asks for workers and learns
    their pids, in order, without waiting for them (the server's first answer waits for its imports).  On the
    local slice the agent's server is a fork of the agent itself (the template's ``fork_server_here``)."""

    def __init__(self, sock: socket.socket, proc: Process) -> None:
        procctl.prctl(procctl.PR_SET_CHILD_SUBREAPER, 1)  # the forked workers become this process's children
        self.sock = sock
        self.proc = proc
        self.waiting: deque[ForkedProcess] = deque()
        self.alive = True

    @classmethod
    def start(cls, env: dict[str, str], log_path: Path) -> ForkServer:
        """A server started as a process of its own with ``env``, its output going to ``log_path``."""
        return cls(*start_server(["-m", FORKSERVER], env, FORKSERVER_FD_ENV, log_path))

    def fork(self, env: dict[str, str], control: int, log_fd: int) -> ForkedProcess | None:
        """Ask for a worker with ``env``, its report pipe ``control`` and its log; None if the server is gone."""
        r, w = os.pipe()
        try:
            socket.send_fds(self.sock, [json.dumps(env).encode()], [r, control, log_fd])
        except OSError as e:
            log.warning("the fork server is gone (%s): workers start as processes of their own", e)
            self.alive = False
            os.close(w)
            return None
        finally:
            os.close(r)
        proc = ForkedProcess(self, os.fdopen(w, "wb"))
        self.waiting.append(proc)
        return proc

    def answers(self, block: bool) -> None:
        """Take the server's answers so far (``block``: wait for the next) and give each its process."""
        while self.waiting:
            try:
                self.sock.settimeout(ANSWER_S if block else 0.0)
                raw = self.sock.recv(4096)
            except BlockingIOError:
                return
            except TimeoutError:
                log.warning(
                    "the fork server did not answer in %.0f s: workers start as processes of their own", ANSWER_S
                )
                self.close()
                raw = b""
            except OSError:
                raw = b""
            answer = json.loads(raw) if raw else {"error": "the fork server is gone"}
            if not raw:
                self.alive = False
            proc = self.waiting.popleft()
            if "pid" in answer:
                proc.pid = int(answer["pid"])
            else:
                log.warning("the fork server could not start a worker: %s", answer["error"])
                proc.pid, proc.returncode = 0, FAILED
            block = False

    def close(self) -> None:
        """Stop the server (the workers it forked are this process's children and stay)."""
        self.alive = False
        stop_server(self.sock, self.proc)


class ChildProcess:
    """A process this one forked without ``subprocess`` (a fork server forked here): kill and wait, by pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.send_signal(signal.SIGKILL)


class ForkedProcess:
    """A worker the fork server forked, as this process's child: a ``subprocess.Popen``'s poll, wait and signals."""

    def __init__(self, server: ForkServer, stdin: IO[bytes]) -> None:
        self.server = server
        self.stdin: IO[bytes] | None = stdin
        self.pid: int | None = None  # None until the server answered
        self.returncode: int | None = None

    def _known(self, block: bool) -> bool:
        if self.pid is None:
            self.server.answers(block)
        return self.pid is not None and self.pid > 0

    def poll(self) -> int | None:
        if self.returncode is None and self._known(block=False):
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self) -> int:
        while self.pid is None:
            self.server.answers(block=True)
        if self.returncode is None:
            self._reap(0)
        assert self.returncode is not None
        return self.returncode

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)  # type: ignore[arg-type]
        except ChildProcessError:  # not this process's child after all: nothing to wait for
            self.returncode = FAILED
            return
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._known(block=True):
            os.kill(self.pid, sig)  # type: ignore[arg-type]

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
