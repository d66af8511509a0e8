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
``preempt_notice``  ``worker=W,step=S``: the host of worker W gets a preemption
                    notice at step S (SIGTERM to its agent, as Kubernetes sends a
                    pod): the group stops at the next step boundary, commits
                    that step, the host leaves, and capacity drops by one.
``damage_local``    ``worker=W,step=S``: at step S, the newest described local
                    checkpoint on the host of worker W loses the end of a file
                    (a host-local disk gone bad), then worker W is SIGKILLed;
                    the recovery must step over that copy.
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
from pathlib import Path
from typing import Any

ACTIONS: dict[str, tuple[set[str], set[str]]] = {
    # action: (required keys, optional keys)
    "preempt": ({"worker", "step"}, set()),
    "crash": ({"worker", "step"}, set()),
    "kill_agent": ({"worker", "step"}, set()),
    "freeze": ({"worker", "step"}, set()),
    "preempt_notice": ({"worker", "step"}, set()),
    "kill_during_save": ({"worker", "step"}, set()),
    "damage_local": ({"worker", "step"}, set()),
    "capacity": ({"to"}, {"step", "after_s"}),
    "nan": ({"step"}, {"repeat"}),
    "lr_spike": ({"step", "factor"}, set()),
    "corrupt": ({"step"}, set()),
}
# Fired by a worker at a step (the rest, capacity changes, by the job's leader).
WORKER_SIDE = frozenset(
    {
        "preempt",
        "preempt_notice",
        "crash",
        "kill_agent",
        "freeze",
        "kill_during_save",
        "damage_local",
        "nan",
        "lr_spike",
        "corrupt",
    }
)
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

    def __init__(
        self,
        specs: list[str],
        rank: int,
        send: Callable[..., None],
        local_dir: Path | None = None,
        settle_local: Callable[[], None] | None = None,
    ) -> None:
        self.faults = [parse_chaos(s) for s in specs]
        self.rank = rank
        self.send = send
        # ``damage_local``: this host's local tier, and a call that finishes its saves in flight and reports them.
        self.local_dir = local_dir
        self.settle_local = settle_local
        self.lr_factor = 1.0

    def _fire(self, f: Fault, step: int, everyone: bool = False) -> None:
        self.send("chaos", everyone=everyone, action=f.action, spec=f.spec, step=step, worker=self.rank, at=time.time())

    def before_step(self, step: int) -> None:
        """Process and host faults due at ``step`` (this call does not return for them)."""
        for f in self.faults:
            if f.step != step or f.worker != self.rank:
                continue
            if f.action == "damage_local":
                self._damage_local()
            if f.action in ("crash", "damage_local"):
                self._fire(f, step, everyone=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if f.action in HOST_ACTIONS:
                self._fire(f, step, everyone=True)
                time.sleep(3600)  # the agent takes the host down (with this process)
            if f.action == "preempt_notice":
                self._fire(f, step, everyone=True)
                # The platform's notice goes to the host's agent (a pod's first process), which passes it on.
                os.kill(int(os.environ.get("RTRAIN_AGENT_PID") or os.getppid()), signal.SIGTERM)

    def _damage_local(self) -> None:
        """Cut the largest file of the newest local copy of this host to half its size (once it is described:
        the damage is what a later check must find, not part of what the manifest records)."""
        from training.checkpoint.local import finalised_steps, read_manifests

        if self.local_dir is None or self.settle_local is None:
            raise ChaosError("damage_local: the local checkpoint tier is off (local_checkpoint_every=0)")
        self.settle_local()
        newest_step = max(finalised_steps(self.local_dir), default=None)
        if newest_step is None:
            raise ChaosError("damage_local: this host has no local checkpoint yet")
        deadline = time.monotonic() + 30
        while (described := read_manifests(self.local_dir)).get(newest_step) is None:
            if time.monotonic() > deadline:
                raise ChaosError(f"damage_local: local step {newest_step} was never described by the agent")
            time.sleep(0.05)
        newest = described[newest_step]
        name = max(newest.files, key=lambda n: newest.files[n][0])
        path = Path(self.local_dir or ".") / str(newest.step) / name
        with open(path, "r+b") as f:
            f.truncate(newest.files[name][0] // 2)

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
