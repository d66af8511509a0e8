"""Linux process controls: what they set shows in /proc, and a refused call says so."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from training import procctl


def test_a_thread_named_with_prctl_shows_its_name_in_proc_and_a_refused_call_raises() -> None:
    seen: list[str] = []

    def run() -> None:
        procctl.prctl(procctl.PR_SET_NAME, b"rtrain-test-name-too-long")
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == ["rtrain-test-nam"], seen  # the kernel keeps 15 bytes
    with pytest.raises(OSError, match=r"prctl\(-1\)"):
        procctl.prctl(-1, 0)  # no such option: EINVAL
