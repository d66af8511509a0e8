"""``rtrain train``: the job launched through its config's backend (the local slice by default) by the one driver.

In the foreground the job runs in a process of its own (as under Airflow) and this command follows it
with :class:`training.backends.drive.Drive`: the events of note and the progress bar as they come, the
end in one line and its exit code.  Ctrl-C asks the job to stop at a step boundary and goes on
following it until it has (a second Ctrl-C stops following; the release then waits out the stop's
allowance before it kills what is left of this job).
"""

from __future__ import annotations

import math
import sys

from training.api import Event
from training.backends import Context, backend_for
from training.backends.base import JobHandle, Provisioned, Released
from training.backends.drive import Drive, OutOfTouch, Say
from training.backends.spec import JobSpec, placement
from training.backends.watch import BY_REQUEST, timeouts
from training.cli_common import Exit, Progress
from training.config import Config
from training.event_text import describe
from training.placement_traits import traits

POLL_S = 0.5  # between looks at the job (its status and events: files on this machine)


class RunLines:
    """What ``rtrain train`` says of a backend's steps: little, since the job's own events say the rest."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def provisioned(self, up: Provisioned) -> str:
        return ""  # (the hosts are given at launch, under the run lock)

    def launched(self, handle: JobHandle) -> str:
        return ""

    def detached(self, handle: JobHandle) -> str:
        cfg = self.cfg
        return (
            f"job {handle['job']} of run {cfg.run_name} {'followed' if handle.get('attached') else 'started'} "
            f"on {self.where()} ({cfg.run_uri}); follow it with `rtrain status {cfg.run_name}`"
            + ("" if cfg.root.endswith("var/runs") else f" --root {cfg.root}")
        )

    def where(self) -> str:
        """Where the job runs, as a line says it."""
        return "the local slice" if traits(self.cfg.placement.backend).hosts_here else self.cfg.placement.backend

    def out_of_touch(self, error: OutOfTouch) -> str:  # (the local slice is followed for as long as it runs)
        return f"{error}: the job is left running; follow it with `rtrain status {self.cfg.run_uri}`"

    def released(self, out: Released) -> str:
        return ""

    def release_failed(self, error: Exception) -> str:
        return f"could not stop what is left of the job: {error}"


def run_drive(cfg: Config, say: Say, detach: bool = False) -> Drive:
    """The one driver over the config's backend: in the foreground a backend that can gives the hosts at launch and
    a live job refuses it; detached, it follows a live job of the run instead."""
    job = JobSpec(cfg, placement(cfg.placement.backend))
    made = backend_for(job, Context(by="rtrain", foreground=not detach))
    return Drive(made, job, RunLines(cfg), say, timeouts(cfg.elastic), POLL_S, math.inf)


def train_here(cfg: Config) -> int:
    """Launch the job through its backend (the local slice: its hosts given under the run lock), follow it, say how
    it ended."""
    from training.api import status
    from training.elastic.local.local_slice import SHOWN
    from training.scalars import logdir

    progress = Progress(cfg.optimizer.steps)

    def event(ev: Event) -> None:
        if ev["type"] in SHOWN:
            progress.line(f"[{ev.get('source', '')}] {describe(ev)}")

    try:
        progress.line(
            f"run {cfg.run_name} at {cfg.run_uri}: {cfg.elastic.min_workers}..{cfg.elastic.max_workers} hosts, {cfg.optimizer.steps} steps"
        )
        progress.line(f"curves: tensorboard --logdir {logdir(cfg.run_uri)}")
        look = run_drive(cfg, Say(progress.line, progress.status, event)).run()
    finally:
        progress.close()
    assert look is not None  # (never detached, never out of touch)
    st = status(cfg.run_uri) or look.get("status") or {}
    if look["state"] == "finished":
        print(
            f"finished: step {st.get('step')}/{cfg.optimizer.steps}, loss {st.get('loss')}, "
            f"{st.get('failures', 0)} failure(s) absorbed"
        )
        return Exit.OK
    if look["state"] in BY_REQUEST:
        print(
            f"rtrain: the job was stopped: {look.get('reason') or st.get('reason') or 'asked to stop'}; newest committed "
            f"checkpoint {st.get('latest_committed', '-')} (`rtrain train` with the same run_name resumes from it)",
            file=sys.stderr,
        )
        return Exit.STOPPED
    print(f"rtrain: the job failed: {look.get('reason') or st.get('reason') or 'see the events'}", file=sys.stderr)
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
