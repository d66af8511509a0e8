"""The leader's view of its job's hosts: their records, which are alive, which were declared lost.

A host is alive while it beats within ``heartbeat_timeout_s`` and its agent's host-watch
connection has not ended; a new round counts only on hosts that beat now (within about three
heartbeats) and were not declared lost since their last beat.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from training.elastic.host.clocks import HostClocks
from training.elastic.host.hostwatch import HostWatch
from training.elastic.rendezvous import HostRecord, Rendezvous
from training.sections import ElasticSection

log = logging.getLogger("rtrain.leader")


@dataclass(frozen=True)
class Settle:
    """A failure's moment and each host's agent then (its start, its heartbeat number): a host that beats since is alive.

    A beat since means a later number of the same agent, or any beat of a new agent on that host
    (a pod made again, a restarted agent: its numbers start over).
    """

    at: float
    agents: dict[str, tuple[float, int]]


class HostView:
    """The job's host records as the leader last read them, and what it makes of them."""

    def __init__(self, elastic: ElasticSection, rdv: Rendezvous, job: str, me: str, watch: HostWatch) -> None:
        self.elastic = elastic  # its heartbeat_s and heartbeat_timeout_s
        self.rdv = rdv
        self.job = job
        self.me = me  # the leader's own host: alive, it is running this
        self.watch = watch  # a connection to each host's agent: its end says the agent is gone
        self.hosts: dict[str, HostRecord] = {}
        self.lost: dict[str, tuple[float, int]] = {}  # host -> (agent start, heartbeat seq) when declared lost
        self.clocks = HostClocks()  # each host's clock against this one, from its beats
        self.read_at = 0.0  # when the records were last read (a read that failed is tried again)
        # host -> (its agent's start, seq, local time the beat last changed)
        self._seen: dict[str, tuple[float, int, float]] = {}
        self._gone_seq: dict[tuple[str, float], int] = {}  # agent -> its heartbeat seq when first seen gone

    def read(self, now: float) -> None:
        """Read every host record of the job, and watch the agents not yet watched."""
        mono = time.monotonic()
        self.hosts = self.rdv.hosts(self.job)
        read_at = time.time()
        self.read_at = now
        for h, rec in self.hosts.items():
            seen = self._seen.get(h)
            if seen is None:
                # First sight: date its last beat by the writer's clock (the only time there is).
                self._seen[h] = (rec.started, rec.seq, mono - max(now - rec.time, 0.0))
            elif (rec.started, rec.seq) != seen[:2]:  # a new beat, or a new agent's (its numbers start over)
                self._seen[h] = (rec.started, rec.seq, mono)
                self.clocks.observe(h, rec.started, rec.time, read_at)  # a beat written since the last read
            if h != self.me and rec.state not in ("leaving", "gone"):
                self.watch.watch(h, rec.started, rec.watch)

    def known_gone(self, host: str) -> bool:
        """Its agent's host-watch connection ended: the process is gone, whatever its last beat says.

        Unless it beats twice more (a beat written just before it died may be read after): then the
        connection was cut on the way (a reset, a timeout), the agent lives, and it is dialled again.
        """
        rec = self.hosts.get(host)
        if rec is None or not self.watch.gone(host, rec.started):
            return False
        agent = (host, rec.started)
        seq = self._gone_seq.setdefault(agent, rec.seq)
        if rec.seq < seq + 2:
            return True
        log.warning("[%s] host %s beats again after its host-watch connection ended: dialled again", self.me, host)
        del self._gone_seq[agent]
        self.watch.forget(*agent)
        return False

    def age(self, host: str) -> float:
        """Seconds since the host's heartbeat last changed, by this process's clock."""
        if host == self.me:
            return 0.0
        seen = self._seen.get(host)
        return float("inf") if seen is None else time.monotonic() - seen[2]

    def alive(self) -> set[str]:
        """Hosts not yet lost: a heartbeat within ``heartbeat_timeout_s``."""
        return {
            h
            for h, r in self.hosts.items()
            if r.state not in ("leaving", "gone")
            and self.age(h) < self.elastic.heartbeat_timeout_s
            and not self.known_gone(h)
        }

    def fresh(self) -> set[str]:
        """Hosts a new round may count on: beating now (within ~3 heartbeats), and not declared lost.

        A host declared lost stays lost until it beats again (a later sequence number of the
        same agent, or a new agent on that host).
        """
        return {
            h
            for h, r in self.hosts.items()
            if r.state not in ("leaving", "gone")
            and self.age(h) < 3 * self.elastic.heartbeat_s
            and not self.known_gone(h)
            and not (h in self.lost and self.lost[h] >= (r.started, r.seq))
        }

    def declare_lost(self, hosts: list[str]) -> None:
        for h in hosts:
            rec = self.hosts.get(h)
            self.lost[h] = (rec.started, rec.seq) if rec is not None else (float("inf"), 0)

    def shown_life(self, host: str, since: Settle) -> bool:
        """A beat newer than the leader's view at the failure, and written after it (by the leader's clock): a
        beat the leader read late (written just before the host died) is no sign of life."""
        rec = self.hosts.get(host)
        if rec is None or rec.state in ("leaving", "gone"):
            return False
        started, seq = since.agents.get(host, (rec.started, -1))
        newer = rec.started != started or rec.seq > seq
        return newer and self.clocks.local_time(host, rec.started, rec.time) > since.at

    def settle(self, now: float, lapsed: list[str]) -> Settle:
        """The moment of a failure: a heartbeat that lapsed is no sign of life, whatever its sequence number
        (only a new agent on that host is)."""
        agents = {h: (r.started, 1 << 62 if h in lapsed else r.seq) for h, r in self.hosts.items()}
        return Settle(now, agents)

    def unsettled(self, members: list[str], since: Settle, settle_s: float) -> list[str]:
        """Members that have not shown life since the failure but may still (within ``settle_s``, agent not gone)."""
        return [
            h for h in members if not self.shown_life(h, since) and self.age(h) < settle_s and not self.known_gone(h)
        ]

    def lost_since(self, members: list[str], since: Settle | None) -> list[str]:
        """Members that showed no life since the failure."""
        return [h for h in members if since is not None and not self.shown_life(h, since)]
