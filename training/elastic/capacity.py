"""Where the elastic agent learns how many hosts it may use right now.

The agent asks a ``CapacitySource`` before every (re)launch and while it waits
for capacity to return.  Locally the number of hosts of the simulated slice is
a small document in the run root that tests, chaos options and
``rtrain capacity RUN N`` change while the job runs; on GKE it is the number of
ready TPU hosts (see ``training.backends.gke``).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from training.storage import NotFound, Store


class CapacitySource(Protocol):
    def available(self) -> int:
        """Hosts (workers) that a launch could use now."""
        ...

    def set(self, workers: int, reason: str = "") -> None:
        """Change the capacity (local slice: simulate losing or regaining hosts)."""
        ...


class LocalCapacity:
    """A number of simulated hosts, kept at ``<run>/capacity.json``."""

    KEY = "capacity.json"

    def __init__(self, store: Store, default: int) -> None:
        self.store = store
        self.default = default

    def _doc(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.store.get(self.KEY)))
        except NotFound:
            return {"workers": self.default}

    def available(self) -> int:
        return int(self._doc()["workers"])

    def leaving(self) -> list[str]:
        """Hosts that were told to go (a preemption notice) and may still be on their way out."""
        return list(self._doc().get("leaving") or [])

    def set(self, workers: int, reason: str = "") -> None:
        """The pool has ``workers`` hosts now (hosts that come back are new ones: nobody is leaving)."""
        if workers < 0:
            raise ValueError("capacity cannot be negative")
        self.store.put(self.KEY, json.dumps({"workers": workers, "reason": reason}).encode())

    def leave(self, host: str, reason: str = "") -> None:
        """``host`` leaves the pool (a preemption notice): one host fewer, and it is the one that goes."""
        doc = self._doc()
        leaving = sorted({*(doc.get("leaving") or []), host})
        workers = max(int(doc["workers"]) - 1, 0)
        self.store.put(self.KEY, json.dumps({"workers": workers, "reason": reason, "leaving": leaving}).encode())
