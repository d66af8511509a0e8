"""The rendezvous on the run root: how the host agents of a job find each other.

Three kinds of objects under ``<run>/rendezvous/``, with no rename, no append and no server of our
own, so a local path and gs:// behave the same:

* ``hosts/<host>.json``: each agent's heartbeat (job, slice, address, a sequence number, its
  worker's round, step and loss, the pids of its agent, worker and standby), replaced whole every
  ``heartbeat_s`` by that agent alone.  Older than ``heartbeat_timeout_s``: the host is lost; a
  sequence number that moved on since a failure was seen: alive after it.
* ``rounds/<round>.json``: write-once, by the leader: the members in rank order, world size, mesh,
  coordinator, resume step, faults still to fire; or ``stop`` with the job's final state.  Of a race
  for one round number ``create`` has one winner, and the lease generation it was written under
  fences out a leader that lost its lease.
* ``reports/<round>/<host>.json``: write-once, by each member's agent: how its worker ended
  (finished, rescale, guard, corrupt, notice, failed) and why.

Round numbers count through the run: a new job's first round follows the last job's newest
(``rounds-before``, written when the launcher clears the rendezvous for it).
"""

from __future__ import annotations

import errno
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, TypedDict

from training.elastic.wire import CorruptReport, GuardReport, NoticeReport
from training.layout import RDV_HOSTS, RDV_REPORTS, RDV_RESERVE, RDV_ROUNDS, RDV_ROUNDS_BEFORE, RENDEZVOUS
from training.records import JSONObject
from training.storage import AlreadyExists, NotFound, Store

PARALLEL_READS = 10  # host records read at once by a scan of many (a storage client keeps 10 connections)


class Outcome(StrEnum):
    """How a host's worker ended a round (its agent's report)."""

    FINISHED = "finished"  # reached the last step and saved it
    RESCALE = "rescale"  # stopped at a checkpoint because the leader asked (the group grows)
    GUARD = "guard"  # the in-training guard saw a non-finite or spiking loss
    CORRUPT = "corrupt"  # the checkpoint to restore failed its integrity check
    NOTICE = "notice"  # a preemption notice: the group stopped at a step boundary and committed that step
    FAILED = "failed"  # died or failed (a crash, a collective error when a peer vanished)


@dataclass
class HostRecord:
    """One agent's heartbeat."""

    host: str
    job: str
    slice: int
    index: int  # the host's index inside its slice
    seq: int
    time: float
    pid: int
    node: str  # the machine (pod) it runs on
    coordinator: str  # host:port its worker would serve jax.distributed on, as rank 0
    state: str = "idle"  # idle | training | leaving
    round: int = -1  # the round of its current (or last) worker
    rank: int = -1
    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    step_time: float | None = None
    committed: int | None = None  # the newest step its worker committed (rank 0)
    leader: bool = False
    started: float = 0.0  # when the agent started
    local: list[list[int]] = field(default_factory=list)  # [step, round] of the local copies it holds
    watch: str = ""  # host:port of its host-watch listener (the leader holds a connection to it)
    worker_pid: int | None = None  # its worker's process (the round's), while one runs; on ``node``
    standby_pid: int | None = None  # its standby worker's process, while one warms up or waits
    # A report of its worker's end that could not be written as a file (a full disk): the heartbeat,
    # rewritten in place, carries it to the leader instead.
    unreported: JSONObject | None = None

    @classmethod
    def from_json(cls, data: JSONObject) -> HostRecord:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


class RecoveryRecord(TypedDict, total=False):
    """What a round recovers from, as its leader wrote it into the round (empty: nothing): the cause, its kind
    (failure | guard | notice), when it struck and was detected, the steps it lost, the step resumed, the step time."""

    cause: str
    kind: str
    fault_at: float | None
    detected_at: float
    steps_lost: int
    resume_step: int | None
    step_s: float


