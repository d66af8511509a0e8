"""Fault injection, from ``--chaos`` or the config's ``chaos`` list.

Grammar: ``ACTION:key=value,key=value``.  Each fault fires once per run (the
agent records fired faults as ``chaos`` events, so a resumed job that passes
the same step again does not fire it twice).

==================  ==========================================================
``preempt``         ``worker=W,step=S``: the host of worker W is lost when the
                    job reaches step S (SIGKILL, and capacity drops by one).
``crash``           ``worker=W,step=S``: worker W is SIGKILLed at step S; the
                    host stays (the process died, not the machine).
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

from dataclasses import dataclass, field

ACTIONS: dict[str, tuple[set[str], set[str]]] = {
    # action: (required keys, optional keys)
    "preempt": ({"worker", "step"}, set()),
    "crash": ({"worker", "step"}, set()),
    "kill_during_save": ({"worker", "step"}, set()),
    "capacity": ({"to"}, {"step", "after_s"}),
    "nan": ({"step"}, {"repeat"}),
    "lr_spike": ({"step", "factor"}, set()),
    "corrupt": ({"step"}, set()),
}
WORKER_SIDE = {"preempt", "crash", "kill_during_save", "nan", "lr_spike", "corrupt"}


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

    @property
    def key(self) -> str:
        """A stable id of this fault, recorded when it fires."""
        return self.spec


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
