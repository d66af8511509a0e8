"""A host's fork server: one process that imported the worker's libraries and forks each worker the agent asks for.

A worker imports JAX, Orbax, Flax and the engine (about 1.7 s of CPU here)
before it can take a round.  A standby doing that beside a training round takes
the CPU from the round's steps: on the local slice, four standbys on two cores
made a round's first 20 steps 24% and 59% slower in two runs.  The fork server imports once
per agent; each worker is a fork of it, the libraries already loaded.

The server does nothing but import (no JAX backend, no threads of its own), so
forking it is safe.  It forks twice over: its child forks the worker and exits,
and the worker becomes the agent's child (the agent is a child subreaper), so
the agent reaps it, signals it and reads its exit code as for a process it
started itself.  Each request carries the worker's environment and three file
descriptors (its stdin, its report pipe, its log) over a Unix socket.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
import warnings
from typing import NoReturn

from training.elastic.forking import FORKSERVER_FD_ENV, adopt

MAX_MESSAGE = 1 << 20
REPARENT_S = 5.0  # the longest a forked worker waits to become the agent's child


NAME = "rtrain-fork"  # a fork server's OS name (its title: ``rtrain forkserver h2 <run> --job <job>``)


def main() -> int:
    from training import procctl
    from training.elastic.worker.link import die_with_parent
    from training.elastic.worker.warmup import import_libraries

    die_with_parent()
    where = (os.environ.get(k, "?") for k in ("RTRAIN_RUN_URI", "RTRAIN_JOB", "RTRAIN_HOST"))
    procctl.set_title(procctl.job_title("forkserver", *where), name=NAME)
    sock = socket.socket(fileno=int(os.environ.pop(FORKSERVER_FD_ENV)))
    import_libraries()
    return serve(sock)


def serve(sock: socket.socket) -> int:
    """Fork a worker for each request on ``sock`` until the agent closes it (its libraries imported already)."""
    # The only other thread is the BLAS library's pool, which handles forks itself.
    warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
        except OSError:
            return 0
        if not msg:
            return 0  # the agent is gone
        answer: dict[str, int | str]
        try:
            answer = {"pid": fork_worker(sock, json.loads(msg), fds)}
        except Exception as e:  # noqa: BLE001 - the agent starts this worker without the server
            answer = {"error": f"{type(e).__name__}: {e}"}
        sock.send(json.dumps(answer).encode())


def fork_worker(sock: socket.socket, env: dict[str, str], fds: list[int]) -> int:
    """Fork a worker with ``env`` and ``fds`` (stdin, report pipe, log), parented by the agent; its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(r)
            pid = os.fork()
            if pid == 0:
                os.close(w)
                become_worker(sock, env, fds)
            os.write(w, str(pid).encode())
        finally:
            os._exit(0)
    os.close(w)
    for fd in fds:
        os.close(fd)
    raw = b""
    while chunk := os.read(r, 32):
        raw += chunk
    os.close(r)
    os.waitpid(middle, 0)
    return int(raw or 0)


def become_worker(sock: socket.socket, env: dict[str, str], fds: list[int]) -> NoReturn:
    """In the forked process: take the request's stdin, log and environment, wait to be the agent's, run."""
    try:
        take_over(sock, env, fds)
        from training.elastic.worker import main as worker_main

        sys.argv = [worker_main.__file__]  # the program it runs, as if started with ``python -m``
        worker_main.run_main()
    except BaseException:  # noqa: BLE001 - never back into the server's loop; 1, as Python's own exit on an error
        traceback.print_exc()
        sys.stderr.flush()
    os._exit(1)


def take_over(sock: socket.socket, env: dict[str, str], fds: list[int]) -> None:
    """The worker's stdin, output and environment from the request; return once the agent is its parent."""
    stdin, control, log = fds
    adopt(sock, env, stdin, log)
    os.environ["RTRAIN_CONTROL_FD"] = str(control)
    # The middle process is leaving (it may have left already); then the agent, a subreaper, is the parent.
    # A worker that is not the agent's in the end leaves at its start (``die_with_parent``).
    if not wait_for_parent(int(env.get("RTRAIN_AGENT_PID") or 0), REPARENT_S):
        print(f"forked worker: not the agent's child after {REPARENT_S:.0f} s", file=sys.stderr, flush=True)


def wait_for_parent(pid: int, timeout: float) -> bool:
    """Wait until this process's parent is ``pid`` (as it becomes once the middle process has left)."""
    deadline = time.monotonic() + timeout
    while os.getppid() != pid:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


if __name__ == "__main__":
    sys.exit(main())
