"""Where the elastic agent learns how many hosts it may use right now.

The agent asks a ``CapacitySource`` before every (re)launch and while it waits
for capacity to return.  Locally the number of hosts of the simulated slice is
a small document in the run root that tests, chaos options and
``rtrain capacity RUN N`` change while the job runs; on GKE it is the number of
ready TPU hosts (see ``training.gke.cluster_state``).
"""

from __future__ import annotations

import json
from typing import Protocol, Required, TypedDict, cast

from training.storage import NotFound, Store


class CapacitySource(Protocol):
    def available(self) -> int:
        """Hosts (workers) that a launch could use now."""
        ...

    def set(self, workers: int, reason: str = "") -> None:
        """Change the capacity (local slice: simulate losing or regaining hosts)."""
        ...


class CapacityDoc(TypedDict, total=False):
    """``capacity.json``: the pool's hosts, why, whether a scheduler assigned the number, the hosts told to go."""

    workers: Required[int]
    reason: str
    assigned: bool
    leaving: list[str]


class LocalCapacity:
    """A number of simulated hosts, kept at ``<run>/capacity.json``."""

    KEY = "capacity.json"

    def __init__(self, store: Store, default: int) -> None:
        self.store = store
        self.default = default

    def _doc(self) -> CapacityDoc:
        try:
            return cast(CapacityDoc, dict(json.loads(self.store.get(self.KEY))))
        except NotFound:
            return CapacityDoc(workers=self.default)

    def available(self) -> int:
        return int(self._doc()["workers"])

    def assigned(self) -> bool:
        """Is the number a scheduler's assignment (shrink by notice; with none, the run is held, queued)?"""
        return bool(self._doc().get("assigned"))

    def leaving(self) -> list[str]:
        """Hosts that were told to go (a preemption notice) and may still be on their way out."""
        return list(self._doc().get("leaving") or [])

    def set(self, workers: int, reason: str = "") -> None:
        """The pool has ``workers`` hosts now (hosts that come back are new ones: nobody is leaving)."""
        if workers < 0:
            raise ValueError("capacity cannot be negative")
        self.store.put(self.KEY, json.dumps(CapacityDoc(workers=workers, reason=reason)).encode())

    def assign(self, workers: int, reason: str) -> None:
        """A scheduler gives the run ``workers`` hosts: hosts beyond it get a notice; none holds the run queued."""
        if workers < 0:
            raise ValueError("capacity cannot be negative")
        doc = CapacityDoc(workers=workers, reason=reason, assigned=True)  # hosts that come back are new ones
        self.store.put(self.KEY, json.dumps(doc).encode())

    def leave(self, host: str, reason: str = "") -> None:
        """``host`` leaves the pool (a preemption notice): one host fewer, and it is the one that goes.

        Under a scheduler's assignment the number stays (the notice carried it out).
        """
        doc = self._doc()
        if host in (doc.get("leaving") or []):
            return
        leaving = sorted({*(doc.get("leaving") or []), host})
        workers = int(doc["workers"]) if doc.get("assigned") else max(int(doc["workers"]) - 1, 0)
        new: CapacityDoc = {**doc, "workers": workers, "reason": reason or doc.get("reason", ""), "leaving": leaving}
        self.store.put(self.KEY, json.dumps(new).encode())
