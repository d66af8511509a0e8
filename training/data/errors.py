"""The error every dataset module raises."""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset that cannot be prepared or read, with a message that says why."""
