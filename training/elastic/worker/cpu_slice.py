"""Thread priorities of a process on a CPU slice: the collectives' event loop yields to the step's compute.

On the CPU platform, JAX's multi-process collectives run over gloo, whose TCP
transport starts an event-loop thread in each process with the backend; while
collectives run, it polls its sockets without pause.  Where the same
cores also play the devices (a local slice of simulated hosts), that thread
takes about half of them from the threads that compute the step.  At the
lowest priority it still runs whenever a compute thread waits for a
collective, which is when it has work.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from training.background import MAX_NICE

_TASKS = Path("/proc/self/task")


def unnamed_threads() -> set[int]:
    """This process's native threads that nobody named (their OS name is the process's) and Python did not start."""
    if not sys.platform.startswith("linux") or not _TASKS.is_dir():
        return set()
    own = Path("/proc/self/comm").read_text().strip()
    python = {t.native_id for t in threading.enumerate()}
    found = set()
    for entry in _TASKS.iterdir():
        tid = int(entry.name)
        try:
            if tid not in python and (entry / "comm").read_text().strip() == own:
                found.add(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return found


class TransportThreads:
    """A mark made before the backend starts: the unnamed threads started after it (gloo's among them) are lowered."""

    def __init__(self) -> None:
        self.before = unnamed_threads()  # the coordination client's own: left as they are

    def lower(self, nice: int = MAX_NICE) -> list[int]:
        """Give the unnamed threads started since this object was made the lowest CPU priority; their ids."""
        lowered = []
        for tid in sorted(unnamed_threads() - self.before):
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:
                continue
            lowered.append(tid)
        return lowered
