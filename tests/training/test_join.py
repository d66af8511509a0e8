"""Joining a round: a process that comes before process 0 waits until its coordination service listens."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

from training.elastic.host.supervisor import free_port
from training.elastic.worker.join import wait_until_listening


def test_waiting_ends_when_something_listens_and_gives_up_after_its_timeout():
    port = free_port()
    srv = socket.socket()

    def listen_later() -> None:
        time.sleep(0.3)
        srv.bind(("127.0.0.1", port))
        srv.listen()

    later = threading.Thread(target=listen_later)
    t0 = time.monotonic()
    later.start()
    assert wait_until_listening(f"127.0.0.1:{port}", timeout=30)
    assert time.monotonic() - t0 >= 0.3  # not before it listened
    later.join()
    srv.close()
    t0 = time.monotonic()
    assert not wait_until_listening(f"127.0.0.1:{free_port()}", timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5


PROCESS = textwrap.dedent(
    """
    import os, sys, time
    import jax
    from training.elastic.worker.join import wait_until_listening
    rank, port = int(sys.argv[1]), sys.argv[2]
    if rank == 0:
        time.sleep(0.5)  # process 0 comes last: the other dials before anything listens
    else:
        assert wait_until_listening(f"127.0.0.1:{port}", timeout=60)
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, rank, initialization_timeout=60,
                               cluster_detection_method="deactivate")
    print("joined", jax.process_index(), jax.process_count(), flush=True)
    if rank == 0:
        sys.stdin.read()  # its coordination service stays up until process 1 has left (the test closes stdin)
    os._exit(0)
    """
)


def test_dialling_process_0_before_initialising_leaves_its_coordination_service_working():
    port = str(free_port())
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROCESS, str(rank), port],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (1, 0)
    ]
    # They leave in order: process 1 first, then process 0, whose coordination service would otherwise go
    # while process 1 is still connected to it (which aborts process 1).
    out = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], out
    assert out == ["joined 1 2\n", "joined 0 2\n"]
