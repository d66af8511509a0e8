"""Fault injection, from ``--chaos`` or the config's ``chaos`` list.

Grammar: ``ACTION:key=value,key=value``.  Each fault fires once per run (the
agent records fired faults as ``chaos`` events, so a resumed job that passes
the same step again does not fire it twice).

==================  ==========================================================
``preempt``         ``worker=W,step=S``: the host of worker W is lost when the
                    job reaches step S: its agent and worker are SIGKILLed
                    together, and capacity drops by one.
``crash``           ``worker=W,step=S``: worker W is SIGKILLed at step S; the
                    host and its agent stay (the process died, not the machine).
``kill_agent``      ``worker=W,step=S``: the host agent of worker W is
                    SIGKILLed at step S (its worker dies with it); the host
                    stays, so the agent comes back (as Kubernetes restarts a pod).
``freeze``          ``worker=W,step=S``: the host of worker W freezes at step S
                    (SIGSTOP of its agent and worker): no error anywhere, only
                    a heartbeat that stops.
``kill_during_save````worker=W,step=S``: worker W is SIGKILLed while the async
                    save of step S is being written.
``capacity``        ``to=N`` and ``step=S`` or ``after_s=T``: capacity becomes
                    N hosts at step S, or T seconds after the job started.
``nan``             ``step=S``: the update of step S is NaN, so the loss goes
                    non-finite from step S+1; ``repeat=1`` fires it on every
                    pass over step S (to exhaust the guard's attempts).
``lr_spike``        ``step=S,factor=F``: from step S the update is scaled by F.
``corrupt``         ``step=S``: the parameters are overwritten with noise just
                    before the checkpoint of step S is saved.
==================  ==========================================================
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ACTIONS: dict[str, tuple[set[str], set[str]]] = {
    # action: (required keys, optional keys)
    "preempt": ({"worker", "step"}, set()),
    "crash": ({"worker", "step"}, set()),
    "kill_agent": ({"worker", "step"}, set()),
    "freeze": ({"worker", "step"}, set()),
    "kill_during_save": ({"worker", "step"}, set()),
    "capacity": ({"to"}, {"step", "after_s"}),
    "nan": ({"step"}, {"repeat"}),
    "lr_spike": ({"step", "factor"}, set()),
    "corrupt": ({"step"}, set()),
}
# Fired by a worker at a step (the rest, capacity changes, by the job's leader).
WORKER_SIDE = frozenset({"preempt", "crash", "kill_agent", "freeze", "kill_during_save", "nan", "lr_spike", "corrupt"})
# Fired by the worker, carried out on the whole host by its agent.
HOST_ACTIONS = frozenset({"preempt", "kill_agent", "freeze"})


class ChaosError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
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


def parse_chaos(spec: str) -> Fault:
    action, _, rest = spec.strip().partition(":")
    if action not in ACTIONS:
        raise ChaosError(f"chaos {spec!r}: unknown action {action!r}; known: {', '.join(sorted(ACTIONS))}")
    params: dict[str, float] = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise ChaosError(f"chaos {spec!r}: {item!r} is not key=value")
        try:
            params[k.strip()] = float(v)
        except ValueError:
            raise ChaosError(f"chaos {spec!r}: {k.strip()} must be a number, got {v!r}") from None
    required, optional = ACTIONS[action]
    missing = required - params.keys()
    unknown = params.keys() - required - optional
    if missing:
        raise ChaosError(f"chaos {spec!r}: missing {', '.join(sorted(missing))}")
    if unknown:
        raise ChaosError(f"chaos {spec!r}: unknown key(s) {', '.join(sorted(unknown))}")
    if action == "capacity" and not ({"step", "after_s"} & params.keys()):
        raise ChaosError(f"chaos {spec!r}: capacity needs step=S or after_s=T")
    return Fault(action, params, spec.strip())


class WorkerChaos:
    """The faults one worker fires, each at the step its spec names.

    ``send`` reports a fault to the agent before it happens (the agent records
    it as a ``chaos`` event, so a resumed job does not fire it again, and
    carries out the host-level ones: preempt, kill_agent, freeze).
    """

    def __init__(self, specs: list[str], rank: int, send: Callable[..., None]) -> None:
        self.faults = [parse_chaos(s) for s in specs]
        self.rank = rank
        self.send = send
        self.lr_factor = 1.0

    def _fire(self, f: Fault, step: int, everyone: bool = False) -> None:
        self.send("chaos", everyone=everyone, action=f.action, spec=f.spec, step=step, worker=self.rank, at=time.time())

    def before_step(self, step: int) -> None:
        """Process and host faults due at ``step`` (this call does not return for them)."""
        for f in self.faults:
            if f.step != step or f.worker != self.rank:
                continue
            if f.action == "crash":
                self._fire(f, step, everyone=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if f.action in HOST_ACTIONS:
                self._fire(f, step, everyone=True)
                time.sleep(3600)  # the agent takes the host down (with this process)

    def learning_rate_scale(self, step: int) -> float:
        """1.0 normally; from an ``lr_spike`` step on its factor; NaN at a ``nan`` step."""
        scale = self.lr_factor
        for f in self.faults:
            if f.step != step:
                continue
            if f.action == "lr_spike":
                self.lr_factor = scale = float(f.get("factor") or 1.0)
                self._fire(f, step)
            elif f.action == "nan":
                scale = float("nan")
                self._fire(f, step)
        return scale

    def corrupts(self, step: int) -> bool:
        """Should the parameters be overwritten with noise before the save of ``step``?"""
        due = [f for f in self.faults if f.action == "corrupt" and f.step == step]
        for f in due:
            self._fire(f, step)
        return bool(due)

    def after_save_started(self, step: int) -> None:
        for f in self.faults:
            if f.action == "kill_during_save" and f.step == step and f.worker == self.rank:
                self._fire(f, step, everyone=True)
                os.kill(os.getpid(), signal.SIGKILL)


def spec_pattern() -> str:
    """A regular expression for one spec (the DAG's param schema): the actions, then key=number pairs."""
    actions = "|".join(sorted(ACTIONS))
    return rf"^({actions}):[a-z_]+=[0-9.]+(,[a-z_]+=[0-9.]+)*$"


def describe_actions() -> dict[str, Any]:
    """The grammar, for ``rtrain config`` and error messages."""
    return {a: {"required": sorted(r), "optional": sorted(o)} for a, (r, o) in ACTIONS.items()}
