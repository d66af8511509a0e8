"""Which rounds a host agent has followed, and when it looks for new ones."""

from __future__ import annotations

import time
from collections.abc import Iterator

from training.cadence import Cadence
from training.elastic.rendezvous import Rendezvous, Round


class RoundFollower:
    """The rounds of this agent's job written since its last look, by a leader that still held the lease."""

    def __init__(self, rdv: Rendezvous, job: str, cadence: Cadence) -> None:
        self.rdv = rdv
        self.job = job
        self.cadence = cadence
        self.seen_round = rdv.rounds_before()  # the earlier jobs' rounds: this job's come after them
        self.max_gen = 0
        self._look_at = 0.0
        self._list_at = time.monotonic()

    def look_now(self) -> None:
        """Look at the next turn of the loop (what matters now is the next round)."""
        self._look_at = 0.0

    def new_rounds(self, busy: bool) -> Iterator[Round]:
        """The rounds to apply, in order (none until it is time to look: less often while the worker trains)."""
        now = time.monotonic()
        if now < self._look_at:
            return
        self._look_at = now + (self.cadence.busy_poll_s if busy else self.cadence.poll_s)
        listing = now >= self._list_at  # now and then, in case this host fell behind the rounds still kept
        if listing:
            self._list_at = now + self.cadence.list_rounds_s
        rounds = self.rdv.rounds_listed_after if listing else self.rdv.rounds_after
        for rnd in rounds(self.seen_round):
            self.seen_round = max(self.seen_round, rnd.round)
            if rnd.job != self.job or rnd.gen < self.max_gen:
                continue  # another job's round, or one written by a leader that has lost its lease
            self.max_gen = rnd.gen
            yield rnd
