"""Where the elastic agent learns how many hosts it may use right now.

The agent asks a ``CapacitySource`` before every (re)launch and while it waits
for capacity to return.  Locally the number of hosts of the simulated slice is
a small document in the run root that tests, chaos options and
``rtrain capacity RUN N`` change while the job runs; on GKE it is the number of
ready TPU hosts (see ``training.backends.gke``).
"""

from __future__ import annotations

import json
from typing import Protocol

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

    def available(self) -> int:
        try:
            return int(json.loads(self.store.get(self.KEY))["workers"])
        except NotFound:
            return self.default

    def set(self, workers: int, reason: str = "") -> None:
        if workers < 0:
            raise ValueError("capacity cannot be negative")
        self.store.put(self.KEY, json.dumps({"workers": workers, "reason": reason}).encode())
