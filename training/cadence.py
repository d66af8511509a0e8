"""The control plane's cadence: how often a job's agents look at and write its run root, and the cost.

On ``gs://`` every look is a billed request (writes and listings are class A,
reads class B, deletes free) and one object takes about one write a second.
The intervals here keep each object under that limit, keep what every host
does to reads of named objects, and stretch the heartbeat as a job grows, so
the whole job's heartbeats stay within ``HEARTBEAT_WRITES_PER_S``.
:func:`steady_ops` is the model of a training job's rate that ``rtrain bench``
checks against the agents' own counted requests.
"""

from __future__ import annotations

from dataclasses import dataclass

POLL_S = 0.05  # an agent's loop on a local root (a round starts, a worker ends: seen this fast)
POLL_S_GCS = 0.2  # on gs://, where every look is an HTTP request
BUSY_POLL_S_GCS = 0.5  # on gs://, how often an agent whose worker trains looks for a new round
# Rank 0's step reaches its heartbeat within this (batched over the steps between): status keeps up.
STEP_BEAT_S = 0.25
STEP_BEAT_S_GCS = 1.0  # one object takes about one write a second
STATUS_S = 1.0  # status.json is rewritten this often when nothing moves
STATUS_STEP_S = 0.5  # ... and this soon when the step moved (gs://: STATUS_S, the per-object limit)
CONTROL_S = 0.5  # the leader reads the run's control object (a stop request) this often
LIST_ROUNDS_S = 30.0  # an agent lists the rounds (rather than look for the next by name) this often

GCS_HEARTBEAT_S = 1.0  # a small gs:// job's heartbeat
GCS_TIMEOUT_BEATS = 10  # a host is lost after this many missed gs:// heartbeats
GCS_LEASE_S = 8.0
HEARTBEAT_WRITES_PER_S = 64  # a gs:// job's heartbeats, all hosts together, at most this many a second
HOST_READS_PER_S = 64  # while a job trains, its leader reads host records at most this many a second


@dataclass(frozen=True)
class GCSTiming:
    """The default heartbeat, loss timeout and lease of a job on ``gs://`` of ``hosts`` hosts."""

    heartbeat_s: float
    heartbeat_timeout_s: float
    lease_s: float


def gcs_timing(hosts: int) -> GCSTiming:
    """One heartbeat a second up to ``HEARTBEAT_WRITES_PER_S`` hosts, slower beyond (loss timeout in step)."""
    beat = max(GCS_HEARTBEAT_S, hosts / HEARTBEAT_WRITES_PER_S)
    return GCSTiming(heartbeat_s=beat, heartbeat_timeout_s=GCS_TIMEOUT_BEATS * beat, lease_s=GCS_LEASE_S)


@dataclass(frozen=True)
class Cadence:
    """How often each part of a job's control plane looks at or writes the run root (seconds)."""

    hosts: int
    gcs: bool
    heartbeat_s: float  # each agent writes its host record
    lease_s: float  # the leader's lease; refreshed every quarter of it
    poll_s: float  # an agent's loop: a waiting agent looks for a new round this often, the leader ticks
    busy_poll_s: float  # an agent whose worker trains looks for a new round this often
    step_beat_s: float  # rank 0's host record, while its step moves
    hosts_read_s: float  # the leader reads every host record
    status_s: float  # the leader rewrites status.json while the step moves
    control_s: float  # the leader reads the control object
    list_rounds_s: float  # an agent lists the rounds (in case it fell behind the ones kept)

    @property
    def lock_look_s(self) -> float:
        """A follower looks at the lease (to lead when it lapses) once a heartbeat."""
        return self.heartbeat_s


def cadence(hosts: int, gcs: bool, heartbeat_s: float, lease_s: float) -> Cadence:
    """The cadence of a job of ``hosts`` hosts whose agents beat every ``heartbeat_s``."""
    poll = POLL_S_GCS if gcs else POLL_S
    return Cadence(
        hosts=hosts,
        gcs=gcs,
        heartbeat_s=heartbeat_s,
        lease_s=lease_s,
        poll_s=poll,
        busy_poll_s=BUSY_POLL_S_GCS if gcs else poll,
        step_beat_s=min(STEP_BEAT_S_GCS if gcs else STEP_BEAT_S, heartbeat_s),
        hosts_read_s=max(min(0.25, heartbeat_s / 2), hosts / HOST_READS_PER_S),
        status_s=STATUS_S if gcs else STATUS_STEP_S,
        control_s=CONTROL_S,
        list_rounds_s=LIST_ROUNDS_S,
    )


# What each store call costs in requests by class (class A, class B): a write-once object is first
# checked for (some emulators ignore the precondition); deletes are free (on gs:// a delete lists what
# is under its key first, and that listing is counted as its own call).
BILLING: dict[str, tuple[int, int]] = {
    "put": (1, 0),
    "create": (1, 1),
    "create_in": (1, 1),
    "get": (0, 1),
    "exists": (0, 1),
    "list": (1, 0),
    "checksums": (1, 0),
    "delete": (0, 0),
    "move": (1, 0),
}


@dataclass(frozen=True)
class OpsRate:
    """Storage requests per host per minute, by billing class (deletes are free and not counted)."""

    class_a: float  # writes and listings
    class_b: float  # reads (an object's bytes, or whether it exists)

    @property
    def total(self) -> float:
        return self.class_a + self.class_b


def steady_ops(c: Cadence) -> OpsRate:
    """A training job's control-plane requests per host per minute, averaged over its hosts.

    Steady training: every host beats (rank 0 as its step moves), looks for a
    new round by name and, but for the leader, at the lease by name (the
    generation it saw, those written since, and the next); the leader lists and reads every host
    record, lists the round's reports once a tick, reads the control object,
    rewrites status.json and renews its lease (a write-once object, a listing
    and a read to confirm it, the old generation deleted).
    """
    n = c.hosts
    per_min = 60.0
    beats = (n - 1) * per_min / c.heartbeat_s + per_min / c.step_beat_s
    round_looks = n * per_min / c.busy_poll_s
    round_lists = n * per_min / c.list_rounds_s
    lock_looks = (n - 1) * per_min / c.lock_look_s
    scans = per_min / c.hosts_read_s
    ticks = per_min / c.poll_s
    renewals = per_min / (c.lease_s / 4)
    a = beats + scans + ticks + round_lists + per_min / c.status_s
    # A look at the lease reads the generation seen, each one written since, and the next (not found).
    b = round_looks + lock_looks * (2 + c.lock_look_s / (c.lease_s / 4)) + scans * n + per_min / c.control_s
    renew_a, renew_b = (
        sum(x) for x in zip(BILLING["create"], BILLING["list"], BILLING["get"], BILLING["delete"], strict=True)
    )
    if c.gcs:
        renew_a += BILLING["list"][0]  # the old generation's delete lists under its key first
    a += renewals * renew_a
    b += renewals * renew_b
    return OpsRate(class_a=a / n, class_b=b / n)


def billed(ops: dict[str, float]) -> OpsRate:
    """Requests by class from store calls by operation (``{"get": 12, ...}``), as they are."""
    a = sum(BILLING.get(op, (1, 0))[0] * k for op, k in ops.items())
    b = sum(BILLING.get(op, (1, 0))[1] * k for op, k in ops.items())
    return OpsRate(class_a=a, class_b=b)
