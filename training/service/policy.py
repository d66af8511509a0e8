"""The scheduler's policy: how many hosts of a shared pool each run gets, by priority.

Pure functions over plain values; the scheduler applies what they decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from training.priorities import PRIORITIES, PriorityError, priority_value

__all__ = ["PRIORITIES", "Demand", "PriorityError", "allocate", "priority_value"]


@dataclass(frozen=True)
class Demand:
    """What one run asks of the pool: between ``min_hosts`` and ``max_hosts`` hosts, at a priority."""

    run: str
    priority: str
    min_hosts: int
    max_hosts: int
    submitted_at: float
    step: int = 1  # hosts come in whole slices of this many

    @property
    def rank(self) -> tuple[int, float]:
        """Sort key: higher priority first, then first come, first served."""
        return (-priority_value(self.priority), self.submitted_at)


def allocate(pool: int, demands: Sequence[Demand]) -> dict[str, int]:
    """Hosts per run: every run either gets at least its minimum or nothing (queued).

    Runs are admitted in priority order while their minimum fits in what is left;
    a run whose minimum does not fit is queued and lower ones may still fit
    (backfill). Hosts left over then grow the admitted runs toward their maximum,
    in the same order, a whole slice at a time.
    """
    order = sorted(demands, key=lambda d: d.rank)
    out = {d.run: 0 for d in demands}
    left = pool
    for d in order:
        if d.min_hosts <= left:
            out[d.run] = d.min_hosts
            left -= d.min_hosts
    for d in order:
        if out[d.run] == 0:
            continue
        room = min(d.max_hosts - out[d.run], left)
        grow = room - room % max(d.step, 1)
        out[d.run] += grow
        left -= grow
    return out
