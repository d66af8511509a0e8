"""Background threads that take only the CPU the training loop leaves: saves and compiling ahead.

A save's bookkeeping and a compile compete with the training step for the host's cores; where the
step waits on its collectives the cores are idle, and background work fills those gaps at a lower
priority instead of delaying the step.  On Linux niceness is per thread and inherited by the threads
a thread starts, so the checkpoint library's own threads, started from a lowered one, are lowered too.
"""

from __future__ import annotations

import contextlib
import os
import threading

BACKGROUND_NICE = 10  # against a busy thread 10 below it, a thread gets about a tenth of a core
MAX_NICE = 19


def lower_this_thread(by: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's priority (and that of the threads it starts from now on) ``by`` nice levels.

    A no-op where the platform has no per-thread priority or refuses it.
    """
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no setpriority here
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + by))


def idle_this_thread() -> None:
    """Run the calling thread (and the threads it starts from now on) only when nothing else wants a core.

    Below every niceness (Linux's idle class): below the collectives' transport threads
    too, which a CPU slice runs at the lowest niceness.  Falls back to the lowest
    niceness where the platform has no idle class or refuses it.
    """
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # AttributeError: no SCHED_IDLE here
        lower_this_thread(by=MAX_NICE)