@dataclass(frozen=True)
class ResumeFrom:
    """Where a round's workers resume: first the local copies ``local`` (steps every member holds, newest first),
    else the run's checkpoints as ``checkpoint`` says (``latest``, a step, ``none``)."""

    checkpoint: str = "latest"
    local: tuple[int, ...] = ()

    def text(self) -> str:
        """As the run's events say it: ``local:22,20``, else ``latest`` (or the step, or ``none``)."""
        return "local:" + ",".join(map(str, self.local)) if self.local else self.checkpoint

    @classmethod
    def read(cls, value: object) -> ResumeFrom:
        """From a round's JSON: the record, or the text a leader of an earlier version wrote (``local:22,20``)."""
        if isinstance(value, dict):
            return cls(str(value.get("checkpoint") or "latest"), tuple(int(s) for s in value.get("local") or ()))
        text = str(value or "latest")
        if text.startswith("local:"):
            return cls("latest", tuple(int(s) for s in text.removeprefix("local:").split(",") if s.strip().isdigit()))
        return cls(text)


@dataclass
class Round:
    """The leader's plan for one round (or, with ``action='stop'``, the job's end)."""

    round: int
    job: str
    gen: int  # the lease generation of the leader that wrote it
    leader: str
    action: str = "train"  # train | stop
    members: list[str] = field(default_factory=list)
    mesh: dict[str, int] = field(default_factory=dict)
    coordinator: str = ""
    resume: ResumeFrom = field(default_factory=ResumeFrom)
    faults: list[str] = field(default_factory=list)
    reason: str = ""
    failures: int = 0
    guards: int = 0
    final: str = ""  # stop: finished | failed
    time: float = 0.0
    # Local copies saved in rounds before this one are of another lineage (a guard rollback came since).
    local_floor: int = 0
    # When the round follows a failure or a notice: what was lost (steps, when), for the `recovered` event.
    recovery: RecoveryRecord = field(default_factory=lambda: RecoveryRecord())

    @property
    def workers(self) -> int:
        return len(self.members)

    def rank(self, host: str) -> int:
        return self.members.index(host) if host in self.members else -1

    @classmethod
    def from_json(cls, data: JSONObject) -> Round:
        known = {f for f in cls.__dataclass_fields__}
        fields = {k: v for k, v in data.items() if k in known}
        return cls(**fields | {"resume": ResumeFrom.read(data.get("resume"))})


@dataclass
class Report:
    """How one host's worker ended a round."""

    round: int
    host: str
    rank: int
    outcome: str
    returncode: int | None = None
    reason: str = ""
    error: str = ""  # the worker's own last error line
    log: str = ""  # where its log is
    step: int | None = None
    guard: GuardReport | None = None
    corrupt: CorruptReport | None = None
    fault_at: float | None = None
    notice: NoticeReport | None = None  # NOTICE: the stop's step, and whether this host was the one told
    peer_lost: int | None = None  # FAILED as a bystander: the rank of the process that went first
    time: float = 0.0

    @classmethod
    def from_json(cls, data: JSONObject) -> Report:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def _dump(obj: Any) -> bytes:
    return json.dumps(asdict(obj), sort_keys=True, default=str).encode()


