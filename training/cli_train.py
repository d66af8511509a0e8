"""``rtrain train`` on the local slice: the job launched through the local backend, followed by the engine's watch.

In the foreground the job runs in a process of its own (as under Airflow) and this command follows it
with :func:`training.backends.watch.watch`: the events of note and the progress bar as they come, the
end in one line and its exit code.  Ctrl-C asks the job to stop at a step boundary and goes on
following it until it has (a second Ctrl-C leaves it stopping).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from types import FrameType

from training.backends.base import LocalHandle
from training.backends.local import LocalSliceBackend, pid_alive, stop_process_tree
from training.backends.spec import JobSpec
from training.backends.watch import Look, Unreadable, timeouts, watch
from training.cli_common import Exit, Progress
from training.config import Config
from training.event_text import describe

POLL_S = 0.5  # between looks at the job (its status and events: files on this machine)


class CtrlC:
    """While installed: the first Ctrl-C asks the job to stop (resumable), a second one interrupts this command."""

    def __init__(self, local: LocalSliceBackend, handle: LocalHandle, say: Progress) -> None:
        self.local, self.handle, self.say = local, handle, say
        self.asked = False
        self._old: object = None

    def __enter__(self) -> CtrlC:
        with contextlib.suppress(ValueError):  # not the main thread: Ctrl-C is not ours to handle
            self._old = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)  # type: ignore[arg-type]

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True
        self.say.line("interrupted: the job stops at its next step boundary and commits it (Ctrl-C again to leave it)")
        self.local.stop(self.handle, "interrupted (Ctrl-C)")


def follow(local: LocalSliceBackend, handle: LocalHandle, cfg: Config, progress: Progress) -> Look:
    """Follow the job to its end with the engine's watch: its events of note, its status; the final look."""
    from training.elastic.local.local_slice import SHOWN

    last: Look | None = None
    with CtrlC(local, handle, progress):
        for item in watch(local, handle, timeouts(cfg.elastic), events_after=handle["events_after"], poll_s=POLL_S):
            if isinstance(item, Unreadable):
                progress.line(f"reading the run failed ({item.error}); looking again")
                continue
            for ev in item.events:
                if ev["type"] in SHOWN:
                    progress.line(f"[{ev.get('source', '')}] {describe(ev)}")
            if item.status.get("job") == handle["job"]:
                progress.status(item.status)
            last = item
    assert last is not None  # the watch ends only after a final look
    return last


def settle(local: LocalSliceBackend, handle: LocalHandle, cfg: Config) -> None:
    """Wait for the job's slice process to have stopped its agents and gone; what is left after that is killed."""
    pid = int(handle.get("controller_pid") or 0)
    deadline = time.monotonic() + cfg.stop_allowance_s + 10  # the slice's own wait, and its last look
    while pid and pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid and pid_alive(pid):
        stop_process_tree(pid)


def train_here(cfg: Config) -> int:
    """Launch the job on the local slice (its hosts given under the run lock), follow it, say how it ended."""
    from training.api import status
    from training.scalars import logdir

    local = LocalSliceBackend(by="rtrain", provision=True, follow=False)  # a run held by another job: refused
    progress = Progress(cfg.optimizer.steps)
    try:
        progress.line(
            f"run {cfg.run_name} at {cfg.run_uri}: {cfg.elastic.min_workers}..{cfg.elastic.max_workers} hosts, {cfg.optimizer.steps} steps"
        )
        progress.line(f"curves: tensorboard --logdir {logdir(cfg.run_uri)}")
        handle = local.launch(JobSpec.local(cfg), attempt=1)
        try:
            look = follow(local, handle, cfg, progress)
        finally:
            settle(local, handle, cfg)
    finally:
        progress.close()
    st = status(cfg.run_uri) or look.status
    if look.outcome == "success":
        print(
            f"finished: step {st.get('step')}/{cfg.optimizer.steps}, loss {st.get('loss')}, "
            f"{st.get('failures', 0)} failure(s) absorbed"
        )
        return Exit.OK
    if look.outcome == "stopped":
        print(
            f"rtrain: the job was stopped: {look.reason or st.get('reason') or 'asked to stop'}; newest committed "
            f"checkpoint {st.get('latest_committed', '-')} (`rtrain train` with the same run_name resumes from it)",
            file=sys.stderr,
        )
        return Exit.STOPPED
    print(f"rtrain: the job failed: {look.reason or st.get('reason') or 'see the events'}", file=sys.stderr)
    show_worker_failure(cfg.run_uri)
    return Exit.FAILED


def show_worker_failure(run_uri: str) -> None:
    """The newest failure's worker error and the end of that worker's log."""
    from training.api import events

    fails = [e for e in events(run_uri, ("failure",)) if e.get("log")]
    if not fails:
        return
    f = fails[-1]
    print(f"last worker failure: {f.get('reason')}", file=sys.stderr)
    try:
        with open(f["log"], "rb") as fh:
            tail = fh.read()[-4000:].decode(errors="replace").splitlines()[-12:]
    except OSError:
        return
    print(f"--- the end of {f['log']}:", file=sys.stderr)
    for line in tail:
        print(f"    {line}", file=sys.stderr)
