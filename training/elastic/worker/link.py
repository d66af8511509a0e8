"""A worker's link to its agent and its round: the assignment it reads, its reports, the peer watch, how it leaves.

The peer watch and the local tier a round opened are held here, so that leaving (from any thread) says bye to
the one and lets the other finish its write in flight.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from training import procctl
from training.elastic.codes import WorkerExit
from training.elastic.peerwatch import looks_like_a_lost_peer
from training.elastic.rendezvous import ResumeFrom
from training.elastic.wire import ReportType, report

if TYPE_CHECKING:
    from training.checkpoint.local import LocalTier
    from training.elastic.peerwatch import PeerWatch


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its agent dies (Linux), and check it has not already."""
    parent = int(os.environ.get("RTRAIN_AGENT_PID", "0"))
    try:
        procctl.prctl(procctl.PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the pipe to the agent still breaks when it dies
        pass
    if parent and os.getppid() != parent:
        os._exit(WorkerExit.ERROR)


class Reporter:
    """JSON lines to the agent through the pipe it passed (``RTRAIN_CONTROL_FD``)."""

    def __init__(self) -> None:
        fd = int(os.environ["RTRAIN_CONTROL_FD"])
        self.pipe = os.fdopen(fd, "w", buffering=1)
        self.rank = -1
        self.round = -1
        self.lock = threading.Lock()  # the loop and the peer watch's thread both report

    def send(self, type_: ReportType, *, everyone: bool = False, **fields: Any) -> None:
        """Report to the agent; most reports come from rank 0 only (``everyone``: from every rank)."""
        if self.rank != 0 and not everyone:
            return
        line = report(type_, self.round, self.rank, **fields).line()
        with self.lock:
            self.pipe.write(line)
            self.pipe.flush()


@dataclass(frozen=True)
class Assignment:
    round: int
    rank: int
    processes: int
    coordinator: str
    bind: str
    resume: ResumeFrom
    faults: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    watch_port: int = 0  # process 0: the peer watch's port (0: a free one)
    job: str = ""  # the job this round belongs to (its kept compiled steps are its own)

    @classmethod
    def read(cls, stream: Any) -> Assignment:
        line = stream.readline()
        if not line:
            os._exit(0)  # the agent closed the pipe before assigning anything: not needed
        a = json.loads(line)
        return cls(
            int(a["round"]),
            int(a["rank"]),
            int(a["processes"]),
            str(a["coordinator"]),
            str(a.get("bind") or ""),
            ResumeFrom.read(a["resume"]),
            tuple(a.get("faults") or ()),
            tuple(sorted((str(k), str(v)) for k, v in (a.get("env") or {}).items())),
            int(a.get("watch_port") or 0),
            str(a.get("job") or ""),
        )


# This process's end of the round's peer watch (:mod:`training.elastic.peerwatch`), once it has one.
WATCH: PeerWatch | None = None
# How long process 0, at the end of its program (finished, or stopped at a checkpoint), waits for the
# others to go first: they may still be finishing the last save, and its coordination service goes with it.
OUTLAST_S = 60.0
# How long an error that looks like a vanished peer's waits for the peer watch to name it.
PEER_CONFIRM_S = 0.5
# This process's local checkpoint tier (:class:`training.checkpoint.local.LocalTier`), once it has one, and how
# long a process that leaves lets its local copy in flight finish: a round that breaks keeps that copy.
TIER: LocalTier | None = None
LOCAL_WRITE_GRACE_S = 2.0


def hold_tier(tier: LocalTier | None) -> None:
    """Hold this round's local checkpoint tier: a process that leaves lets its write in flight finish first."""
    global TIER
    TIER = tier


def outlast_peers() -> None:
    """At the end of this process's program: bye to the peer watch, and (process 0) let the others go first."""
    if WATCH is not None:
        WATCH.bye()
        WATCH.outlast(OUTLAST_S)


def leave(rep: Reporter, code: WorkerExit, error: str = "", **fields: Any) -> NoReturn:
    """Report and exit at once.  An orderly end says bye to the peer watch first; an error does not,
    so the round's other processes leave at once too instead of waiting in a collective for this one."""
    if WATCH is not None:
        if code not in (WorkerExit.ERROR, WorkerExit.TASK):
            WATCH.bye()
        elif "peer_lost" not in fields and (
            # The collective's broken connection can reach this thread before the watch's own: give the watch
            # a moment to name the peer, not to report a failure of ours.
            WATCH.lost is not None or (looks_like_a_lost_peer(error) and WATCH.wait_lost(PEER_CONFIRM_S))
        ):
            # This error is what a vanished peer left behind (a collective that failed, the task's code's own
            # computation too): say so, and the job recovers from it.
            code = WorkerExit.ERROR
            assert WATCH.lost is not None  # set before wait_lost returns True, and never unset
            peer, why = WATCH.lost
            fields["peer_lost"] = peer
            error = f"{error} (peer process {peer} is gone: {why})"
    if TIER is not None:
        TIER.finish_writing(LOCAL_WRITE_GRACE_S)  # before the report: the agent describes what is on disk
    if error:
        try:
            rep.send(ReportType.ERROR, everyone=True, error=error, **fields)
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def watch_peers(a: Assignment, rep: Reporter) -> None:
    """Join the round's peer watch: when another process of the round is gone, this one leaves at once."""
    global WATCH
    from jax._src import distributed  # JAX's coordination service client (no public accessor)

    from training.elastic import peerwatch

    def lost(peer: int, why: str) -> None:
        leave(rep, WorkerExit.ERROR, f"peer process {peer} of round {a.round} is gone: {why}", peer_lost=peer)

    coordinator_host = a.coordinator.rsplit(":", 1)[0]
    WATCH = peerwatch.start(
        distributed.global_state.client,
        a.rank,
        a.processes,
        lost,
        bind_host=(a.bind.rsplit(":", 1)[0] if a.bind else "") or coordinator_host,
        advertise_host=coordinator_host,
        port=a.watch_port,
    )
