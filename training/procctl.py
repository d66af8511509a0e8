"""Linux process controls (``prctl``): a process's death signal, a thread's name, the reaper of its orphans, and a
process's title (what ``ps`` shows as its command line)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import setproctitle

PR_SET_PDEATHSIG = 1  # the signal this process gets when its parent dies
PR_SET_NAME = 15  # the calling thread's name, as ``top -H`` and /proc show it (up to 15 bytes)
PR_SET_CHILD_SUBREAPER = 36  # orphans below this process become its children, not init's


@functools.cache
def _prctl() -> Any | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # the process's own symbols: libc's, on Linux
    except (OSError, AttributeError):
        return None


def bound(option: int, arg: int | bytes) -> Callable[[], object]:
    """``prctl(option, arg)`` as a call that imports and looks up nothing (for a child between fork and exec);
    OSError here where there is no ``prctl`` (not Linux)."""
    fn = _prctl()
    if fn is None:
        raise OSError(errno.ENOSYS, "prctl: not on this platform")
    return functools.partial(fn, option, arg, 0, 0, 0)


def prctl(option: int, arg: int | bytes) -> None:
    """Call ``prctl(option, arg)``; OSError where it fails, or where there is none (not Linux)."""
    if bound(option, arg)() != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


def job_title(role: str, run: str, job: str, *where: str) -> str:
    """The title of one of a job's processes: ``rtrain worker h2 r3 <run> --job <job>`` (``where``: host, round)."""
    return " ".join(["rtrain", role, *where, run, "--job", job])


def set_title(title: str, name: str | None = None) -> None:
    """Make ``title`` this process's command line as ``ps`` and /proc/<pid>/cmdline show it; ``name``: the calling
    thread's OS name as well (up to 15 bytes: ``ps -e`` and ``top`` show the main thread's).

    Without ``name`` the thread keeps its name: setting a title renames the thread too, and a thread's name is how
    the threads a library started are told apart (:mod:`training.elastic.worker.cpu_slice`).
    """
    try:
        before = Path("/proc/thread-self/comm").read_bytes().rstrip(b"\n")
    except OSError:
        before = b""
    setproctitle.setproctitle(title)
    keep = name.encode() if name is not None else before
    if keep:
        with contextlib.suppress(OSError):
            prctl(PR_SET_NAME, keep[:15])


def start_detached(module: str, args: list[str], log: Path) -> int:
    """Run ``python -m module args`` in a session of its own (it outlives the caller), its output appended to ``log``."""
    import os
    import subprocess
    import sys

    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return proc.pid
