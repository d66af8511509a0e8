"""The processes a test starts: stopping a whole process group, and finding what was started from a directory."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any


def stop_process_group(proc: subprocess.Popen[Any], grace_s: float = 20.0) -> None:
    """Stop a process started with ``start_new_session`` and its whole group: SIGTERM, then SIGKILL to whatever is
    left of the group once the leader exited or ``grace_s`` passed (a server's workers may outlive it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def names(cmdline: list[str], cwd: str, base: Path) -> bool:
    """Whether a process's command line names ``base`` or a path inside it, or its working directory is inside it.

    On a path's boundary: ``/tmp/pytest-1`` names neither ``/tmp/pytest-12`` nor ``/tmp/pytest-1.x`` (another
    test session's directory), and is named within an argument (``--run=file:///tmp/pytest-1/run``).
    """
    root = str(base)
    inside = re.compile(re.escape(root) + r"(?![\w.-])")  # the name goes on: another directory
    return cwd == root or cwd.startswith(root + os.sep) or any(inside.search(arg) for arg in cmdline)


def started_from(base: Path) -> list[Any]:
    """Live processes (not this one) whose command line names ``base`` or whose working directory is inside it."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd", "status"]):
        try:
            if p.info["pid"] == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if names(p.info["cmdline"] or [], p.info["cwd"] or "", base):
                found.append(p)
        except psutil.Error:
            continue
    return found
