"""The fault grammar: what each kind of injected fault is, its keys, and which side fires it.

Faults come from ``--chaos`` or the config's ``chaos`` list, as ``ACTION:key=value,key=value``.
Each fires once per run: fired faults are recorded as ``chaos`` events, so a resumed job that
passes the same step again does not fire it twice.

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
                    N hosts at step S, or T seconds after the job started
                    (as the leader sees the step: several due at once fire
                    2 s apart, in the order given).
``nan``             ``step=S``: the update of step S is NaN, so the loss goes
                    non-finite from step S+1; ``repeat=1`` fires it on every
                    pass over step S (to exhaust the guard's attempts).
``lr_spike``        ``step=S,factor=F``: from step S the update is scaled by F.
``corrupt``         ``step=S``: the parameters are overwritten with noise just
                    before the checkpoint of step S is saved.
``storage_outage``  ``worker=W,step=S,for_s=T``: from step S, every call of the
                    host agent of worker W to the run root fails for T seconds
                    (its heartbeats, round looks, lease, events; not its local
                    tier), as a store of that kind fails; its worker trains on.
                    Longer than the lease, another agent leads; longer than
                    the heartbeat timeout, the host leaves the round and
                    rejoins after.
``storage_latency`` ``worker=W,step=S,for_s=T,latency_s=L``: the same, but every
                    call takes L seconds more instead of failing.
==================  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    "storage_outage": ({"worker", "step", "for_s"}, set()),
    "storage_latency": ({"worker", "step", "for_s", "latency_s"}, set()),
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
        "storage_outage",
        "storage_latency",
    }
)
# Fired by the worker, carried out on the whole host by its agent.
HOST_ACTIONS = frozenset({"preempt", "kill_agent", "freeze"})
# Fired by the worker, carried out by its agent on its own link to the run root.
STORAGE_ACTIONS = frozenset({"storage_outage", "storage_latency"})


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


def spec_pattern() -> str:
    """A regular expression for one spec (the DAG's param schema): the actions, then key=number pairs."""
    actions = "|".join(sorted(ACTIONS))
    return rf"^({actions}):[a-z_]+=[0-9.]+(,[a-z_]+=[0-9.]+)*$"
