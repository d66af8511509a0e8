"""The host watch: real agent-side listeners in real processes, real TCP, real SIGKILL and SIGSTOP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from training.elastic.host.hostwatch import RETRY_S, HostWatch, Listener

AGENT = (
    "import sys, time\n"
    "from training.elastic.host.hostwatch import Listener\n"
    "port = int(sys.argv[1])\n"
    "print(Listener('127.0.0.1', '127.0.0.1', port).address, flush=True)\n"
    "time.sleep(120)\n"
)


def _agent(port: int = 0) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", AGENT, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _until(cond: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``cond`` held; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"not within {timeout}s"
        time.sleep(0.01)
    return time.monotonic() - t0


@pytest.fixture
def watch() -> Iterator[HostWatch]:
    w = HostWatch()
    yield w
    w.close()


def _opened(w: HostWatch, host: str, started: float) -> bool:
    with w._lock:
        return (host, started) in w._open and (host, started) not in w._failed


def test_a_killed_agent_is_known_gone_within_a_fraction_of_a_second(watch: HostWatch) -> None:
    proc, address = _agent()
    try:
        watch.watch("h1", 1.0, address)
        time.sleep(0.3)  # the connection opens
        assert not watch.gone("h1", 1.0)
        os.kill(proc.pid, signal.SIGKILL)
        assert _until(lambda: watch.gone("h1", 1.0), 2.0) < 0.5
        assert watch.exited("h1", 1.0)  # its kernel closed the connection: the process has exited
        # Another agent on the same host (a restart) is another agent: not gone.
        assert not watch.gone("h1", 2.0)
    finally:
        proc.kill()
        proc.wait()


def test_a_frozen_agent_is_not_the_watch_to_find(watch: HostWatch) -> None:
    proc, address = _agent()
    try:
        watch.watch("h1", 1.0, address)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.5)  # its kernel keeps the connection open: the heartbeat's settle finds a frozen host
        assert not watch.gone("h1", 1.0) and not watch.exited("h1", 1.0)
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()
    assert _until(lambda: watch.gone("h1", 1.0), 2.0) < 1.0


def test_an_agent_that_cannot_be_reached_yet_is_not_gone_and_is_dialled_again(watch: HostWatch) -> None:
    with socket.socket() as s:  # a port nobody listens on (yet)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    watch.watch("h1", 1.0, address)
    time.sleep(0.3)
    assert not watch.gone("h1", 1.0)  # refused is no proof of death: a network can refuse a live host
    assert watch.refused("h1", 1.0)  # but it is said (an earlier agent of the caller's own host is taken as gone)
    proc, _ = _agent(port)
    try:
        t0 = time.monotonic()
        while not _opened(watch, "h1", 1.0) or time.monotonic() - t0 < RETRY_S + 0.3:
            watch.watch("h1", 1.0, address)  # the leader calls this every scan
            time.sleep(0.1)
            assert time.monotonic() - t0 < RETRY_S + 5
        time.sleep(0.3)
        assert not watch.refused("h1", 1.0)  # it listens now
        proc.kill()
        assert _until(lambda: watch.gone("h1", 1.0), 2.0) < 0.5
    finally:
        proc.kill()
        proc.wait()


def test_a_listener_holds_the_connection_while_its_process_lives_and_closes_it_when_closed(watch: HostWatch) -> None:
    listener = Listener("127.0.0.1", "127.0.0.1")
    watch.watch("h1", 1.0, listener.address)
    watch.watch("h1", 1.0, listener.address)  # a second call while open is a no-op
    time.sleep(0.5)
    assert not watch.gone("h1", 1.0)
    listener.close()
    assert _until(lambda: watch.gone("h1", 1.0), 2.0) < 0.5
    watch.watch("h1", 1.0, listener.address)  # gone stays gone: the same agent is never dialled again
    time.sleep(0.3)
    assert watch.gone("h1", 1.0)
    # Unless the leader takes it back (the agent beat again: its connection was cut on the way): dialled again.
    port = int(listener.address.rsplit(":", 1)[1])
    again = Listener("127.0.0.1", "127.0.0.1", port)
    try:
        watch.forget("h1", 1.0)
        assert not watch.gone("h1", 1.0)
        watch.watch("h1", 1.0, again.address)
        time.sleep(0.5)  # the connection opens
        assert _opened(watch, "h1", 1.0)
        again.close()
        assert _until(lambda: watch.gone("h1", 1.0), 2.0) < 0.5
    finally:
        again.close()
