"""The service's records on the storage root: submissions, the scheduler's placements, the pool.

Everything lives under ``<root>/_service/`` (no run name starts with ``_``):

* ``queue/<run>.json``: a submission, written by ``submit``, ``priority`` and
  ``cancel`` (the people's side; the scheduler only reads it);
* ``placed/<run>.json``: the scheduler's side: the job it launched, the hosts it
  assigned, how the run ended; written only by the scheduler under its lease;
* ``pool.json``: how many hosts the pool has;
* ``lock/``: the scheduler's lease (one scheduler acts at a time).

Two writers never share a document, so no write is lost between them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields

from training.records import JSONObject
from training.service.policy import Demand, priority_value
from training.storage import AlreadyExists, NotFound, Store, join, open_store

SERVICE = "_service"
QUEUE = "queue/"
PLACED = "placed/"
POOL = "pool.json"


class QueueError(ValueError):
    """A request the queue refuses (unknown run, a run that already ended, a minimum that never fits)."""


@dataclass
class Submission:
    """A run submitted to the service: its config and its priority."""

    run_name: str
    run_uri: str
    priority: str
    min_hosts: int
    max_hosts: int
    hosts_per_slice: int
    steps: int
    config: str  # the run's resolved config (JSON)
    submitted_at: float
    cancelled: str = ""  # the reason, once cancelled
    priority_changed_at: float | None = None

    def demand(self) -> Demand:
        return Demand(
            run=self.run_name,
            priority=self.priority,
            min_hosts=self.min_hosts,
            max_hosts=self.max_hosts,
            submitted_at=self.submitted_at,
            step=self.hosts_per_slice,
        )


@dataclass
class Placement:
    """What the scheduler did with a run: launched it as ``job``, gave it ``hosts``, saw it end."""

    run_name: str
    job: str = ""
    hosts: int = 0
    ended: str = ""  # finished | failed | stopped (cancelled once its job ran) | cancelled (before it ran), once over
    reason: str = ""
    history: list[list[float]] = field(default_factory=list)  # [time, hosts] at each change
    launches: int = 0
    controller_pid: int = 0  # the local slice of the job (its launcher), on the scheduler's machine


def _known(cls: type, doc: JSONObject) -> JSONObject:
    """The fields of ``doc`` that ``cls`` has (a record written by a newer version may carry more)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in doc.items() if k in names}


class Queue:
    """The service's documents on one storage root."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.store: Store = open_store(join(root, SERVICE))

    @property
    def uri(self) -> str:
        return self.store.uri

    # --- the pool -----------------------------------------------------------------------------

    def pool(self) -> int | None:
        try:
            return int(json.loads(self.store.get(POOL))["hosts"])
        except NotFound:
            return None

    def pool_or_create(self, hosts: int) -> int:
        """The pool's size, made ``hosts`` if it has none (write-once: of two first writers, one size holds)."""
        if hosts < 1:
            raise QueueError(f"a pool needs at least one host (asked for {hosts})")
        try:
            self.store.create(POOL, json.dumps({"hosts": hosts, "time": time.time()}).encode())
        except AlreadyExists:
            pass
        return int(self.pool() or hosts)

    def set_pool(self, hosts: int) -> None:
        if hosts < 1:
            raise QueueError(f"a pool needs at least one host (asked for {hosts})")
        self.store.put(POOL, json.dumps({"hosts": hosts, "time": time.time()}).encode())

    # --- submissions --------------------------------------------------------------------------

    def submissions(self) -> list[Submission]:
        out = []
        for key in self.store.list(QUEUE):
            if key.endswith(".json"):
                try:
                    out.append(Submission(**_known(Submission, json.loads(self.store.get(key)))))
                except (NotFound, ValueError, TypeError):
                    continue  # removed meanwhile, or half-written on a disk that filled: skipped this tick
        return sorted(out, key=lambda s: s.submitted_at)

    def submission(self, run_name: str) -> Submission:
        try:
            return Submission(**_known(Submission, json.loads(self.store.get(f"{QUEUE}{run_name}.json"))))
        except NotFound:
            raise QueueError(f"no run {run_name!r} was submitted to {self.uri}") from None

    def put_submission(self, sub: Submission) -> None:
        priority_value(sub.priority)
        self.store.put(f"{QUEUE}{sub.run_name}.json", json.dumps(asdict(sub), indent=1).encode())

    # --- placements ---------------------------------------------------------------------------

    def placement(self, run_name: str) -> Placement:
        try:
            return Placement(**_known(Placement, json.loads(self.store.get(f"{PLACED}{run_name}.json"))))
        except NotFound:
            return Placement(run_name=run_name)

    def put_placement(self, p: Placement) -> None:
        self.store.put(f"{PLACED}{p.run_name}.json", json.dumps(asdict(p), indent=1).encode())