class Rendezvous:
    """Reads and writes the rendezvous objects of one run."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # -- heartbeats ----------------------------------------------------------------------

    def beat(self, rec: HostRecord) -> None:
        self.store.put(f"{RDV_HOSTS}{rec.host}.json", _dump(rec))

    def hosts(self, job: str | None = None) -> dict[str, HostRecord]:
        """Every host's record (of ``job``), read 10 at a time: a large job's scan is a few round trips."""
        keys = [k for k in self.store.list(RDV_HOSTS) if k.endswith(".json")]
        if len(keys) > PARALLEL_READS:
            with ThreadPoolExecutor(PARALLEL_READS, thread_name_prefix="rdv-read") as pool:
                recs = list(pool.map(self._host, keys))
        else:
            recs = [self._host(k) for k in keys]
        return {r.host: r for r in recs if r is not None and (job is None or r.job == job)}

    def _host(self, key: str) -> HostRecord | None:
        try:
            return HostRecord.from_json(json.loads(self.store.get(key)))
        except (NotFound, ValueError, TypeError):
            return None

    # -- rounds --------------------------------------------------------------------------

    def round_numbers(self) -> list[int]:
        nums = []
        for key in self.store.list(RDV_ROUNDS):
            name = key[len(RDV_ROUNDS) :]
            if name.endswith(".json") and name[:-5].isdigit():
                nums.append(int(name[:-5]))
        return sorted(nums)

    def round(self, number: int) -> Round | None:
        try:
            return Round.from_json(json.loads(self.store.get(f"{RDV_ROUNDS}{number:08d}.json")))
        except NotFound:
            return None

    def rounds_after(self, number: int) -> list[Round]:
        """The rounds numbered after ``number``, read by name: a look while none is new is one read.

        Round numbers have no gaps (each is the one after its leader's last, or the next free
        one), so the first number not found ends the look.
        """
        out = []
        n = number + 1
        while (r := self.round(n)) is not None:
            out.append(r)
            n += 1
        return out

    def rounds_listed_after(self, number: int) -> list[Round]:
        """The rounds numbered after ``number``, listed (a reader so far behind that older ones are gone)."""
        return [r for n in self.round_numbers() if n > number and (r := self.round(n)) is not None]

    def rounds_before(self) -> int:
        """The newest round number of the run's earlier jobs (0 for the first job): this job's count on from it."""
        try:
            return int(self.store.get(RDV_ROUNDS_BEFORE))
        except (NotFound, ValueError):
            return 0

    def next_round_number(self) -> int:
        """The number a job's first round takes: after every round of this job and of the jobs before it."""
        return max([self.rounds_before(), *self.round_numbers()]) + 1

    def newest_round(self, job: str | None = None) -> Round | None:
        for n in reversed(self.round_numbers()):
            r = self.round(n)
            if r is not None and (job is None or r.job == job):
                return r
        return None

    def open_round(self, rnd: Round) -> Round:
        """Write round ``rnd.round`` (or the next free number: a stale job's round may hold it)."""
        while True:
            rnd.time = time.time()
            try:
                self.store.create(f"{RDV_ROUNDS}{rnd.round:08d}.json", _dump(rnd))
                return rnd
            except AlreadyExists:
                other = self.round(rnd.round)
                if other is not None and other.job == rnd.job:
                    raise  # another leader of this job wrote it: we are not the leader any more
                rnd.round += 1

    # -- reports -------------------------------------------------------------------------

    def report(self, rep: Report) -> None:
        rep.time = rep.time or time.time()
        key = f"{RDV_REPORTS}{rep.round:08d}/{rep.host}.json"
        try:
            self.store.create(key, _dump(rep))
        except AlreadyExists:
            pass  # reported already (an agent restarted mid-round)
        except OSError as e:
            if e.errno != errno.ENOSPC or not self.free_reserve():
                raise
            self.store.create(key, _dump(rep))  # the leader must hear how the round ended

    def free_reserve(self) -> bool:
        """A full disk: give back the space the launcher held for the job's last words (once)."""
        if not self.store.exists(RDV_RESERVE):
            return False
        self.store.delete(RDV_RESERVE)
        return True

    def reports(self, number: int) -> dict[str, Report]:
        out = {}
        prefix = f"{RDV_REPORTS}{number:08d}/"
        for key in self.store.list(prefix):
            if not key.endswith(".json"):
                continue
            try:
                rep = Report.from_json(json.loads(self.store.get(key)))
            except (NotFound, ValueError, TypeError):
                continue
            out[rep.host] = rep
        return out

    # -- housekeeping --------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every host, round and report (a new job starts, under the run lock); keep the newest round's
        number, so the new job's rounds (its launches) count on through the run instead of starting at 1 again."""
        last = self.next_round_number() - 1
        self.store.delete(RENDEZVOUS.rstrip("/"))
        if last:
            self.store.put(RDV_ROUNDS_BEFORE, str(last).encode())

    def forget_rounds_before(self, number: int) -> None:
        """Drop rounds and reports older than ``number`` (the events keep the history)."""
        for n in self.round_numbers():
            if n < number:
                self.store.delete(f"{RDV_ROUNDS}{n:08d}.json")
                self.store.delete(f"{RDV_REPORTS}{n:08d}")
