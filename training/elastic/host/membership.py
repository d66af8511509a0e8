"""Who trains in the next round, and from which step: pure policy, no I/O (tested with tables, no processes).

A multi-host TPU slice is lost and gained whole, so hosts count only in whole
slices: a slice whose hosts are not all alive contributes nothing.  Of the
complete slices the leader takes the largest number whose hosts the mesh and
the constant global batch split over (``training.mesh.feasible_sizes``), within
``min_workers..max_workers``.  Ranks are slice-major (process id = slice rank x
hosts per slice + host index in the slice), as TPU multislice expects.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from training.checkpoint.retention import USABLE_STATES
from training.config import Config
from training.elastic.rendezvous import HostRecord, ResumeFrom
from training.mesh import feasible_sizes
from training.sections import CheckpointSection, PlacementSection


def complete_slices(
    placement: PlacementSection, hosts: Mapping[str, HostRecord], alive: Collection[str]
) -> dict[int, list[str]]:
    """Slice index -> its hosts in index order, for the slices whose every host is alive."""
    by_slice: dict[int, dict[int, str]] = {}
    for name in alive:
        rec = hosts.get(name)
        if rec is not None:
            by_slice.setdefault(rec.slice, {})[rec.index] = name
    return {
        s: [members[i] for i in range(placement.hosts_per_slice)]
        for s, members in sorted(by_slice.items())
        if all(i in members for i in range(placement.hosts_per_slice))
    }


def choose_members(
    cfg: Config, hosts: Mapping[str, HostRecord], alive: Collection[str], prefer: Collection[str] = ()
) -> list[str] | None:
    """The members of the next round in rank order, or None when fewer hosts than ``min_workers`` can train.

    Slices holding hosts of ``prefer`` (the current members) come first, so a
    resize keeps as many processes in place as it can.
    """
    slices = complete_slices(cfg.placement, hosts, alive)
    sizes = [n for n in feasible_sizes(cfg) if n <= len(slices) * cfg.placement.hosts_per_slice]
    if not sizes:
        return None
    want = max(sizes) // cfg.placement.hosts_per_slice
    keep = set(prefer)
    order = sorted(slices, key=lambda s: (not any(h in keep for h in slices[s]), s))
    chosen = sorted(order[:want])
    return [h for s in chosen for h in slices[s]]


def largest_round(cfg: Config, available: int | None) -> int:
    """The largest round ``available`` hosts allow (none said, or 0: ``max_workers``)."""
    expected = min(available or cfg.elastic.max_workers, cfg.elastic.max_workers)
    return max([n for n in feasible_sizes(cfg) if n <= expected] or [0])


def newest_persistent(states: Mapping[int, Mapping[str, object]]) -> int | None:
    """The newest committed checkpoint the ledger's ``states`` hold usable (what ``resume=latest`` will pick)."""
    good = [s for s, r in states.items() if r.get("state") in USABLE_STATES]
    return max(good) if good else None


def resume_for(
    checkpoint: CheckpointSection,
    states: Mapping[int, Mapping[str, object]],
    hosts: Mapping[str, HostRecord],
    members: list[str] | None,
    local_floor: int,
) -> tuple[ResumeFrom, int | None]:
    """The next round's ``resume`` and the step it will start from.

    The steps every member holds a local copy of (of this lineage: saved in round ``local_floor`` or
    later) that are newer than any persistent checkpoint, newest first; else ``latest``.
    """
    newest = newest_persistent(states)
    local: list[int] = []
    if members and checkpoint.local_checkpoint_every:
        common: set[int] | None = None
        for h in members:
            rec = hosts.get(h)
            held = {int(s) for s, r in (rec.local if rec is not None else []) if int(r) >= local_floor}
            common = held if common is None else common & held
        local = sorted((s for s in common or set() if newest is None or s > newest), reverse=True)
    if local:
        return ResumeFrom(local=tuple(local)), local[0]
    return ResumeFrom(), newest
