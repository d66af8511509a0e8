"""A worker's TPU environment on GKE: the pod's, less what belongs to a round; and each round's own (pure)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from training.gke.names import DEFAULT_MEGASCALE_PORT, pod_hostname

# --- a round's worker environment ---------------------------------------------------------

# What libtpu reads of a worker's place in the job.  GKE's TPU webhook puts these into every pod of the
# JobSet for the JobSet as created (TPU_WORKER_* for the pod's slice, MEGASCALE_* for all its replicas),
# so they are wrong as soon as a round has fewer slices: the agent starts each worker without them
# (worker_base_env) and gives it the values of its round (round_env).
ROUND_ENV_KEYS = frozenset({"TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES"})
ROUND_ENV_PREFIXES = ("MEGASCALE_",)
_HOST_ID_RE = re.compile(r"^s(?P<slice>\d+)-h(?P<index>\d+)$")


def is_round_env(key: str) -> bool:
    """Whether ``key`` is a variable whose value belongs to a round, not to the pod."""
    return key in ROUND_ENV_KEYS or key.startswith(ROUND_ENV_PREFIXES)


def worker_base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The pod's environment for a worker process, without the variables of a round (:func:`is_round_env`)."""
    return {k: v for k, v in environ.items() if not is_round_env(k)}


def member_dns_name(host: str, subdomain: str) -> str:
    """The DNS name of the pod of host id ``s<slice>-h<index>``: ``<jobset>-slice-<slice>-<index>.<subdomain>``."""
    m = _HOST_ID_RE.match(host)
    if not m:
        raise ValueError(f"host id {host!r} is not s<slice>-h<index> (a GKE pod's host id)")
    return f"{pod_hostname(subdomain, int(m['slice']), int(m['index']))}.{subdomain}"


def round_env(
    members: list[str], rank: int, hosts_per_slice: int, coordinator: str, megascale_port: str | int | None = None
) -> dict[str, str]:
    """The TPU environment of the worker of rank ``rank`` in a round of ``members`` (slice-major, whole slices).

    Every round of multi-host slices: ``TPU_WORKER_ID`` (the worker's rank in its slice) and
    ``TPU_WORKER_HOSTNAMES`` (its slice's members in rank order); a single-host slice runs without them,
    as GKE starts it (its webhook sets them only for multi-host Jobs).  A round on 2 or more slices adds libtpu's Multislice variables:
    ``MEGASCALE_COORDINATOR_ADDRESS`` (rank 0's host), ``MEGASCALE_NUM_SLICES``, ``MEGASCALE_SLICE_ID``
    and ``MEGASCALE_PORT``.  A round on one slice has none: a single slice needs no Multislice runtime,
    and one told of other slices waits for them.  ``coordinator`` is the round's ``<rank 0's DNS name>:port``,
    whose domain is the JobSet's subdomain.
    """
    if not 0 <= rank < len(members) or len(members) % hosts_per_slice:
        raise ValueError(f"rank {rank} of {len(members)} members in slices of {hosts_per_slice}")
    host = coordinator.rsplit(":", 1)[0]
    if "." not in host:
        raise ValueError(f"coordinator {coordinator!r} is not <pod hostname>.<subdomain>:port")
    subdomain = host.split(".", 1)[1]
    env: dict[str, str] = {}
    if hosts_per_slice > 1:
        first = rank - rank % hosts_per_slice
        env["TPU_WORKER_ID"] = str(rank % hosts_per_slice)
        env["TPU_WORKER_HOSTNAMES"] = ",".join(
            member_dns_name(h, subdomain) for h in members[first : first + hosts_per_slice]
        )
    slices = len(members) // hosts_per_slice
    if slices > 1:
        env |= {
            "MEGASCALE_COORDINATOR_ADDRESS": host,
            "MEGASCALE_NUM_SLICES": str(slices),
            "MEGASCALE_SLICE_ID": str(rank // hosts_per_slice),
            "MEGASCALE_PORT": str(megascale_port or DEFAULT_MEGASCALE_PORT),
        }
    return env
