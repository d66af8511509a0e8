"""Servers that fork on request: each started on one end of a socket pair, asked over it, stopped; what a fork takes.

Two such servers run a job's processes: the agent's fork server (:mod:`training.elastic.worker.forkserver`),
which forks the host's workers, and the local slice's template (:mod:`training.elastic.local.template`), which
forks the host agents.  Whoever starts a server starts it here, by its module's name, importing nothing of the
program it runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

FORKSERVER = "training.elastic.worker.forkserver"  # the agent's fork server, run as ``python -m FORKSERVER``
FORKSERVER_FD_ENV = "RTRAIN_FORKSERVER_FD"  # the fork server's end of its socket to the agent


def start_server(
    argv: list[str], env: dict[str, str], fd_env: str, log_path: Path, **popen: Any
) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    """Start a server process (``argv``, after the interpreter) with its end of a new socket pair, whose number
    it finds in ``fd_env``; our end and the process."""
    sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            env={**env, fd_env: str(theirs.fileno())},
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            **popen,
        )
    theirs.close()
    return sock, proc


def stop_server(sock: socket.socket, proc: Any) -> None:
    """Close our end of a server's socket, kill it and reap it (what it forked goes on)."""
    with contextlib.suppress(OSError):
        sock.close()
    with contextlib.suppress(OSError):
        proc.kill()
    proc.wait()


def adopt(sock: socket.socket, env: dict[str, str], stdin: int, log: int) -> None:
    """In a forked child: leave the server's socket; take ``stdin``, the output ``log`` and ``env`` as its own."""
    sock.close()
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(stdin)
    os.close(log)
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)
