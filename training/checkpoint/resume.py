"""Where a (re)started job resumes from: the resume order, written down once, as a pure function.

The order: this run's newest committed checkpoint
that the ledger does not hold unusable (rejected, quarantined, pruned,
corrupt; a step whose unusable one was moved out is a later save of it);
else an explicit step; else scratch.  Orbax lists committed steps
only, so a save cut off mid-write is never a candidate, and a rollback moves
rejected and corrupt steps out of ``checkpoints/`` altogether.  When the
ledger's resume pointer names the chosen step, it also says *how* to resume
(skip a data window, scale the learning rate): a :class:`ResumeHint`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from training.checkpoint.retention import USABLE_STATES


class ResumeError(ValueError):
    """The run cannot resume as asked (the message says why and what to do)."""


class DataPosition(TypedDict, total=False):
    """The ``data`` item of every checkpoint: where in the global data stream the run is."""

    next_batch: int  # the next global batch to train on (== steps trained, plus skipped windows)
    examples_consumed: int
    global_batch: int
    seed: int
    dataset: str  # the dataset's fingerprint
    lr_scale: float
    skipped: list[list[int]]  # [start, end) batch windows skipped by rollbacks


def data_position(raw: Mapping[str, Any]) -> DataPosition:
    """A checkpoint's ``data`` item as read back (JSON), with its types; keys it lacks stay absent."""
    pos = DataPosition()
    for key in ("next_batch", "examples_consumed", "global_batch", "seed"):
        if raw.get(key) is not None:
            pos[key] = int(raw[key])
    if raw.get("dataset") is not None:
        pos["dataset"] = str(raw["dataset"])
    if raw.get("lr_scale") is not None:
        pos["lr_scale"] = float(raw["lr_scale"])
    if raw.get("skipped") is not None:
        pos["skipped"] = [[int(a), int(b)] for a, b in raw["skipped"]]
    return pos


@dataclass(frozen=True)
class ResumeHint:
    """How to resume from a step the resume pointer names (after a rollback)."""

    skip_to_batch: int | None = None
    lr_scale: float = 1.0

    @classmethod
    def from_pointer(cls, how: Mapping[str, Any] | None) -> ResumeHint | None:
        if not how:
            return None
        skip = how.get("skip_to_batch")
        return cls(None if skip is None else int(skip), float(how.get("lr_scale", 1.0)))


@dataclass(frozen=True)
class ResumeDecision:
    step: int | None  # None: start from scratch
    hint: ResumeHint | None
    reason: str


def choose_resume(
    resume: str,
    committed: Sequence[int],
    states: Mapping[int, Mapping[str, Any]],
    pointer: Mapping[str, Any] | None,
) -> ResumeDecision:
    """The step to resume from.

    :param resume: ``latest`` | ``none`` | a step number (the config's ``resume_from``).
    :param committed: the run's committed steps (Orbax's rule).
    :param states: the ledger's current record of each step it knows.
    :param pointer: the ledger's newest resume-pointer record, or None.
    """

    def usable(s: int) -> bool:
        rec = states.get(s, {})
        if str(rec.get("state", "committed")) in USABLE_STATES:
            return True
        # Judged unusable and moved out of checkpoints/ (quarantined, corrupt): a step there now is a later
        # save of that number, committed by Orbax's rule, whose commit its writer did not live to record.
        return bool(rec.get("location"))

    if resume == "none":
        return ResumeDecision(None, None, "resume_from=none: a new run")
    if resume == "latest":
        good = [s for s in committed if usable(s)]
        if committed and not good:
            raise ResumeError(
                f"every committed checkpoint ({', '.join(map(str, committed))}) is rejected or unusable; "
                "roll back to a validated step or start a new run_name"
            )
        if not good:
            return ResumeDecision(None, None, "no committed checkpoint: from scratch")
        step = max(good)
        reason = f"newest usable committed checkpoint {step}"
    elif resume.isdigit():
        step = int(resume)
        if step not in committed:
            raise ResumeError(f"resume_from={step}: not a committed checkpoint (committed: {list(committed)})")
        if not usable(step):
            raise ResumeError(f"resume_from={step}: that checkpoint is {states[step].get('state')}")
        reason = f"resume_from={step}"
    else:
        raise ResumeError(f"resume_from must be latest, none or a step, got {resume!r}")
    hint = None
    if pointer is not None and int(pointer.get("step", -1)) == step:
        hint = ResumeHint.from_pointer(pointer.get("resume"))
    return ResumeDecision(step, hint, reason)
