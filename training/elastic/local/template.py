"""The local slice's template process: it imports the agents' and workers' libraries once and forks each host agent.

On the local slice every simulated host is a process group of one machine.  A host's agent
starts a fork server that imports JAX, Orbax, Flax and the engine (about 1.1 s of CPU) before its
first worker can start, and a job's first round waits for that.  Four hosts importing at once on
two cores take four times one import's CPU, where real hosts each import on their own cores, in
parallel.  The template imports once for the job; each agent is a fork of it, a process group of
its own, and at its start, before it runs a thread, forks its fork server from itself
(:func:`fork_server_here`), so its workers are forks as well.

The template is the agents' parent and a child subreaper: it reaps the agents it forked and the
workers a lost host leaves behind.  The local slice watches each agent through a pidfd
(:class:`ForkedAgent`).  Agents outlive the template, as they outlive the local slice: the
template leaves when the slice closes its socket (or dies), and its agents go on.

Its title (what ``ps`` shows) names the run and the job: ``rtrain template <run> --job <job>``; an agent forked
from it names itself at once (``rtrain agent h2 <run> --job <job>``), and so does the fork server it forks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import select
import signal
import socket
import sys
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from training import procctl
from training.background import lower_this_thread
from training.elastic.forking import adopt, start_server, stop_server

if TYPE_CHECKING:
    from training.elastic.host.workerproc import ForkServer

FD_ENV = "RTRAIN_TEMPLATE_FD"  # the template's end of its socket to the local slice
MAX_MESSAGE = 1 << 20
REAP_S = 0.5  # how often the template looks for exited children while no request comes
ANSWER_S = 60.0  # the longest the template may take to answer (its first answer waits for its imports)
MODULE = "training.elastic.local.template"


def main(argv: list[str] | None = None) -> int:
    """Import once, then fork an agent for each request until the local slice closes the socket."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="The local slice's template (no command).")
    p.add_argument("run", help="the run's URI: on the command line, as an agent's, to say whose it is")
    p.add_argument("--job", required=True)
    args = p.parse_args(argv)
    procctl.set_title(procctl.job_title("template", args.run, args.job), name="rtrain-template")
    sock = socket.socket(fileno=int(os.environ.pop(FD_ENV)))
    procctl.prctl(procctl.PR_SET_CHILD_SUBREAPER, 1)  # a lost host's orphans become this process's to reap
    from training.elastic.worker.warmup import import_libraries

    import_libraries()
    import training.elastic.host.agent  # noqa: F401
    from training.checkpoint.manager import copy_bandwidth

    # A property of this machine: measured here once, every fork has the result (a worker measuring it as it
    # warms up beside a round's first steps slowed them, though in the idle class: it is memory it contends for).
    copy_bandwidth()
    gc.freeze()  # what the imports made: never scanned by the forks' collections, and its pages stay shared
    # The only other thread is the BLAS library's pool, which handles forks itself.
    warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
    sock.settimeout(REAP_S)
    while True:
        reap()
        try:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except TimeoutError:
            continue
        except OSError:
            return 0
        if not msg:
            return 0  # the local slice is gone
        answer: dict[str, int | str]
        try:
            request = json.loads(msg)
            answer = {"pid": fork_agent(sock, list(request["argv"]), dict(request["env"]), fds)}
        except Exception as e:  # noqa: BLE001 - the slice starts this agent as a process of its own
            answer = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(answer).encode())


