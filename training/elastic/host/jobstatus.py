"""The job's status as its leader writes it: ``status.json`` and the ``failed`` event.

``status.json`` is one small object, rewritten whole: every STATUS_S, and sooner when the step
moved, so that it trails training by about a second (rank 0's heartbeat carries the step within
the cadence's step beat, the leader reads it within a host scan).
"""

from __future__ import annotations

import logging
import time
from enum import StrEnum
from typing import Any

from training.cadence import STATUS_S, Cadence
from training.elastic.rendezvous import HostRecord, Round
from training.events import RunState, read_status, write_status
from training.mesh import MeshPlan
from training.storage import Store

log = logging.getLogger("rtrain.leader")


class Phase(StrEnum):
    """Where the leader's state machine is (``training.elastic.host.leader``)."""

    GATHER = "gather"
    FORM = "form"
    WAIT = "wait"
    RUNNING = "running"
    DONE = "done"


def inherited_phase(rnd: Round | None, waiting_since: float | None, now: float) -> tuple[Phase, float]:
    """Where a new leader's state machine starts, and since when, from the job's newest round and its status."""
    if rnd is None:
        return Phase.GATHER, now
    if rnd.action == "stop":
        return Phase.DONE, now
    if waiting_since is not None:
        # The job was waiting for capacity (no host was left, the local slice held the run):
        # hosts are back; wait on from when the wait began, then form a round on them.
        return Phase.WAIT, waiting_since
    return Phase.RUNNING, now


def run_state(phase: Phase, ending: tuple[RunState, str] | None, progressing: bool, rnd: Round | None) -> RunState:
    """The run's state that the status shows for the leader's phase."""
    if phase == Phase.DONE and ending is not None:
        return ending[0]
    if phase == Phase.GATHER:
        return RunState.STARTING
    if phase == Phase.WAIT:
        return RunState.WAITING_FOR_CAPACITY
    if phase == Phase.FORM:
        return RunState.RECOVERING
    if progressing:
        return RunState.RUNNING
    return RunState.STARTING if rnd is not None and rnd.reason == "start" else RunState.RECOVERING


class JobStatus:
    """The fields of the job's ``status.json``, rank 0's progress they follow, the job's end once decided."""

    def __init__(
        self, store: Store, cadence: Cadence, rnd: Round | None, *, run_uri: str, job: str, leader: str, steps: int
    ) -> None:
        self.store = store
        self.cadence = cadence
        self.run_uri = run_uri
        self.job = job
        self.leader = leader
        self.steps = steps
        now = time.time()
        st = read_status(store) or {}
        mine = st.get("job") == job
        self.started_at = float(st.get("started_at", now)) if mine else now
        self.fields: dict[str, Any] = {k: st[k] for k in ("step", "loss", "latest_committed") if mine and k in st}
        # The job was waiting for capacity when this leader took over: since when.
        self.waiting_since: float | None = None
        if mine and st.get("state") == RunState.WAITING_FOR_CAPACITY.value:
            self.waiting_since = float(st.get("waiting_since") or now)
        self.step_s = 0.0  # rank 0's latest step time
        self.last_step: int | None = None
        self.last_step_change = now
        self._written_at = 0.0
        self._written_step: Any = None  # the step status.json said when last written
        # The job's end, once decided (a leader that takes over an ended job: the end its stop round says).
        self.ending: tuple[RunState, str] | None = None
        if rnd is not None and rnd.action == "stop" and rnd.final in {x.value for x in RunState}:
            self.ended(RunState(rnd.final), rnd.reason)

    def ended(self, state: RunState, reason: str) -> None:
        """The job ends: ``state``, for ``reason``."""
        self.fields["reason"] = reason
        self.ending = (state, reason)

    def opened(self, rnd: Round, plan: MeshPlan, now: float) -> None:
        """A round opened: the status shows its members and mesh; no wait for capacity now."""
        self.last_step_change = now
        self.fields.update(workers=plan.workers, mesh=plan.shape, members=rnd.members, round=rnd.round)
        self.fields.pop("available", None)
        self.fields.pop("waiting_since", None)

    def waiting(self, available: int, now: float) -> None:
        """The job waits for capacity: ``available`` hosts now."""
        self.fields["available"] = available
        self.fields["waiting_since"] = now  # whoever holds the run next waits on from here

    @property
    def step(self) -> int | None:
        step = self.fields.get("step")
        return None if step is None else int(step)

    def follow(self, rank0: HostRecord | None, round_: int, now: float) -> None:
        """Rank 0's heartbeat as the leader read it: the step, loss and speed the status shows."""
        if rank0 is not None and rank0.round == round_ and rank0.step is not None:
            if rank0.step != self.last_step:
                self.last_step, self.last_step_change = rank0.step, now
            self.fields.update(step=rank0.step, loss=rank0.loss, tokens_per_s=rank0.tokens_per_s)
            self.fields["progressing"] = True
            if rank0.step_time:
                self.step_s = float(rank0.step_time)
        if rank0 is not None and rank0.committed is not None:
            self._committed(rank0.committed)

    def finished(self, rank0: HostRecord | None) -> None:
        """The members' last word: the final step and its commit (every member reached the last step and saved it)."""
        if rank0 is not None:
            if rank0.step is not None:
                self.fields.update(step=rank0.step, loss=rank0.loss)
            if rank0.committed is not None:
                self._committed(rank0.committed)
        # (a round that restored the last step trains no step to report)
        for key in ("step", "latest_committed"):
            self.fields[key] = max(int(self.fields.get(key) or 0), self.steps)

    def stopped_at(self, step: int | None) -> None:
        """The round stopped at ``step`` (a person's stop, as for a notice) and committed it; None: no step known."""
        if step is not None:
            self.fields["step"] = step
            self._committed(step)

    def _committed(self, step: int) -> None:
        self.fields["latest_committed"] = max(step, int(self.fields.get("latest_committed") or 0))

    def due(self, force: bool) -> bool:
        """Is a write due (``force``, STATUS_S since the last, sooner when the step moved)?  If so, it counts as made."""
        now = time.time()
        moved = self.fields.get("step") != self._written_step
        if not force and now - self._written_at < (self.cadence.status_s if moved else STATUS_S):
            return False
        self._written_at = now
        self._written_step = self.fields.get("step")
        return True

    def write(self, phase: Phase, rnd: Round | None, failures: int, alive: list[str], state: RunState | None) -> None:
        """Write ``status.json`` (the caller has fenced the write); ``state``, else the phase's."""
        state = state or run_state(phase, self.ending, bool(self.fields.get("progressing")), rnd)
        fields = {k: v for k, v in self.fields.items() if k != "progressing"}
        write_status(
            self.store,
            **{
                **fields,
                "state": state.value,
                "run_uri": self.run_uri,
                "job": self.job,
                "leader": self.leader,
                "steps_total": self.steps,
                "failures": failures,
                "hosts_alive": alive,
                "started_at": self.started_at,
                "phase": phase.value,
            },
        )
