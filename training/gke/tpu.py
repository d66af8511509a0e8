"""TPU slice shapes: the one table of GKE's TPU machine types, a slice's chips and hosts, and how many slices a
run's config can use (pure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from training.gke.names import GKEConfigError

if TYPE_CHECKING:
    from training.config import Config
    from training.sections import ElasticSection


# --- TPU machine types -------------------------------------------------------------


@dataclass(frozen=True)
class TPUMachineType:
    """One GKE TPU machine type: what one host (VM) of it has."""

    machine_type: str
    generation: str
    accelerator: str  # the value of the node label cloud.google.com/gke-tpu-accelerator
    chips_per_host: int
    dims: int  # 2: a 2D torus topology "AxB"; 3: a 3D topology "AxBxC"
    topologies: tuple[str, ...] | None = None  # the topologies GKE offers; None: any whose chips fill whole hosts


_2D_MULTI = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
# v4 / v5p (3D): a slice smaller than one 4x4x4 cube is one of these; from a cube up, whole cubes
# (every dimension a multiple of 4).  Cloud TPU's v4 and v5p topology tables.
_3D_SUB_CUBE = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")

#: The one table of TPU machine types this project knows.  chips_per_host is
#: Config.devices_per_worker (JAX shows a v4/v5p megacore chip as one device).
TPU_MACHINE_TYPES: dict[str, TPUMachineType] = {
    t.machine_type: t
    for t in (
        TPUMachineType("ct4p-hightpu-4t", "v4", "tpu-v4-podslice", 4, 3),
        TPUMachineType("ct5lp-hightpu-1t", "v5e", "tpu-v5-lite-podslice", 1, 2, ("1x1",)),
        TPUMachineType("ct5lp-hightpu-4t", "v5e", "tpu-v5-lite-podslice", 4, 2, _2D_MULTI),
        TPUMachineType("ct5lp-hightpu-8t", "v5e", "tpu-v5-lite-podslice", 8, 2, ("2x4",)),
        TPUMachineType("ct5p-hightpu-4t", "v5p", "tpu-v5p-slice", 4, 3),
        TPUMachineType("ct6e-standard-1t", "v6e", "tpu-v6e-slice", 1, 2, ("1x1",)),
        TPUMachineType("ct6e-standard-4t", "v6e", "tpu-v6e-slice", 4, 2, _2D_MULTI),
        TPUMachineType("ct6e-standard-8t", "v6e", "tpu-v6e-slice", 8, 2, ("2x4",)),
    )
}


def machine_type_info(machine_type: str) -> TPUMachineType:
    try:
        return TPU_MACHINE_TYPES[machine_type]
    except KeyError:
        raise GKEConfigError(
            f"machine_type: unknown TPU machine type {machine_type!r}; known: {', '.join(sorted(TPU_MACHINE_TYPES))}"
        ) from None


@dataclass(frozen=True)
class TPUSlice:
    """A TPU slice shape: a machine type and a topology; it knows its chips and hosts."""

    machine_type: str
    topology: str

    def __post_init__(self) -> None:
        info = machine_type_info(self.machine_type)
        parts = self.topology.split("x")
        if len(parts) != info.dims or not all(p.isdigit() and int(p) >= 1 for p in parts):
            shape = "AxB" if info.dims == 2 else "AxBxC"
            raise GKEConfigError(f"tpu_topology: {self.topology!r} is not a {shape} topology for {self.machine_type}")
        if info.topologies is not None and self.topology not in info.topologies:
            raise GKEConfigError(
                f"tpu_topology: {self.machine_type} offers {', '.join(info.topologies)}, not {self.topology!r}"
            )
        if info.dims == 3 and self.topology not in _3D_SUB_CUBE and any(int(p) % 4 for p in parts):
            raise GKEConfigError(
                f"tpu_topology: {info.generation} slices are {', '.join(_3D_SUB_CUBE)} or whole 4x4x4 cubes "
                f"(each dimension a multiple of 4, e.g. 4x4x4, 4x4x8, 4x8x8), not {self.topology!r}"
            )
        if self.chips % info.chips_per_host:
            raise GKEConfigError(
                f"tpu_topology: {self.topology} has {self.chips} chips, not a whole number of "
                f"{self.machine_type} hosts ({info.chips_per_host} chips each)"
            )

    @property
    def info(self) -> TPUMachineType:
        return TPU_MACHINE_TYPES[self.machine_type]

    @property
    def accelerator(self) -> str:
        return self.info.accelerator

    @property
    def chips(self) -> int:
        return math.prod(int(p) for p in self.topology.split("x"))

    @property
    def chips_per_host(self) -> int:
        return self.info.chips_per_host

    @property
    def hosts(self) -> int:
        """Hosts (VMs, so JAX processes) of one slice."""
        return self.chips // self.chips_per_host

    @property
    def multi_host(self) -> bool:
        """A slice of several VMs: its node pool holds exactly this one slice."""
        return self.hosts > 1


def slice_bounds(elastic: ElasticSection, tpu: TPUSlice) -> tuple[int, int]:
    """The numbers of slices ``k`` whose hosts ``k * hosts`` lie in ``min_workers..max_workers``.

    A single-host slice cannot join others (GKE Multislice needs multi-host
    slices), so with one host per slice ``k`` is 1.
    """
    k_min = max(1, math.ceil(elastic.min_workers / tpu.hosts))
    k_max = elastic.max_workers // tpu.hosts
    if not tpu.multi_host:
        k_max = min(k_max, 1)
    if k_min > k_max:
        raise GKEConfigError(
            f"min_workers/max_workers: a {tpu.machine_type} {tpu.topology} slice has {tpu.hosts} host(s); "
            f"no number of slices gives {elastic.min_workers}..{elastic.max_workers} workers"
            + ("" if tpu.multi_host else " (single-host slices cannot form a multislice: k is 1)")
        )
    return k_min, k_max


def feasible_slices(cfg: Config, tpu: TPUSlice) -> list[int]:
    """The slice counts in :func:`slice_bounds` whose hosts the mesh and the global batch split over."""
    from training.mesh import feasible_sizes  # arithmetic only, no JAX

    k_min, k_max = slice_bounds(cfg.elastic, tpu)
    sizes = set(feasible_sizes(cfg))
    return [k for k in range(k_min, k_max + 1) if k * tpu.hosts in sizes]
