"""The host watch: the leader learns within milliseconds that a host's agent is gone.

Heartbeats alone cannot tell a dead host from a loaded one quickly: after a
failure the leader waits for the settle (a few heartbeats) before it drops a
silent member.  So every agent also listens on a port of its own and
advertises it in its heartbeat record, and the leader holds one TCP connection
to each agent it reads.  The kernel closes a dead process's sockets at once,
and TCP keepalive covers a machine that vanished, so a connection that ends
means that agent is gone: the leader forms the next round without it at once.
A host whose connection never opened, or stays open while it is silent (a
frozen process), still waits for the settle.

The other agents hold one such connection to the leader's agent.  One that the
leader's kernel ended (closed or reset, not timed out) means that process has
exited, and with it its lease keeper: the lease cannot be renewed again, so an
agent may take it over without waiting for it to lapse.

Nothing travels on a connection: the agent's side only accepts and holds it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable

from training.elastic.peerwatch import WATCH_PORT_OFFSET, accept, keepalive, listening_socket

log = logging.getLogger(__name__)

RETRY_S = 2.0  # a connection that could not be opened is tried again after this long


def host_watch_port(coordinator_port: int) -> int:
    """An agent's host watch port next to its fixed coordinator port, after the peer watch's (0: any free)."""
    return coordinator_port + WATCH_PORT_OFFSET + 1 if coordinator_port else 0


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


class _Loop:
    """A selector served by one daemon thread; other threads hand it work through a queue."""

    def __init__(self, name: str) -> None:
        self.sel = selectors.DefaultSelector()
        self._todo: queue.Queue[Callable[[], None]] = queue.Queue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, self._woken)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's thread."""
        self._todo.put(fn)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _woken(self, sock: socket.socket, _mask: int) -> None:
        with contextlib.suppress(OSError):
            sock.recv(4096)
        while True:
            try:
                fn = self._todo.get_nowait()
            except queue.Empty:
                return
            fn()

    def _run(self) -> None:
        while not self._closed:
            try:
                events = self.sel.select(timeout=1.0)
            except (OSError, ValueError):
                return
            for key, mask in events:
                key.data(key.fileobj, mask)

    def drop(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(sock)
        sock.close()

    def close(self) -> None:
        def stop() -> None:
            self._closed = True
            for key in list(self.sel.get_map().values()):
                if key.fileobj is not self._wake_r:
                    self.drop(key.fileobj)  # type: ignore[arg-type]

        self.call(stop)
        self._thread.join(timeout=2.0)
        with contextlib.suppress(OSError):
            self._wake_w.close()
            self._wake_r.close()


class Listener:
    """An agent's end: accepts the leader's connections and holds them for as long as this process lives."""

    def __init__(self, bind_host: str, advertise_host: str, port: int = 0) -> None:
        self._srv = listening_socket(bind_host, port, 16)
        self.address = f"{advertise_host}:{self._srv.getsockname()[1]}"
        self._loop = _Loop("rtrain-host-watch")
        self._loop.call(self._register)

    def _register(self) -> None:
        self._loop.sel.register(self._srv, selectors.EVENT_READ, self._accept)

    def _accept(self, srv: socket.socket, _mask: int) -> None:
        conn = accept(srv)
        if conn is not None:
            self._loop.sel.register(conn, selectors.EVENT_READ, self._readable)

    def _readable(self, conn: socket.socket, _mask: int) -> None:
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._loop.drop(conn)

    def close(self) -> None:
        self._loop.close()


class HostWatch:
    """The leader's end: one connection to each host's agent; :meth:`gone` says which agents' connections ended.

    An agent is known by its host and the time it started (a restarted agent is another one).
    """

    def __init__(self) -> None:
        self._loop = _Loop("rtrain-host-watch")
        self._lock = threading.Lock()
        self._open: dict[tuple[str, float], str] = {}  # agent -> the address its connection is open (or opening) to
        self._gone: dict[tuple[str, float], bool] = {}  # agent whose connection ended -> by its kernel (not a timeout)
        self._failed: dict[tuple[str, float], float] = {}  # agent -> when (monotonic) a connect failed
        self._refused: set[tuple[str, float]] = set()  # agents whose last dial was refused (nothing listens there)

    def watch(self, host: str, started: float, address: str) -> None:
        """Hold a connection to this agent (no-op when one is open or it is gone; cheap to call every scan)."""
        agent = (host, started)
        if not address:
            return
        with self._lock:
            if agent in self._open or agent in self._gone:
                return
            if time.monotonic() - self._failed.get(agent, -RETRY_S) < RETRY_S:
                return
            self._open[agent] = address
        self._loop.call(lambda: self._connect(agent, address))

    def gone(self, host: str, started: float) -> bool:
        """True when this agent's connection was open and has ended: its process is gone."""
        with self._lock:
            return (host, started) in self._gone

    def exited(self, host: str, started: float) -> bool:
        """True when this agent's own kernel ended its connection (closed or reset): its process has exited.

        A connection that timed out (TCP keepalive: a machine that vanished, or a network that did) is gone,
        but no proof that the process stopped.
        """
        with self._lock:
            return self._gone.get((host, started), False)

    def refused(self, host: str, started: float) -> bool:
        """True when the last dial of this agent was refused: nothing listens at its address now.

        No proof of death by itself (a network can refuse a live host), but for an earlier agent of
        the caller's own host it is: see the leadership's takeover.
        """
        with self._lock:
            return (host, started) in self._refused

    def forget(self, host: str, started: float) -> None:
        """Take back that this agent is gone (it has beaten since): the next :meth:`watch` dials it again."""
        with self._lock:
            self._gone.pop((host, started), None)
            self._failed.pop((host, started), None)
            self._refused.discard((host, started))

    def close(self) -> None:
        self._loop.close()

    # --- the loop's thread ----------------------------------------------------------------------

    def _connect(self, agent: tuple[str, float], address: str) -> None:
        try:
            host, port = _split(address)
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(info[0], socket.SOCK_STREAM)
            sock.setblocking(False)
            rc = sock.connect_ex(info[4])
        except OSError as e:
            self._not_opened(agent, str(e))
            return
        if rc not in (0, errno.EINPROGRESS):
            sock.close()
            self._not_opened(agent, rc)
            return
        self._loop.sel.register(sock, selectors.EVENT_WRITE, lambda s, m: self._opened(agent, s))

    def _opened(self, agent: tuple[str, float], sock: socket.socket) -> None:
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._loop.drop(sock)
            self._not_opened(agent, err)
            return
        keepalive(sock)
        with self._lock:
            self._failed.pop(agent, None)
            self._refused.discard(agent)
        self._loop.sel.modify(sock, selectors.EVENT_READ, lambda s, m: self._readable(agent, s))

    def _not_opened(self, agent: tuple[str, float], why: int | str) -> None:
        name = errno.errorcode.get(why, str(why)) if isinstance(why, int) else why
        log.info("host watch: cannot reach the agent of %s (%s); tried again later", agent[0], name)
        with self._lock:
            self._open.pop(agent, None)
            self._failed[agent] = time.monotonic()
            if why == errno.ECONNREFUSED:
                self._refused.add(agent)
            else:
                self._refused.discard(agent)

    def _readable(self, agent: tuple[str, float], sock: socket.socket) -> None:
        exited = True
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except ConnectionResetError:
            data = b""
        except OSError:  # timed out (keepalive), unreachable: gone, but not known to have exited
            data, exited = b"", False
        if data:
            return  # nothing is sent on a watch connection; ignore it
        self._loop.drop(sock)
        with self._lock:
            self._open.pop(agent, None)
            self._gone[agent] = exited
        log.warning(
            "host watch: the agent of %s is gone (its connection %s)", agent[0], "ended" if exited else "timed out"
        )
