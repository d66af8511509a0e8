"""Exit codes of the processes of a job (shared by the worker, the host agent and the local slice)."""

from __future__ import annotations

from enum import IntEnum


class WorkerExit(IntEnum):
    """How a worker process ends; its agent turns this into the round's report."""

    OK = 0  # finished, or stopped at a checkpoint because the leader asked
    ERROR = 1  # an exception (a collective error when a peer vanished, a bug); its last line is reported
    GUARD = 17  # the in-training guard refused a loss before saving
    CORRUPT = 18  # the checkpoint to restore failed its integrity check
    NOTICE = 19  # a preemption notice: the group stopped at a step boundary, and that step is committed
    TASK = 20  # the task's own code raised (its factory, init, loss, data...): the job ends, as it would again


class AgentExit(IntEnum):
    """How a host agent ends (a pod's exit code on GKE)."""

    FINISHED = 0  # the job finished
    FAILED = 3  # the job failed for good (the reason is in status.json and the events); 1 is a crash
    SUPERSEDED = 5  # another job owns the run now
    INTERRUPTED = 6  # stopped by a signal (SIGTERM / SIGINT): this host left
    STOPPED = 7  # a person stopped the job (rtrain stop, a cancel, a teardown): over, resumable by a new launch

    @classmethod
    def of_final(cls, final: str) -> AgentExit:
        """The exit of every agent of a job whose stop round says ``final`` (a RunState's value)."""
        return {"finished": cls.FINISHED, "stopped": cls.STOPPED, "cancelled": cls.STOPPED}.get(final, cls.FAILED)
