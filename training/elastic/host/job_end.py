"""The job's end as its leader records it: the ``finished`` or ``ended`` event, the final status, the stop round."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

from training.elastic.host.jobstatus import JobStatus
from training.elastic.host.round_end import RoundEnds
from training.elastic.host.rounds import Carried, LeaderRecords, RoundWriter
from training.elastic.rendezvous import HostRecord, Round
from training.events import RunState
from training.layout import RDV_RESERVE

log = logging.getLogger("rtrain.leader")


class JobEnd:
    """Records the job's end, each write under the lease: its event, then the final ``status.json`` and the stop round.

    A full run root gives back the space held for this moment and the end is written again; an end whose records a
    failing run root cut short is written again at the leader's next tick (:meth:`again`).  Each call returns the
    job's newest round: the stop round once written.
    """

    def __init__(
        self,
        rec: LeaderRecords,
        status: JobStatus,
        rounds: RoundWriter,
        ends: RoundEnds,
        write_final: Callable[[RunState], None],
    ) -> None:
        self.store = rec.store
        self.events = rec.events
        self.host = rec.host
        self.emit = rec.emit
        self.fence = rec.fence
        self.status = status
        self.rounds = rounds
        self.ends = ends  # the budgets spent, which the stop round carries
        self.write_final = write_final  # the leader's phase done, its status.json written as the state given

    def finished(self, rnd: Round | None, rank0: HostRecord | None) -> Round:
        """Every member finished: the job ends finished (``rank0``: the members' last word, the final step)."""
        self.status.finished(rank0)
        seconds = time.time() - self.status.started_at
        self.emit("finished", step=self.status.fields.get("step"), failures=self.ends.failures, seconds=seconds)
        return self.record(rnd, RunState.FINISHED, "")

    def failed(self, rnd: Round | None, reason: str, state: RunState) -> Round:
        """The job ends as failed, or as stopped at a person's request (``rtrain stop``, a cancel, a teardown)."""
        self.events.ended(state, reason, step=self.status.fields.get("step"), host=self.host)
        log.warning("[%s] the job ended %s: %s", self.host, state.value, reason)
        return self.record(rnd, state, reason)

    def again(self, rnd: Round | None) -> Round | None:
        """The job has ended: an end whose records a failing run root cut short is written again."""
        if self.status.ending is not None and (rnd is None or rnd.action != "stop"):
            return self.record(rnd, *self.status.ending)
        return rnd

    def record(self, rnd: Round | None, state: RunState, reason: str) -> Round:
        """Write the end: the final status, then the stop round after ``rnd``."""
        try:
            return self._write(rnd, state, reason)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            # A full disk: give back the space held for this moment, and record the end.
            log.warning("[%s] the run root is full; using the space held back to record the end", self.host)
            self.store.delete(RDV_RESERVE)
            return self._write(rnd, state, reason)

    def _write(self, rnd: Round | None, state: RunState, reason: str) -> Round:
        """One try at the end's records, under the lease: the final status, then the stop round (once)."""
        self.fence()
        self.status.ended(state, reason)
        self.write_final(state)
        if rnd is None or rnd.action != "stop":  # else written already (a retry after a full disk)
            rnd = self.rounds.stop(rnd, state, reason, Carried(self.ends.failures, self.ends.guards))
        return rnd
