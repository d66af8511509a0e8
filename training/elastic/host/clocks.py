"""The hosts' clocks as the leader sees them: each agent's skew, estimated from its heartbeats.

A heartbeat carries the time its agent wrote it, by that host's clock.  The
leader compares those times with its own (was this beat written after the
failure?), so a host whose clock runs behind would look silent, and one that
runs ahead would look alive after it died.  Each beat the leader reads for the
first time was written before it was read: ``read_at - written_at`` is the
delay plus the skew, and its least value over many beats is the skew plus the
shortest delay (small next to a heartbeat).  That estimate corrects the host's
times once :data:`MIN_BEATS` beats were read and it is clearly more than
:data:`CLEAR_SKEW_S`; until then, or within it, clocks count as agreeing and
times are taken as written.
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)

CLEAR_SKEW_S = 0.5  # an estimated skew within this is no skew (the estimate holds a read's delay too)
# Beats read before a skew is trusted: a leader that just took over on a loaded machine reads its first few
# beats late, and would take that delay for a skew.
MIN_BEATS = 8
SAY_SKEW_S = 1.0  # a skew beyond this is logged, once per agent


class HostClocks:
    """Each host agent's clock, against this process's, from the beats it has read."""

    def __init__(self) -> None:
        self._least: dict[str, tuple[float, float]] = {}  # host -> (its agent's start, least read_at - written_at)
        self._beats: dict[str, int] = {}  # host -> beats of its agent read so far
        self._said: set[tuple[str, float]] = set()

    def observe(self, host: str, started: float, written_at: float, read_at: float) -> None:
        """A beat of ``host``'s agent (started at ``started``) written at ``written_at``, first read at ``read_at``.

        ``read_at`` is this process's time after the read: the beat was written before it.
        """
        lag = read_at - written_at
        agent, least = self._least.get(host, (started, math.inf))
        if agent != started:  # a new agent: maybe a new machine, with a clock of its own
            least, self._beats[host] = math.inf, 0
        self._least[host] = (started, min(least, lag))
        self._beats[host] = self._beats.get(host, 0) + 1
        skew = self.skew(host, started)
        if abs(skew) > SAY_SKEW_S and (host, started) not in self._said:
            self._said.add((host, started))
            way = "behind" if skew > 0 else "ahead of"
            log.warning(
                "the clock of host %s runs about %.1fs %s this host's: its times are corrected", host, abs(skew), way
            )

    def skew(self, host: str, started: float) -> float:
        """Seconds to add to the host's times to read them on this clock (0 when clearly none, or not known yet)."""
        agent, least = self._least.get(host, (None, math.inf))
        if agent != started or self._beats.get(host, 0) < MIN_BEATS or abs(least) <= CLEAR_SKEW_S:
            return 0.0
        return least

    def local_time(self, host: str, started: float, written_at: float) -> float:
        """``written_at``, a time of ``host``'s agent, on this process's clock."""
        return written_at + self.skew(host, started)
