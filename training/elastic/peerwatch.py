"""The peer watch: every process of a round learns within milliseconds that another one is gone.

Why: a collective already waiting on a peer that dies may never fail (gloo on the local slice waits
on; JAX's coordination service notices only after ``heartbeat_timeout_seconds``), so a lost host
would cost the survivors seconds before anyone acts.

Each process of a round holds one TCP connection to process 0 (a star).  One that closes without a
``bye`` means its process is gone (the kernel closes a dead process's sockets at once; TCP keepalive
covers a vanished machine): process 0 tells the others which peer went, and every process leaves
with that reason.  A process that ends in order says ``bye`` first (the group stops at the same step
everywhere).  Process 0 outlasts the others (:meth:`PeerWatch.outlast`): it hosts the coordination
service, without which a peer still saving aborts.  Peers find process 0's address in the
coordination service's key-value store.  One daemon thread per process waits in ``select``, without
the GIL.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

KEY = "rtrain/peer_watch"  # the coordination service's key for process 0's address (one service per round)
HELLO, BYE, LOST = b"H", b"B", b"L"  # one byte, then the rank as 4 bytes (big-endian)
KEEPALIVE = {"TCP_KEEPIDLE": 2, "TCP_KEEPINTVL": 1, "TCP_KEEPCNT": 3}  # a silent peer: gone after ~5 s
# What a collective's transport says when the process at the other end went (gloo over TCP, and sockets at large).
LOST_PEER_ERRORS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
# The watches listen this far above a fixed coordinator port: 8476 + 14 = 8490 (peer watch), 8491 (host watch).
# Out of 8470-8482, where a TPU VM's runtime listens (libtpu's 8471 and the per-process ports above it, JAX's
# own Cloud TPU coordinator at 8482); training.gke.manifests declares the same ports in the pod.
WATCH_PORT_OFFSET = 14


def peer_watch_port(coordinator_port: int) -> int:
    """Process 0's peer watch port for a round whose coordinator listens on ``coordinator_port`` (0: any free)."""
    return coordinator_port + WATCH_PORT_OFFSET if coordinator_port else 0


def looks_like_a_lost_peer(error: str) -> bool:
    """Whether an error is what a vanished peer leaves behind in a collective (its connection broken)."""
    return any(s in error for s in LOST_PEER_ERRORS)


def keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timers apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def listening_socket(bind_host: str, port: int, backlog: int) -> socket.socket:
    """A non-blocking TCP listener on ``bind_host:port`` (0: any free port; IPv6 when the host is)."""
    bind_host = bind_host.strip("[]")
    srv = socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind_host, port))
    srv.listen(backlog)
    srv.setblocking(False)
    return srv


def accept(srv: socket.socket) -> socket.socket | None:
    """The next connection on a listener, with keepalive and non-blocking (None: there was none)."""
    try:
        conn, _ = srv.accept()
    except OSError:
        return None
    keepalive(conn)
    conn.setblocking(False)
    return conn


def _msg(kind: bytes, rank: int) -> bytes:
    return kind + rank.to_bytes(4, "big")


