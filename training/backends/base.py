"""What every backend answers: provision hosts, launch a job, look at it, stop it, give the hosts back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, Protocol, TypedDict

from training.api import ALIVE_STATES, JobLook
from training.backends.spec import JobSpec
from training.gke import GKESettings

# Live states as the backends report them: the engine's, and ``queued`` (a shared-pool run waiting for hosts).
ALIVE = tuple(sorted({*ALIVE_STATES, "queued"}))


def first_line(e: BaseException) -> str:
    """An error's message on one line (a cloud API's can run over several)."""
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


class BackendError(ValueError):
    """A backend's settings that cannot work, or a run that can never fit its hosts (the message names the key)."""


class Log(Protocol):
    """Where a backend says what it did: a ``logging.Logger`` or Airflow's task log."""

    def info(self, msg: Any, /, *args: Any) -> Any: ...

    def warning(self, msg: Any, /, *args: Any) -> Any: ...


@dataclass
class PoolsUp:
    """A run's node pools once enough are up: those up, being created, refused for now (sent again), failed (why)."""

    ready: list[str]
    creating: list[str]  # a create accepted, the pool on its way
    failed: dict[str, str]
    retrying: list[str] = field(default_factory=list)  # a create refused for now, sent again after a backoff


class Provisioned(TypedDict, total=False):
    """What ``provision`` made ready: the local slice's hosts, the shared pool's size, or the node pools up."""

    backend: str
    run_uri: str
    hosts: int
    pool: int
    priority: str
    need: int
    node_pools_up: list[str]
    node_pools_creating: list[str]
    node_pools_retrying: list[str]
    node_pools_failed: dict[str, str]


class Released(TypedDict, total=False):
    """What ``release`` gave back: processes stopped, a queued run cancelled, JobSets and node pools deleted."""

    backend: str
    released: bool
    stopped_pids: list[int]
    cancelled: bool
    ended: str
    jobsets_deleted: list[str]
    node_pools_deleted: list[str]


class JobHandle(TypedDict):
    """What a backend's launch returns and a watch follows: the job of a run, and where its events begin.

    Each backend's handle adds what it needs to find its job again (JSON as it is: it crosses XCom).
    """

    backend: str  # local | gke
    run_uri: str
    job: str  # the job id (the run lock's and the rendezvous' owner); "" while a shared pool's run waits
    attached: bool  # True: an already running job of the run was found and is followed
    launched_at: float
    events_after: str | None  # a watch tells the events after this key


class LocalHandle(JobHandle, total=False):
    """A local slice's job: the slice process (on ``host``) that keeps its host agents running."""

    controller_pid: int
    host: str


class PoolHandle(JobHandle):
    """A shared pool's run: its submission at ``priority`` to the queue of ``root``; ``job`` once placed."""

    priority: str
    root: str
    run_name: str


class GKEHandle(JobHandle):
    """A GKE job: its JobSet, on how many slices, and the settings it was launched with."""

    jobset: str
    namespace: str
    num_slices: int
    state: str  # the JobSet's state when it was created
    gke: NotRequired[GKESettings]


class Timeouts(TypedDict, total=False):
    """When a look calls a job failed: never started within ``start_timeout_s``, or silent for ``stale_after_s``."""

    start_timeout_s: float
    stale_after_s: float


class Backend(Protocol):
    """Where a run's jobs run: the same five verbs for the local slice, the shared pool and GKE."""

    name: str

    def provision(self, job: JobSpec) -> Provisioned:
        """Make the run's hosts ready (enough for ``min_workers``; the rest may join later)."""
        ...

    def launch(self, job: JobSpec, attempt: int) -> JobHandle:
        """Start a job, or follow the run's live one; never start a second."""
        ...

    def poll(self, handle: Mapping[str, Any], timeouts: Timeouts, now: float | None = None) -> JobLook:
        """One look at the job: its state (alive, finished, failed), why, and its status."""
        ...

    def stop(self, handle: Mapping[str, Any], reason: str) -> None:
        """Ask the job to stop at a step boundary (resumable); returns at once."""
        ...

    def release(self, job: JobSpec, handles: Sequence[Mapping[str, Any]]) -> Released:
        """Stop the jobs of ``handles`` still running and give the hosts back."""
        ...
