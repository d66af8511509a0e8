"""The peer watch: real processes, real TCP connections, real SIGKILLs.

Each process below is one end of a round's watch, as a worker is: process 0
listens, the others dial it.  A process reports a loss by printing it and
exiting with code 3, as a worker leaves with its error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from training.elastic.peerwatch import PeerWatch

PROCESS = textwrap.dedent(
    """
    import os, sys, time
    from training.elastic.peerwatch import PeerWatch

    rank, processes, address, outlast = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])

    def lost(peer, why):
        print(f"LOST {peer} {why}", flush=True)
        os._exit(3)

    watch = PeerWatch(rank, processes, lost)
    if rank == 0:
        print("ADDRESS", watch.listen("127.0.0.1", "127.0.0.1"), flush=True)
    else:
        watch.connect(address)
        print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "bye":
            watch.bye()
            print("BYE", watch.outlast(outlast), flush=True)
            os._exit(0)
    time.sleep(3600)
    """
)


def _start(rank: int, processes: int, address: str = "-", outlast: float = 30) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PROCESS, str(rank), str(processes), address, str(outlast)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _line(p: subprocess.Popen[str]) -> str:
    assert p.stdout is not None
    return p.stdout.readline().strip()


def _exit(p: subprocess.Popen[str], timeout: float = 10) -> tuple[int, str]:
    """Its exit code and what it printed last (it must exit on its own within ``timeout``)."""
    code = p.wait(timeout=timeout)
    assert p.stdout is not None
    return code, p.stdout.read().strip()


def _say(p: subprocess.Popen[str], line: str) -> None:
    assert p.stdin is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()


@pytest.fixture
def group(request):
    """Process 0 and two peers, connected; all killed at the end.  Process 0 outlasts its peers for up
    to 30 s after its bye (``@pytest.mark.parametrize("group", [seconds], indirect=True)`` to change)."""
    procs: list[subprocess.Popen[str]] = []
    hub = _start(0, 3, outlast=getattr(request, "param", 30))
    procs.append(hub)
    kind, address = _line(hub).split()
    assert kind == "ADDRESS"
    for rank in (1, 2):
        procs.append(_start(rank, 3, address))
        assert _line(procs[-1]) == "READY"
    time.sleep(0.2)  # process 0 has read both hellos
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_killed_peer_is_known_to_every_other_process(group) -> None:
    hub, one, two = group
    t0 = time.monotonic()
    os.kill(two.pid, signal.SIGKILL)
    # Process 0 sees the connection close; it tells process 1, and both leave.
    code, said = _exit(hub)
    assert code == 3 and said.startswith("LOST 2 process 2's connection to the peer watch"), said
    code, said = _exit(one)
    assert code == 3 and said == "LOST 2 process 0 reports process 2 gone", said
    print(f"both knew within {time.monotonic() - t0:.3f}s")


def test_when_process_0_is_killed_every_other_process_leaves(group) -> None:
    hub, one, two = group
    os.kill(hub.pid, signal.SIGKILL)
    for p in (one, two):
        code, said = _exit(p)
        assert code == 3 and said.startswith("LOST 0 the connection to process 0's peer watch"), said


def _leaves_in_order(p: subprocess.Popen[str], others: list[subprocess.Popen[str]]) -> None:
    """``p`` says bye and exits; the others stay (its connection has closed by the time they are checked)."""
    _say(p, "bye")
    assert _exit(p) == (0, "BYE True")
    time.sleep(0.5)
    assert all(o.poll() is None for o in others), "an orderly end was taken for a loss"


def test_an_orderly_exit_is_not_a_loss(group) -> None:
    hub, one, two = group
    _leaves_in_order(one, [hub, two])
    # The watch still watches: the next loss is process 2's, not process 1's.
    os.kill(two.pid, signal.SIGKILL)
    code, said = _exit(hub)
    assert code == 3 and said.startswith("LOST 2 "), said


def test_process_0_saying_bye_outlasts_the_others_and_lets_them_finish(group) -> None:
    # Process 0 hosts the coordination service: ending in order, it goes last, as soon as its peers have gone.
    hub, one, two = group
    _say(hub, "bye")
    time.sleep(0.5)
    assert hub.poll() is None, "process 0 went before its peers"
    _leaves_in_order(one, [hub, two])
    t0 = time.monotonic()
    _leaves_in_order(two, [])
    assert _exit(hub) == (0, "BYE True")
    assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("group", [1.0], indirect=True)
def test_process_0_outlasts_a_peer_that_stays_only_for_its_timeout(group) -> None:
    hub, one, two = group
    _leaves_in_order(one, [hub, two])
    _say(hub, "bye")
    assert _exit(hub, timeout=5) == (0, "BYE False")
    time.sleep(0.5)
    assert two.poll() is None  # a bye is no loss: the peer left waiting was not told to leave


def test_a_stranger_dialling_process_0_is_ignored() -> None:
    lost: list[tuple[int, str]] = []
    watch = PeerWatch(0, 2, lambda peer, why: lost.append((peer, why)))
    host, port = watch.listen("127.0.0.1", "127.0.0.1").rsplit(":", 1)
    import socket

    for request in (b"GET / HTTP/1.0\r\n\r\n", b"HEAD / HTTP/1.0\r\n\r\n", b""):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(request)
    time.sleep(0.3)
    assert lost == [] and watch.lost is None
    watch.bye()


def test_an_error_a_vanished_peer_left_waits_for_the_watch_to_name_it() -> None:
    """A collective's broken connection can reach the worker before the watch does; the worker then waits for
    the watch (``wait_lost``) before it reports, so the report names the peer, not a failure of its own."""
    from training.elastic.peerwatch import looks_like_a_lost_peer

    lost: list[tuple[int, str]] = []
    watch = PeerWatch(0, 2, lambda peer, why: lost.append((peer, why)))
    address = watch.listen("127.0.0.1", "127.0.0.1")
    t0 = time.monotonic()
    assert watch.wait_lost(0.2) is False and time.monotonic() - t0 >= 0.2  # nothing gone: it waited its time
    peer = _start(1, 2, address)
    try:
        assert _line(peer) == "READY"
        deadline = time.monotonic() + 10
        while 1 not in watch.heard_from() and time.monotonic() < deadline:  # process 0 has read the hello
            time.sleep(0.01)
        os.kill(peer.pid, signal.SIGKILL)
        assert watch.wait_lost(5) is True
        assert watch.lost is not None and watch.lost[0] == 1
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:  # the callback runs in the watch's thread, just after
            time.sleep(0.01)
        assert lost == [watch.lost]
    finally:
        peer.kill()
        peer.wait()
    # What gloo said in the survivors of a killed host (their collective's connection broken) ...
    for said in (
        "JaxRuntimeError: UNKNOWN: Gloo all-reduce failed: [external/xla++third_party_ext+gloo/gloo/transport/tcp/"
        "pair.cc:538] Read error [127.0.0.1]:11912: Connection reset by peer",
        "JaxRuntimeError: UNKNOWN: Gloo all-reduce failed: [external/xla++third_party_ext+gloo/gloo/transport/tcp/"
        "pair.cc:547] Connection closed by peer [127.0.0.1]:23426",
    ):
        assert looks_like_a_lost_peer(said)
    # ... and errors of a worker's own, which are reported at once.
    for said in ("ValueError: loss is NaN", "OSError: [Errno 28] No space left on device", "RESOURCE_EXHAUSTED: OOM"):
        assert not looks_like_a_lost_peer(said)