class PeerWatch:
    """One process's end of the round's watch.  ``on_lost(rank, why)`` is called once, from the watch's thread.

    Process 0 calls :meth:`listen`, the others :meth:`connect` (:func:`start` does either, with the
    address passed through JAX's key-value store); every process calls :meth:`bye` before an orderly exit.
    """

    def __init__(self, rank: int, processes: int, on_lost: Callable[[int, str], None]) -> None:
        self.rank = rank
        self.processes = processes
        self.on_lost = on_lost
        self.lost: tuple[int, str] | None = None
        self._found = threading.Event()  # set with ``lost``
        self.address = ""
        self._sel = selectors.DefaultSelector()
        self._peers: dict[int, socket.socket] = {}  # process 0: rank -> connection
        self._hub: socket.socket | None = None  # the others: the connection to process 0
        self._listener: socket.socket | None = None
        self._buffers: dict[int, bytearray] = {}
        self._said_bye: set[int] = set()  # process 0: the ranks that said bye; the others: {-1} once 0 did
        self._closing = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # --- starting ---------------------------------------------------------------------------

    def listen(self, bind_host: str, advertise_host: str, port: int = 0) -> str:
        """Process 0: listen, and return the address the others dial (``host:port``)."""
        srv = listening_socket(bind_host, port, max(self.processes, 8))
        self._listener = srv
        self._sel.register(srv, selectors.EVENT_READ, self._accept)
        self.address = f"{advertise_host}:{srv.getsockname()[1]}"
        self._run()
        return self.address

    def connect(self, address: str, timeout: float = 30.0) -> None:
        """Every other process: dial process 0 and say who this is."""
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        keepalive(sock)
        sock.sendall(_msg(HELLO, self.rank))
        sock.setblocking(False)
        self._hub = sock
        self._sel.register(sock, selectors.EVENT_READ, lambda c: self._readable(c, 0))
        self.address = address
        self._run()

    def _run(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rtrain-peer-watch", daemon=True)
        self._thread.start()

    # --- the watch's thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        # Process 0 watches on after its bye, until its peers have gone (:meth:`outlast` waits for that).
        while self.lost is None and not (self._closing and (self.rank != 0 or not self._peers)):
            try:
                events = self._sel.select(timeout=1.0)
            except (OSError, ValueError):  # closed under us (bye)
                return
            for key, _ in events:
                key.data(key.fileobj)

    def _accept(self, srv: socket.socket) -> None:
        conn = accept(srv)
        if conn is not None:
            self._sel.register(conn, selectors.EVENT_READ, lambda c: self._readable(c, None))

    def _readable(self, conn: socket.socket, rank: int | None) -> None:
        """Messages (5 bytes each) from one connection, or its end."""
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError as e:
            self._ended(conn, rank, str(e) or type(e).__name__)
            return
        if not data:
            self._ended(conn, rank, "closed")
            return
        buf = self._buffers.setdefault(conn.fileno(), bytearray())
        buf += data
        while len(buf) >= 5:
            kind, who = bytes(buf[:1]), int.from_bytes(buf[1:5], "big")
            del buf[:5]
            if rank is None:  # process 0: the first message says who dialled; anything else is a stranger
                if kind != HELLO or not 0 < who < self.processes or who in self._peers:
                    self._sel.unregister(conn)
                    self._buffers.pop(conn.fileno(), None)
                    conn.close()
                    return
                rank = who
                self._peers[who] = conn
                self._sel.modify(conn, selectors.EVENT_READ, lambda c, r=who: self._readable(c, r))
            elif kind == BYE:
                self._said_bye.add(-1 if self.rank != 0 else rank)
            elif kind == LOST and self.rank != 0:
                self._gone(who, f"process 0 reports process {who} gone")

    def _ended(self, conn: socket.socket, rank: int | None, why: str) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn)
        self._buffers.pop(conn.fileno(), None)
        conn.close()
        if self.rank == 0:
            if rank is None:
                return  # a connection that never said who it was (not one of ours)
            self._peers.pop(rank, None)
            if rank in self._said_bye or self._closing:
                return
            self._tell(rank)
            self._gone(rank, f"process {rank}'s connection to the peer watch {why}")
        elif -1 not in self._said_bye and not self._closing:
            self._gone(0, f"the connection to process 0's peer watch {why}")

    def _tell(self, rank: int) -> None:
        """Process 0: tell every other process which one went (best effort: they may be going too)."""
        for conn in list(self._peers.values()):
            with contextlib.suppress(OSError):
                conn.setblocking(True)
                conn.settimeout(1.0)
                conn.sendall(_msg(LOST, rank))

    def _gone(self, rank: int, why: str) -> None:
        with self._lock:
            if self.lost is not None or self._closing:
                return
            self.lost = (rank, why)
            self._found.set()
        log.warning("peer watch (process %d): %s", self.rank, why)
        self.on_lost(rank, why)

    def heard_from(self) -> frozenset[int]:
        """The ranks connected to this process's watch now (process 0: those whose hello it read)."""
        return frozenset(self._peers if self.rank == 0 else ({0} if self._hub is not None else ()))

    def wait_lost(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the watch to find a peer gone; whether it has."""
        return self._found.wait(timeout)

    # --- leaving --------------------------------------------------------------------------------

    def bye(self) -> None:
        """An orderly end: the others must not take this process's exit for a loss."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        conns = list(self._peers.values()) + ([self._hub] if self._hub is not None else [])
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.setblocking(True)
                conn.settimeout(1.0)
                conn.sendall(_msg(BYE, self.rank))

    def outlast(self, timeout: float) -> bool:
        """Process 0, after :meth:`bye`: wait until every peer's process has gone (its connection closed).

        True when they all went within ``timeout`` seconds; the other processes return at once.
        """
        deadline = time.monotonic() + timeout
        while self.rank == 0 and self._peers and self.lost is None:
            if time.monotonic() >= deadline:
                log.warning("peer watch: processes %s still running after %.0fs", sorted(self._peers), timeout)
                return False
            time.sleep(0.02)
        return True


def start(
    client: Any,
    rank: int,
    processes: int,
    on_lost: Callable[[int, str], None],
    *,
    bind_host: str = "",
    advertise_host: str = "",
    port: int = 0,
    timeout: float = 60.0,
) -> PeerWatch:
    """Start this process's end of the watch; ``client`` is JAX's coordination service client.

    Process 0 listens on ``bind_host:port`` (port 0: a free one) and publishes ``advertise_host`` and
    the port it got; the others read that address (waiting up to ``timeout`` seconds) and dial it.
    """
    watch = PeerWatch(rank, processes, on_lost)
    if rank == 0:
        client.key_value_set(KEY, watch.listen(bind_host, advertise_host, port))
    else:
        watch.connect(client.blocking_key_value_get(KEY, int(timeout * 1000)), timeout=timeout)
    return watch
