"""The processes a test starts: stopping a whole process group, and finding what was started from a directory."""

from __future__ import annotations

import contextlib
import os
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


def started_from(base: Path) -> list[Any]:
    """Live processes (not this one) whose command line names ``base`` or whose working directory is inside it."""
    import psutil

    root = str(base)
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd", "status"]):
        try:
            if p.info["pid"] == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cwd = p.info["cwd"] or ""
            if root in " ".join(p.info["cmdline"] or []) or cwd == root or cwd.startswith(root + os.sep):
                found.append(p)
        except psutil.Error:
            continue
    return found