def reap() -> None:
    """Collect every exited child: agents, and the workers of lost hosts this subreaper inherited."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def fork_agent(sock: socket.socket, argv: list[str], env: dict[str, str], fds: list[int]) -> int:
    """Fork an agent run with ``argv``, ``env`` and ``fds`` (its stdin, its log), a process group of its own."""
    stdin, log = fds
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setpgid(0, 0)
            adopt(sock, env, stdin, log)
            code = run_agent(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - never back into the template's loop
            traceback.print_exc()
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    with contextlib.suppress(OSError):  # before the slice knows the pid, so its group kill reaches the agent
        os.setpgid(pid, pid)
    return pid


def run_agent(argv: list[str]) -> int:
    """In the forked agent: fork its workers' server first (no thread runs yet), then run the agent."""
    from training.elastic.host import agent

    sys.argv = [agent.__file__, *argv]  # the program it runs, as if started with ``python -m``
    args = agent.parser().parse_args(argv)
    procctl.set_title(agent.title(args), name="rtrain-agent")  # its fork server's until that names itself
    server = fork_server_here(procctl.job_title("forkserver", args.run, args.job, args.host))
    # The slice's hosts share this machine's cores: the agent's loop, beats and writes (a few ms of CPU a step)
    # take what the steps leave, not a core from under them.  After the fork: the fork server and the workers
    # it forks keep their priority; the agent's threads, all started from here, inherit the lower one (as would
    # a worker the agent started itself, its fork server gone: that host's steps then wait for CPU first).
    lower_this_thread()
    return agent.main(argv, fork_server=server)


def fork_server_here(title: str) -> ForkServer:
    """The agent's fork server, forked from this agent (a fork of the template: the workers' libraries imported, no
    thread run yet); its output is this process's; ``title``: its process title."""
    from training.elastic.host.workerproc import ChildProcess, ForkServer
    from training.elastic.worker import forkserver
    from training.elastic.worker.link import die_with_parent

    sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sock.close()
            die_with_parent()
            procctl.set_title(title, name=forkserver.NAME)
            code = forkserver.serve(theirs)
        finally:
            os._exit(code)
    theirs.close()
    return ForkServer(sock, ChildProcess(pid))


class Template:
    """The local slice's end of its template: start it, ask it for agents, close it."""

    def __init__(self, run_uri: str, job: str, env: dict[str, str], log_path: Path) -> None:
        # process_group: a terminal's Ctrl-C is for the slice, which stops the job.
        argv = ["-m", MODULE, run_uri, "--job", job]
        self.sock, self.proc = start_server(argv, env, FD_ENV, log_path, process_group=0)
        self.alive = True

    def fork(self, argv: list[str], env: dict[str, str], log_fd: int) -> ForkedAgent | None:
        """An agent forked with ``argv`` and ``env``, its output to ``log_fd``; None when the template cannot."""
        if not self.alive:
            return None
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            socket.send_fds(self.sock, [json.dumps({"argv": argv, "env": env}).encode()], [devnull, log_fd])
            self.sock.settimeout(ANSWER_S)
            raw = self.sock.recv(4096)
        except OSError as e:  # a timeout too
            raw, why = b"", str(e) or type(e).__name__
        else:
            why = "it closed its socket"
        finally:
            os.close(devnull)
        answer = json.loads(raw) if raw else {"error": f"the template is gone ({why})"}
        if "pid" not in answer:
            logging.getLogger("rtrain.local_slice").warning(
                "the template could not fork an agent: %s; agents start as processes of their own", answer["error"]
            )
            self.close()
            return None
        return ForkedAgent(int(answer["pid"]))

    def close(self) -> None:
        """Stop the template (the agents it forked go on)."""
        self.alive = False
        stop_server(self.sock, self.proc)


class ForkedAgent:
    """An agent the template forked, watched through a pidfd: the template is its parent, not this process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:  # it exited, and the template reaped it, before the slice looked
            self._fd = None

    def running(self) -> bool:
        return not self._exited(0)

    def wait(self) -> None:
        self._exited(None)

    def _exited(self, timeout_ms: int | None) -> bool:
        """Has it exited (within ``timeout_ms``; None: wait for it)?  Its pidfd is closed once it has."""
        if self._fd is None:
            return True
        watch = select.poll()
        watch.register(self._fd, select.POLLIN)
        if not watch.poll(timeout_ms):
            return False
        os.close(self._fd)
        self._fd = None
        return True

    def send_signal(self, sig: int) -> None:
        if self._fd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._fd, sig)


if __name__ == "__main__":
    sys.exit(main())
