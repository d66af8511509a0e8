"""Linux process controls (``prctl``): a process's death signal, a thread's name, the reaper of its orphans."""

from __future__ import annotations

import ctypes
import errno
import functools
from collections.abc import Callable
from typing import Any

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
