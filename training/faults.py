"""The fault kinds: each a class that says its keys, which side fires it and what it does there, in one registry.

Faults come from ``--chaos`` or the config's ``elastic.chaos`` list, as ``ACTION:key=value,key=value``.
Each fires once per run: fired faults are recorded as ``chaos`` events, so a resumed job that
passes the same step again does not fire it twice.

A new kind is one class here, registered with ``@fault_kind``, plus its test: its ``name`` and keys, and the
hooks of the side that fires it (``before_step``, ``lr_scale``, ``corrupts``, ``after_save_started`` on the
worker; ``on_agent`` for what the host's agent carries out; ``due`` and ``on_leader`` for the job's leader).
``training.elastic.chaos`` calls the worker's and the leader's hooks, ``training.elastic.host.reports`` the agent's.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, TypeVar

if TYPE_CHECKING:
    from training.sections import (
        CheckpointSection,
        DataSection,
        ElasticSection,
        ModelSection,
        ObservabilitySection,
        OptimizerSection,
        PlacementSection,
    )


class ChaosError(ValueError):
    """A fault spec that does not parse, or a fault that cannot be carried out."""


@dataclass(frozen=True)
class Fault:
    """One parsed fault spec: its action and its numeric keys."""

    action: str
    params: dict[str, float] = field(default_factory=dict, hash=False, compare=True)
    spec: str = ""

    def get(self, key: str, default: float | None = None) -> float | None:
        return self.params.get(key, default)

    @property
    def step(self) -> int | None:
        s = self.params.get("step")
        return None if s is None else int(s)

    @property
    def worker(self) -> int:
        return int(self.params.get("worker", 0))

    @property
    def repeats(self) -> bool:
        return bool(self.params.get("repeat", 0))

    @property
    def kind(self) -> FaultKind:
        return KINDS[self.action]


def parse_chaos(spec: str) -> Fault:
    action, _, rest = spec.strip().partition(":")
    if action not in KINDS:
        raise ChaosError(f"chaos {spec!r}: unknown action {action!r}; known: {', '.join(sorted(KINDS))}")
    params: dict[str, float] = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise ChaosError(f"chaos {spec!r}: {item!r} is not key=value")
        try:
            params[k.strip()] = float(v)
        except ValueError:
            raise ChaosError(f"chaos {spec!r}: {k.strip()} must be a number, got {v!r}") from None
    kind = KINDS[action]
    missing = kind.required - params.keys()
    unknown = params.keys() - kind.required - kind.optional
    if missing:
        raise ChaosError(f"chaos {spec!r}: missing {', '.join(sorted(missing))}")
    if unknown:
        raise ChaosError(f"chaos {spec!r}: unknown key(s) {', '.join(sorted(unknown))}")
    fault = Fault(action, params, spec.strip())
    try:
        kind.check(fault)
    except ChaosError as e:
        raise ChaosError(f"chaos {spec!r}: {e}") from None
    return fault


def spec_pattern() -> str:
    """A regular expression for one spec (the DAG's param schema): the actions, then key=number pairs."""
    actions = "|".join(sorted(KINDS))
    return rf"^({actions}):[a-z_]+=[0-9.]+(,[a-z_]+=[0-9.]+)*$"


class RunConfig(Protocol):
    """What a kind's config rule reads: the run config's sections (a ``training.config.Config``)."""

    model: ModelSection
    data: DataSection
    optimizer: OptimizerSection
    checkpoint: CheckpointSection
    elastic: ElasticSection
    placement: PlacementSection
    observability: ObservabilitySection


class WorkerSide(Protocol):
    """What a worker-side fault acts through (``training.elastic.chaos.WorkerChaos``)."""

    rank: int
    lr_factor: float

    def fire(self, fault: Fault, step: int, everyone: bool = False) -> None:
        """Report the fault to the agent before it happens (on record as a ``chaos`` event)."""

    def damage_local(self) -> None:
        """Cut a file of this host's newest described local checkpoint."""


class AgentSide(Protocol):
    """What a fault carried out by a host's agent acts through (``training.elastic.host.reports``)."""

    host: str

    def leave_pool(self, fault: Fault) -> None:
        """This host leaves the capacity pool (the local slice), and no other."""

    def disturb_storage(self, fault: Fault, for_s: float, latency_s: float) -> None:
        """Every call of this agent to the run root fails (or is ``latency_s`` slower) for ``for_s`` seconds."""


class LeaderSide(Protocol):
    """What a fault the job's leader fires acts through (``training.elastic.chaos.JobChaos``)."""

    def set_capacity(self, fault: Fault, to: int, step: int | None) -> None:
        """The pool's capacity becomes ``to`` hosts (on record first)."""


class FaultKind:
    """One kind of fault: its name and keys, the side that fires it, and what it does there (the hooks)."""

    name: ClassVar[str]
    required: ClassVar[frozenset[str]] = frozenset({"worker", "step"})
    optional: ClassVar[frozenset[str]] = frozenset()
    worker_side: ClassVar[bool] = True  # fired by a worker at a step; else by the job's leader (``due``)
    by_agent: ClassVar[Literal["", "host", "storage"]] = ""  # the host's agent carries it out: the host, its storage

    def check(self, fault: Fault) -> None:
        """Rules beyond the required and optional keys (a ``ChaosError`` saying what is wrong)."""

    def check_config(self, fault: Fault, cfg: RunConfig) -> None:
        """Rules against the run's config, checked when the config is resolved (a ``ChaosError``)."""

    def before_step(self, fault: Fault, on: WorkerSide, step: int) -> None:
        """This worker's fault, due at ``step``, before the step runs."""

    def lr_scale(self, fault: Fault, on: WorkerSide, step: int, scale: float) -> float:
        """The update's scale at ``step``, the fault's step (any worker): ``scale`` unless the kind changes it."""
        return scale

    def corrupts(self) -> bool:
        """Whether the parameters are overwritten with noise before the save of the fault's step."""
        return False

    def after_save_started(self, fault: Fault, on: WorkerSide, step: int) -> None:
        """This worker's fault, at its step, once the save of that step has started."""

    def on_agent(self, fault: Fault, agent: AgentSide) -> None:
        """What the host's agent carries out (kinds with ``by_agent``), once the fault is on record."""

    def due(self, fault: Fault, step: int | None, elapsed: float) -> bool:
        """A leader-side fault: whether it is due at rank 0's ``step``, ``elapsed`` seconds into the job."""
        return False

    def on_leader(self, fault: Fault, leader: LeaderSide, step: int | None) -> None:
        """A leader-side fault, carried out by the job's leader."""


# Every fault kind by name (``@fault_kind`` adds one).
KINDS: dict[str, FaultKind] = {}
ACTIONS = KINDS  # the name earlier versions used
_K = TypeVar("_K", bound=type[FaultKind])  # (a type parameter list needs Python 3.12)


def fault_kind(cls: _K) -> _K:
    """Register a fault kind (a class decorator): its ``name`` becomes a chaos action."""
    if cls.name in KINDS:
        raise ValueError(f"fault kind {cls.name!r} is registered twice")
    KINDS[cls.name] = cls()
    return cls


def kinds_where(worker_side: bool | None = None, by_agent: str | None = None) -> frozenset[str]:
    """The names of the kinds fired on one side, or carried out by the agent on ``"host"`` or ``"storage"``."""
    return frozenset(
        name
        for name, k in KINDS.items()
        if (worker_side is None or k.worker_side == worker_side) and (by_agent is None or k.by_agent == by_agent)
    )


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@fault_kind
class Preempt(FaultKind):
    """``worker=W,step=S``: the host of worker W is lost at step S: its agent and worker are SIGKILLed together,
    and capacity drops by one."""

    name = "preempt"
    by_agent = "host"

    def before_step(self, fault: Fault, on: WorkerSide, step: int) -> None:
        on.fire(fault, step, everyone=True)
        time.sleep(3600)  # the agent takes the host down (with this process)

    def on_agent(self, fault: Fault, agent: AgentSide) -> None:
        agent.leave_pool(fault)
        os.killpg(os.getpgid(0), signal.SIGKILL)  # the agent, its worker and its standby: the host is gone


@fault_kind
class KillAgent(Preempt):
    """``worker=W,step=S``: the host agent of worker W is SIGKILLed at step S (its worker dies with it); the host
    stays, so the agent comes back (as Kubernetes restarts a pod)."""

    name = "kill_agent"

    def on_agent(self, fault: Fault, agent: AgentSide) -> None:
        os.kill(os.getpid(), signal.SIGKILL)  # the worker dies with its agent (PR_SET_PDEATHSIG)


@fault_kind
class Freeze(Preempt):
    """``worker=W,step=S``: the host of worker W freezes at step S (SIGSTOP of its agent and worker): no error
    anywhere, only a heartbeat that stops."""

    name = "freeze"

    def on_agent(self, fault: Fault, agent: AgentSide) -> None:
        os.killpg(os.getpgid(0), signal.SIGSTOP)


@fault_kind
class Crash(FaultKind):
    """``worker=W,step=S``: worker W is SIGKILLed at step S; the host and its agent stay (the process died, not
    the machine)."""

    name = "crash"

    def before_step(self, fault: Fault, on: WorkerSide, step: int) -> None:
        on.fire(fault, step, everyone=True)
        _kill_self()


@fault_kind
class DamageLocal(Crash):
    """``worker=W,step=S``: at step S, the newest described local checkpoint on the host of worker W loses the end
    of a file (a host-local disk gone bad), then worker W is SIGKILLed; the recovery must step over that copy."""

    name = "damage_local"

    def check_config(self, fault: Fault, cfg: RunConfig) -> None:
        if not cfg.checkpoint.local_checkpoint_every:
            raise ChaosError("damage_local needs the local tier (local_checkpoint_every > 0)")

    def before_step(self, fault: Fault, on: WorkerSide, step: int) -> None:
        on.damage_local()
        super().before_step(fault, on, step)


@fault_kind
class PreemptNotice(FaultKind):
    """``worker=W,step=S``: the host of worker W gets a preemption notice at step S (SIGTERM to its agent, as
    Kubernetes sends a pod): the group stops at the next step boundary, commits that step, the host leaves, and
    capacity drops by one."""

    name = "preempt_notice"

    def before_step(self, fault: Fault, on: WorkerSide, step: int) -> None:
        on.fire(fault, step, everyone=True)
        # The platform's notice goes to the host's agent (a pod's first process), which passes it on.
        os.kill(int(os.environ.get("RTRAIN_AGENT_PID") or os.getppid()), signal.SIGTERM)


@fault_kind
class KillDuringSave(FaultKind):
    """``worker=W,step=S``: worker W is SIGKILLed while the async save of step S is being written."""

    name = "kill_during_save"

    def after_save_started(self, fault: Fault, on: WorkerSide, step: int) -> None:
        on.fire(fault, step, everyone=True)
        _kill_self()


@fault_kind
class Capacity(FaultKind):
    """``to=N`` and ``step=S`` or ``after_s=T``: capacity becomes N hosts at step S, or T seconds after the job
    started (as the leader sees the step: several due at once fire 2 s apart, in the order given)."""

    name = "capacity"
    required = frozenset({"to"})
    optional = frozenset({"step", "after_s"})
    worker_side = False

    def check(self, fault: Fault) -> None:
        if not ({"step", "after_s"} & fault.params.keys()):
            raise ChaosError("capacity needs step=S or after_s=T")

    def due(self, fault: Fault, step: int | None, elapsed: float) -> bool:
        after = fault.get("after_s")
        at_step = fault.step is not None and step is not None and int(step) >= fault.step
        return at_step or (after is not None and elapsed >= float(after))

    def on_leader(self, fault: Fault, leader: LeaderSide, step: int | None) -> None:
        leader.set_capacity(fault, int(fault.get("to") or 0), step)


@fault_kind
class NaN(FaultKind):
    """``step=S``: the update of step S is NaN, so the loss goes non-finite from step S+1; ``repeat=1`` fires it on
    every pass over step S (to exhaust the guard's attempts)."""

    name = "nan"
    required = frozenset({"step"})
    optional = frozenset({"repeat"})

    def lr_scale(self, fault: Fault, on: WorkerSide, step: int, scale: float) -> float:
        on.fire(fault, step)
        return float("nan")


@fault_kind
class LRSpike(FaultKind):
    """``step=S,factor=F``: from step S the update is scaled by F."""

    name = "lr_spike"
    required = frozenset({"step", "factor"})

    def lr_scale(self, fault: Fault, on: WorkerSide, step: int, scale: float) -> float:
        on.lr_factor = float(fault.get("factor") or 1.0)
        on.fire(fault, step)
        return on.lr_factor


@fault_kind
class Corrupt(FaultKind):
    """``step=S``: the parameters are overwritten with noise just before the checkpoint of step S is saved."""

    name = "corrupt"
    required = frozenset({"step"})

    def corrupts(self) -> bool:
        return True


@fault_kind
class StorageOutage(FaultKind):
    """``worker=W,step=S,for_s=T``: from step S, every call of the host agent of worker W to the run root fails for
    T seconds (its heartbeats, round looks, lease, events; not its local tier), as a store of that kind fails; its
    worker trains on. Longer than the lease, another agent leads; longer than the heartbeat timeout, the host leaves
    the round and rejoins after."""

    name = "storage_outage"
    required = frozenset({"worker", "step", "for_s"})
    by_agent = "storage"

    def before_step(self, fault: Fault, on: WorkerSide, step: int) -> None:
        on.fire(fault, step, everyone=True)  # the agent loses (or slows) its run root; this worker goes on

    def on_agent(self, fault: Fault, agent: AgentSide) -> None:
        agent.disturb_storage(fault, float(fault.get("for_s") or 0.0), float(fault.get("latency_s") or 0.0))


@fault_kind
class StorageLatency(StorageOutage):
    """``worker=W,step=S,for_s=T,latency_s=L``: the same, but every call takes L seconds more instead of failing."""

    name = "storage_latency"
    required = frozenset({"worker", "step", "for_s", "latency_s"})


# The kinds by the side that fires them (the built-in ones; ``kinds_where`` for any registered since).
WORKER_SIDE = kinds_where(worker_side=True)
HOST_ACTIONS = kinds_where(by_agent="host")
STORAGE_ACTIONS = kinds_where(by_agent="storage")
