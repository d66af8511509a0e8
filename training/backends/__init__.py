"""Where a run's jobs run, chosen by name: the local slice (the default), the shared pool, GKE, or one added.

The Airflow hook and the CLI both choose here; each backend answers the verbs of
:class:`~training.backends.base.Backend`.  A backend of another package is one module that calls
:func:`add` when imported, found by its ``rtrain.backends`` entry point (``training.placement_traits``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from training.backends.base import ALIVE, Backend, BackendError, Log, PoolsUp, Provisioned, Released
from training.backends.gke import PREPARATION as GKE_PREPARATION
from training.backends.gke import GKEBackend, GKECluster, JobSets
from training.backends.local import LocalSliceBackend
from training.backends.pool import SharedPoolBackend
from training.backends.prepare import AS_IS, Preparation
from training.backends.spec import PLACEMENTS, GKESpec, JobSpec, LocalSpec, PlaceBy, Placement, PoolSpec, placement
from training.gke import GKESettings
from training.placement_traits import TRAITS, Traits, names, traits

__all__ = [
    "ALIVE",
    "names",
    "remove",
    "Backend",
    "BackendError",
    "Context",
    "GKESpec",
    "JobSpec",
    "LocalSpec",
    "Placement",
    "Preparation",
    "preparation",
    "PoolSpec",
    "REGISTRY",
    "add",
    "backend_for",
    "register",
    "GKEBackend",
    "GKECluster",
    "JobSets",
    "LocalSliceBackend",
    "Log",
    "PoolsUp",
    "Provisioned",
    "Released",
    "placement",
    "SharedPoolBackend",
    "backend",
]


@dataclass(frozen=True)
class Context:
    """What a backend is made with besides its placement: where it says what it did, who it is, the GKE calls."""

    log: Log | None = None
    by: str = "Airflow"  # who provisions and tears down, in the run's records
    cluster: GKECluster | None = None  # the gke backend's cluster calls (None: Application Default Credentials)
    # How the gke backend makes its cluster calls from its settings, where ``cluster`` is not given (Airflow's
    # provider hooks, with their connection)
    make_cluster: Callable[[GKESettings], GKECluster] | None = None
    # Launched from a terminal that follows the job (rtrain train in the foreground): a backend that can gives the
    # hosts at launch and refuses a live job of the run rather than follow it
    foreground: bool = False


Factory = Callable[[Any, Context], Backend]
REGISTRY: dict[str, Factory] = {}  # a placement's kind -> how to make its backend


def register(kind: str) -> Callable[[Factory], Factory]:
    """Register the factory of the backend that runs placements of ``kind`` (one per kind)."""

    def add(factory: Factory) -> Factory:
        if kind in REGISTRY:
            raise ValueError(f"backend kind {kind!r} is registered already")
        REGISTRY[kind] = factory
        return factory

    return add


@register("local")
def _local(where: LocalSpec, ctx: Context) -> Backend:
    return LocalSliceBackend(ctx.log, ctx.by, provision=ctx.foreground, follow=not ctx.foreground)


@register("pool")
def _pool(where: PoolSpec, ctx: Context) -> Backend:
    return SharedPoolBackend(where.priority, ctx.log, ctx.by)


@register("gke")
def _gke(where: GKESpec, ctx: Context) -> Backend:
    cluster = ctx.cluster
    if cluster is None and ctx.make_cluster is not None:
        cluster = ctx.make_cluster(where.gke)
    if cluster is None:
        from training.backends.gke_cluster import CloudCluster

        cluster = CloudCluster(where.gke, log=ctx.log)  # Application Default Credentials
    return GKEBackend(where.gke, cluster, ctx.log, where.priority, ctx.by)


def _known(name: str) -> None:
    """Refuse a name no backend has (an installed backend's module is imported here)."""
    try:
        traits(name)
    except ValueError as e:
        raise BackendError(str(e)) from None


def add(name: str, kind_traits: Traits, place: PlaceBy, factory: Factory, prep: Preparation = AS_IS) -> None:
    """Add the backend called ``name``: its traits, the placement its settings make (of a kind of its own), the
    factory of the backend that runs that kind, and how it readies a run's config.  Call it once per process,
    when the backend's module is imported (its entry point, or by hand before a config names it)."""
    if name in TRAITS:
        raise ValueError(f"backend {name!r} is added already")
    kind = place(None, None).kind
    register(kind)(factory)
    TRAITS[name], PLACEMENTS[name], PREPARATIONS[name] = kind_traits, place, prep


def remove(name: str) -> None:
    """Take an added backend out again (the engine's own stay)."""
    if name in ("local", "gke"):
        raise ValueError(f"backend {name!r} is the engine's own")
    place = PLACEMENTS.pop(name, None)
    TRAITS.pop(name, None)
    PREPARATIONS.pop(name, None)
    if place is not None:
        REGISTRY.pop(place(None, None).kind, None)


# A backend's name -> how it readies a run's config (a backend not named here takes the config as it is)
PREPARATIONS: dict[str, Preparation] = {"gke": GKE_PREPARATION}


def preparation(name: str) -> Preparation:
    """How the backend called ``name`` readies a run's config; BackendError naming the known ones for another."""
    _known(name)
    return PREPARATIONS.get(name, AS_IS)


def backend_for(where: Placement | JobSpec, ctx: Context | None = None) -> Backend:
    """The backend that runs a placement (or a job spec's): its kind's registered factory."""
    place = where.placement if isinstance(where, JobSpec) else where
    factory = REGISTRY.get(place.kind)
    if factory is None:
        raise BackendError(f"backend: no backend runs placements of kind {place.kind!r} (known: {', '.join(REGISTRY)})")
    return factory(place, ctx or Context())


def backend(
    name: str,
    *,
    gke: GKESettings | None = None,
    priority: str | None = None,
    cluster: GKECluster | None = None,
    log: Log | None = None,
    by: str = "Airflow",
    make_cluster: Callable[[GKESettings], GKECluster] | None = None,
) -> Backend:
    """The backend called ``name``; ``priority`` puts a local run in its root's shared pool (on GKE: Kueue's).

    ``cluster`` (or ``make_cluster``, from the settings): the GKE calls (node pools, JobSets) for the ``gke``
    backend; by default a :class:`~training.backends.gke_cluster.CloudCluster` with Application Default
    Credentials.  ``by``: who provisions and tears down, in the run's records.
    """
    _known(name)
    return backend_for(placement(name, gke, priority), Context(log, by, cluster, make_cluster))
