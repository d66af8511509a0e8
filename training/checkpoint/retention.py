"""Retention rules: which committed checkpoints to keep.

Small typed policy objects that compose, named after Orbax's preservation
policies (``LatestN`` -> ``KeepLastN``, ``BestN`` -> ``KeepBestN``,
``EveryNSteps`` -> ``KeepEveryNSteps``, ``AnyPreservationPolicy`` -> ``AnyOf``).
We do not build on Orbax's classes because our rules need the ledger's states
(a rejected checkpoint is not "one of the last N" we would resume from, only a
validated one can be "best"), and because this module must stay importable
without jax (the Airflow side plans a prune without loading ML libraries).

A policy is a pure function of (steps with their states, metrics and times,
now) -> the set of steps it keeps.  Policies compose by union (``AnyOf`` or
``a | b``).  Whatever the policy says, the *protected* set computed by
``protected_steps`` is kept: the newest usable committed step, the newest
validated one, the resume pointer, promoted steps and pinned steps.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

# The ledger's states a job may resume from, and those that passed validation
# (training.ledger uses these too).
USABLE_STATES: frozenset[str] = frozenset({"committed", "validated", "promoted"})
VALIDATED_STATES: frozenset[str] = frozenset({"validated", "promoted"})


@dataclass(frozen=True)
class StepInfo:
    """One committed checkpoint as the policies see it.

    ``state`` is the ledger's current state ("committed" when the ledger has no
    record yet: Orbax committed it but the job died before writing the ledger);
    ``since`` is when it entered that state (seconds since the epoch), or None.
    """

    step: int
    state: str = "committed"
    metrics: Mapping[str, float | str] | None = None  # as the ledger keeps them: a non-finite one as text
    since: float | None = None


class Policy(abc.ABC):
    """A retention rule: ``keep(steps, now)`` is the set of steps it keeps."""

    @abc.abstractmethod
    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]: ...

    def explain(self, steps: Sequence[StepInfo], now: float) -> dict[int, list[str]]:
        """Each kept step with the rule(s) that keep it."""
        return {s: [str(self)] for s in sorted(self.keep(steps, now))}

    def __or__(self, other: Policy) -> AnyOf:
        return AnyOf(self, other)


def _usable(steps: Iterable[StepInfo]) -> list[StepInfo]:
    return [s for s in steps if s.state in USABLE_STATES]


@dataclass(frozen=True)
class KeepLastN(Policy):
    """The ``n`` newest usable steps (rejected, quarantined and pruned ones do not count)."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("KeepLastN: n must be >= 0")

    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        usable = sorted(s.step for s in _usable(steps))
        return set(usable[max(0, len(usable) - self.n) :])

    def __str__(self) -> str:
        return f"keep_last({self.n})"


@dataclass(frozen=True)
class KeepBestN(Policy):
    """The ``n`` validated steps with the best finite ``metric``; ties go to the newer step.

    Unlike Orbax's ``BestN``, steps without the metric are not kept by this
    rule (other rules, and the protected set, look after them).
    """

    n: int
    metric: str
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("KeepBestN: n must be >= 0")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBestN: mode is 'min' or 'max', not {self.mode!r}")

    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        sign = 1.0 if self.mode == "min" else -1.0
        scored = []
        for s in steps:
            value = (s.metrics or {}).get(self.metric)
            if s.state in VALIDATED_STATES and isinstance(value, int | float) and math.isfinite(value):
                scored.append((sign * float(value), -s.step))
        return {-neg_step for _v, neg_step in sorted(scored)[: self.n]}

    def __str__(self) -> str:
        return f"keep_best({self.n}, {self.metric}, {self.mode})"


@dataclass(frozen=True)
class KeepEveryNSteps(Policy):
    """Usable steps that are multiples of ``k``: a sparse history for later analysis."""

    k: int

    def __post_init__(self) -> None:
        if self.k <= 0:
            raise ValueError("KeepEveryNSteps: k must be > 0")

    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        return {s.step for s in _usable(steps) if s.step % self.k == 0}

    def __str__(self) -> str:
        return f"keep_every({self.k})"


@dataclass(frozen=True)
class ExpireQuarantined(Policy):
    """Keep quarantined steps for ``after_s`` seconds after they were quarantined, then let them go.

    A quarantined checkpoint is kept for someone to look at; once the time is
    up, no rule keeps it.  When the quarantine time is unknown it is kept.
    """

    after_s: float

    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        return {s.step for s in steps if s.state == "quarantined" and (s.since is None or now - s.since < self.after_s)}

    def __str__(self) -> str:
        return f"quarantine_ttl({self.after_s:g}s)"


@dataclass(frozen=True, init=False)
class AnyOf(Policy):
    """The union of its rules: a step is kept when any rule keeps it."""

    policies: tuple[Policy, ...] = field(default=())

    def __init__(self, *policies: Policy) -> None:
        flat: list[Policy] = []
        for p in policies:
            flat.extend(p.policies if isinstance(p, AnyOf) else (p,))
        object.__setattr__(self, "policies", tuple(flat))

    def keep(self, steps: Sequence[StepInfo], now: float) -> set[int]:
        return set().union(*(p.keep(steps, now) for p in self.policies))

    def explain(self, steps: Sequence[StepInfo], now: float) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for p in self.policies:
            for step, reasons in p.explain(steps, now).items():
                out.setdefault(step, []).extend(reasons)
        return dict(sorted(out.items()))

    def __str__(self) -> str:
        return " | ".join(str(p) for p in self.policies) or "keep_nothing"


def protected_steps(
    steps: Sequence[StepInfo], pointer: int | None = None, pinned: Iterable[int] = ()
) -> dict[int, list[str]]:
    """Steps no policy may delete, with why.

    * the newest usable committed step: what a restarting job resumes from;
    * the newest validated step: where a rollback goes;
    * the resume pointer: what the next launch will restore;
    * promoted steps: released models;
    * pinned steps: a running job is reading or writing them.

    Only steps that exist (are in ``steps``) are returned.
    """
    present = {s.step for s in steps}
    out: dict[int, list[str]] = {}

    def add(step: int | None, why: str) -> None:
        if step is not None and step in present:
            out.setdefault(step, []).append(why)

    add(max((s.step for s in _usable(steps)), default=None), "newest committed")
    add(max((s.step for s in steps if s.state in VALIDATED_STATES), default=None), "newest validated")
    add(pointer, "resume pointer")
    for s in steps:
        if s.state == "promoted":
            add(s.step, "promoted")
    for p in sorted(set(pinned)):
        add(p, "pinned")
    return dict(sorted(out.items()))


def decide(
    policy: Policy,
    steps: Sequence[StepInfo],
    now: float,
    pointer: int | None = None,
    pinned: Iterable[int] = (),
) -> tuple[dict[int, list[str]], list[int]]:
    """(kept step -> reasons, deleted steps ascending): the protected set wins over every policy."""
    kept = protected_steps(steps, pointer, pinned)
    for step, reasons in policy.explain(steps, now).items():
        kept.setdefault(step, []).extend(reasons)
    deleted = sorted({s.step for s in steps} - kept.keys())
    return dict(sorted(kept.items())), deleted
