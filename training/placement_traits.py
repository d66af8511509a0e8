"""What the engine reads off a run's placement (``placement.backend``): how its hosts are made and reached.

The engine's agent, worker and launcher ask these traits instead of comparing the backend's name, so
the name is compared in one place: this table, which the backend registry (``training.backends``)
extends for a backend of its own.  A backend another package ships is found by its entry point in the
``rtrain.backends`` group (the name is the backend's, the module registers it when imported), in every
process that reads its traits.  Nothing here imports JAX or the backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

GROUP = "rtrain.backends"  # entry points: a backend's name = the module that registers it (training.backends.add)


@dataclass(frozen=True)
class Traits:
    """How a placement's hosts are made and reached, as the engine needs to know it."""

    # Every host is a process on the launching machine playing a host with CPU devices (the local slice):
    # its worker gets the CPU slice's JAX settings, a round's programs are compiled once for all of them, and
    # launching with ``provision`` gives the slice its hosts.
    hosts_here: bool
    # A worker's TPU identity and Multislice settings are the round's, not its pod's (a JobSet's pods on GKE).
    round_tpu_env: bool
    # How long the launcher's lock waits for the job's hosts to take it over (pods scheduled, images pulled).
    handoff_s: float
    # What ``rtrain train`` needs besides the run's config to launch here ("": nothing).
    cli_needs: str = ""


TRAITS: dict[str, Traits] = {
    "local": Traits(hosts_here=True, round_tpu_env=False, handoff_s=120.0),
    "gke": Traits(
        hosts_here=False,
        round_tpu_env=True,
        handoff_s=900.0,
        cli_needs="its settings: rtrain train --gke FILE (docs/gke.md)",
    ),
}


def names() -> tuple[str, ...]:
    """The backends a run config can name: the engine's, those registered here, those installed as entry points."""
    return tuple(dict.fromkeys([*TRAITS, *(ep.name for ep in metadata.entry_points(group=GROUP))]))


def traits(backend: str) -> Traits:
    """The traits of the placement called ``backend`` (an installed backend's module imported first, once);
    ValueError naming the known ones for another."""
    if backend not in TRAITS:
        for ep in metadata.entry_points(group=GROUP, name=backend):
            try:
                ep.load()  # registers the backend (its traits among them)
            except Exception as e:  # a broken install, said as the config's error
                raise ValueError(f"backend {backend!r}: its module {ep.value} did not load: {e}") from e
    try:
        return TRAITS[backend]
    except KeyError:
        raise ValueError(f"backend: one of {', '.join(names())}, not {backend!r}") from None
