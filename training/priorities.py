"""The named priority levels of runs that share capacity (the scheduler's, and Kueue's on GKE)."""

from __future__ import annotations

# Higher takes hosts first.  On GKE each level is a Kueue WorkloadPriorityClass of this value.
PRIORITIES: dict[str, int] = {"low": 100, "normal": 200, "high": 300, "urgent": 400}


class PriorityError(ValueError):
    """A priority that is not one of the named levels."""


def priority_value(name: str) -> int:
    """The rank of a named priority level; a one-line error for any other name."""
    try:
        return PRIORITIES[name]
    except KeyError:
        raise PriorityError(f"unknown priority {name!r}: one of {', '.join(PRIORITIES)}") from None
