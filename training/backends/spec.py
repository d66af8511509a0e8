"""What a backend is asked to run: a :class:`JobSpec`, the run's config and where its hosts are (a tagged placement).

The placement is told apart by its ``kind``: the engine's are the local slice (:class:`LocalSpec`), the root's
shared pool at a priority (:class:`PoolSpec`), and TPU node pools on GKE (:class:`GKESpec`).  Airflow's
resolve task writes a run's spec as JSON (``training.api.RunSpec``, for XCom); :meth:`JobSpec.from_run_spec`
reads it back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, cast

from training.api import Config, RunSpec, config_from_dict
from training.gke import GKESettings
from training.placement_traits import traits


@dataclass(frozen=True)
class LocalSpec:
    """The local slice: the run's ``max_workers`` hosts as processes on this machine."""

    kind: Literal["local"] = "local"


@dataclass(frozen=True)
class PoolSpec:
    """The storage root's shared pool: the run submitted at ``priority``, placed by the root's scheduler."""

    priority: str
    kind: Literal["pool"] = "pool"


@dataclass(frozen=True)
class GKESpec:
    """TPU node pools and a JobSet on GKE, by the ``gke`` settings; ``priority``: Kueue's."""

    gke: GKESettings
    priority: str | None = None
    kind: Literal["gke"] = "gke"


class Placement(Protocol):
    """Where a job's hosts are: any placement class whose ``kind`` a backend is registered for
    (``training.backends.register``), the three above or one of a module of its own."""

    @property
    def kind(self) -> str: ...


# How a backend's name and its settings make a placement (the registry adds a backend's own).
PlaceBy = Callable[[Mapping[str, Any] | None, str | None], Placement]
PLACEMENTS: dict[str, PlaceBy] = {
    "local": lambda settings, priority: PoolSpec(priority) if priority else LocalSpec(),  # a priority: the pool
    "gke": lambda settings, priority: GKESpec(cast(GKESettings, dict(settings or {})), priority),
}


def placement(backend: str, settings: Mapping[str, Any] | None = None, priority: str | None = None) -> Placement:
    """The placement a backend's name and settings say (a local run with a priority joins the shared pool)."""
    traits(backend)  # an installed backend registered (ValueError naming the known ones for another)
    return PLACEMENTS[backend](settings, priority)


@dataclass(frozen=True)
class JobSpec:
    """A job to run: the run's config and where its hosts are."""

    config: Config
    placement: Placement

    @classmethod
    def local(cls, cfg: Config) -> JobSpec:
        """A job of ``cfg`` on the local slice."""
        return cls(cfg, LocalSpec())

    @classmethod
    def from_run_spec(cls, spec: RunSpec | Mapping[str, Any], cfg: Config | None = None) -> JobSpec:
        """The job of a DAG run's resolved run spec (its JSON form, as XCom hands it over); ``cfg``: another config
        of the run than the spec's (a relaunch resumes from the latest step)."""
        cfg = cfg or config_from_dict(spec["config"])
        return cls(
            cfg, placement(str(spec.get("backend") or cfg.placement.backend), spec.get("gke"), spec.get("priority"))
        )

    def with_config(self, cfg: Config) -> JobSpec:
        """The same placement for another config of the run (a relaunch resumes from the latest step)."""
        return replace(self, config=cfg)
