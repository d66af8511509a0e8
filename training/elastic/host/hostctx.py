"""What one host's agent shares with the parts it runs (its leadership and its report handler): one small context."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from training.checkpoint.ledger import Ledger
from training.config import Config
from training.elastic.capacity import LocalCapacity
from training.elastic.host.heartbeat import Heartbeat
from training.elastic.rendezvous import Rendezvous
from training.events import EventLog
from training.storage import Store


@dataclass(frozen=True)
class HostContext:
    """One host's agent of one job: the run's config and stores, who it is, and how it records what happens."""

    cfg: Config
    run_uri: str
    job: str
    host: str
    store: Store  # the run root
    rdv: Rendezvous  # the hosts' heartbeats and the leader's rounds
    ledger: Ledger  # each checkpoint's state
    events: EventLog
    heart: Heartbeat  # this host's heartbeat record
    emit: Callable[..., None]  # write an event now
    capacity: LocalCapacity | None  # the local slice's pool (a preempted host leaves it); None on GKE
