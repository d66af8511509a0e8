"""``rtrain train``'s one driver, whatever the backend: provision, launch, follow with the engine's watch, release.

Each backend answers the same verbs (:class:`~training.backends.base.Backend`); what differs between
them is what the command says at each step, which a backend's :class:`Lines` give.  Ctrl-C asks the
job to stop at a step boundary, and the driver follows it until it has (a second Ctrl-C stops
following); the hosts are released however the drive ends, except for a detached job and one the
driver lost touch with (said in one line, with what to do).  A release gives back what this drive
provisioned and the jobs it launched, nothing of another job of the run.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Protocol

from training.api import Event, JobLook, RunStatus
from training.backends.base import Backend, BackendError, JobHandle, Provisioned, Released, Timeouts, first_line
from training.backends.spec import JobSpec
from training.backends.watch import Look, Unreadable, watch

GIVE_UP_S = 900.0  # rtrain train stops following a job it could not look at for this long (it leaves it running)


class OutOfTouch(BackendError):
    """No look at a followed job succeeded for a long time: it may still run, with its hosts."""


class Lines(Protocol):
    """What ``rtrain train`` says of one backend's steps ("" says nothing)."""

    def provisioned(self, up: Provisioned) -> str: ...

    def launched(self, handle: JobHandle) -> str: ...

    def detached(self, handle: JobHandle) -> str: ...

    def out_of_touch(self, error: OutOfTouch) -> str: ...

    def released(self, out: Released) -> str: ...

    def release_failed(self, error: Exception) -> str: ...


@dataclass
class Say:
    """Where the driver says things: a line, the run's status, an event of note (each as the command shows it)."""

    line: Callable[[str], None]
    status: Callable[[RunStatus], None] = lambda st: None
    event: Callable[[Event], None] = lambda ev: None


@dataclass
class Drive:
    """One run driven from here through its backend."""

    backend: Backend
    job: JobSpec
    lines: Lines
    say: Say
    limits: Timeouts
    poll_s: float = 10.0
    give_up_s: float = GIVE_UP_S
    release_errors: tuple[type[Exception], ...] = (BackendError,)  # a release that fails with these is said
    handles: list[JobHandle] = field(default_factory=list)

    def start(self) -> JobHandle:
        """Provision the hosts and launch the job."""
        self._say(self.lines.provisioned(self.backend.provision(self.job)))
        self.handles.append(self.backend.launch(self.job, attempt=1))
        self._say(self.lines.launched(self.handles[-1]))
        return self.handles[-1]

    def follow(self, handle: JobHandle) -> JobLook:
        """Follow the job to its end with the engine's watch; its last look.

        A look that fails is said and the job looked at again at the next poll: the job runs on
        without us.  After ``give_up_s`` of nothing but failed looks: :class:`OutOfTouch`.
        """
        told = ""
        with CtrlC(self.backend, handle, self.say.line):
            for look in watch(
                self.backend, handle, self.limits, events_after=handle["events_after"], poll_s=self.poll_s
            ):
                if isinstance(look, Unreadable):
                    out_for = time.monotonic() - look.since
                    if out_for >= self.give_up_s:
                        raise OutOfTouch(
                            f"no look at job {handle.get('job')} succeeded for {out_for:.0f}s ({first_line(look.error)})"
                        )
                    self.say.line(
                        f"looking at the job failed ({first_line(look.error)}); looking again in {self.poll_s:g}s"
                    )
                    continue
                self._show(look, handle)
                if look.waiting != told:
                    self.say.line(f"pods waiting: {look.waiting}" if look.waiting else "no pod waits any more")
                    told = look.waiting
                if look.final:
                    return look.job_look()
        raise AssertionError("the watch ends with a final look")  # pragma: no cover

    def _show(self, look: Look, handle: JobHandle) -> None:
        for ev in look.events:
            self.say.event(ev)
        if look.status and look.status.get("job") in (handle.get("job"), None):
            self.say.status(look.status)

    def run(self, detach: bool = False) -> JobLook | None:
        """Start the job, follow it to its end, then release its hosts; the last look.

        None, with the job and its hosts left up: ``detach``, or :class:`OutOfTouch` (said in one line).
        """
        keep = False
        try:
            handle = self.start()
            if detach:
                keep = True
                self._say(self.lines.detached(handle))
                return None
            return self.follow(handle)
        except OutOfTouch as e:
            keep = True
            self._say(self.lines.out_of_touch(e))
            return None
        finally:
            if not keep:
                self._say(self.release())

    def release(self) -> str:
        """Give the hosts back (the jobs launched here stopped first); what was done, in one line."""
        try:
            return self.lines.released(self.backend.release(self.job, [dict(h) for h in self.handles]))
        except self.release_errors as e:
            return self.lines.release_failed(e)

    def _say(self, line: str) -> None:
        if line:
            self.say.line(line)


class CtrlC:
    """While installed: the first Ctrl-C asks the job to stop (resumable), a second one interrupts the command."""

    def __init__(self, backend: Backend, handle: JobHandle, say: Callable[[str], None]) -> None:
        self.backend, self.handle, self.say = backend, handle, say
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
        self.say("interrupted: the job stops at its next step boundary and commits it (Ctrl-C again to leave it)")
        self.backend.stop(self.handle, "interrupted (Ctrl-C)")
