"""Where a run's wall time went, from its events alone: goodput, badput by cause, and what its saves cost."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any, TypedDict

from training.events import Event


class Goodput(TypedDict):
    """Where a run's wall time went: productive step time, and the badput by cause (``BADPUT_CAUSES``)."""

    wall_s: float
    productive_s: float
    step_s: float  # the median step time
    steps_lost: int  # steps trained again after restores
    badput_s: dict[str, float]  # by cause, and "other"
    recoveries: dict[str, dict[str, float]]  # each recovery's seconds by phase, by the failure it followed
    goodput: float | None
    engine_goodput: float | None  # leaving out the steps a validation rollback threw away on purpose


class SaveCosts(TypedDict):
    """What the persistent saves of a run cost (medians over its saves; None where no save reported it)."""

    saves: int
    bytes: float | None
    paused_s: float | None  # the loop's pause per save
    copy_bound_s: float | None  # the least time copying those bytes takes at the host's memory bandwidth
    copy_GBps: float | None
    save_thread_s: float | None  # Orbax's blocking part, in the save thread
    commit_s: float | None  # save to commit


def goodput(evs: list[Event], steps_total: int) -> Goodput:
    """Where the wall time went, in the spirit of Google's ML goodput: productive step time vs badput by cause.

    From the events alone (no checkpoint is read).  Wall time runs from each job's
    first round to its end (a run that was relaunched adds up its jobs).  A round's
    start-up is split into worker start, set-up, restore, compile and its first step;
    a failure into detection (fault to detection) and forming the next round; steps
    trained again after a restore (``replay``) and steps lost to a validation
    rollback count their step time; saves count the time they blocked the loop.
    """
    prog = [e for e in evs if e["type"] == "progress" and e.get("step_time")]
    step_s = statistics.median(e["step_time"] for e in prog) if prog else 0.0
    wall = _wall_time(evs)
    cat: dict[str, float] = dict.fromkeys(BADPUT_CAUSES, 0.0)
    rounds = [e for e in evs if e["type"] == "launch"]
    steps_lost = _round_badput(evs, rounds, step_s, cat)
    _event_badput(evs, rounds, step_s, cat)
    cat["replay"] = steps_lost * step_s
    productive = steps_total * step_s
    cat["other"] = max(wall - productive - sum(cat.values()), 0.0)
    # Steps a validation rollback gave up were thrown away on purpose (the model got worse), not lost to
    # the engine: the engine's own goodput leaves them out of the wall time.
    engine_wall = wall - cat["rollback_replay"]
    return {
        "wall_s": wall,
        "productive_s": productive,
        "step_s": step_s,
        "steps_lost": steps_lost,
        "badput_s": {k: round(v, 3) for k, v in cat.items()},
        "recoveries": _recoveries(evs),
        "goodput": productive / wall if wall > 0 and productive else None,
        "engine_goodput": productive / engine_wall if engine_wall > 0 and productive else None,
    }


BADPUT_CAUSES = (
    "detect",
    "form_round",
    "worker_start",
    "setup",
    "restore",
    "compile",
    "first_step",
    "replay",
    "rollback_replay",
    "checkpoint",
    "waiting_for_capacity",
)


def _wall_time(evs: list[Event]) -> float:
    """Each job's time from its first launch to its end (or its last event), added up."""
    jobs: dict[str, list[Event]] = {}
    for e in evs:
        jobs.setdefault(str(e.get("job") or _job_of(e, evs)), []).append(e)
    wall = 0.0
    for job_evs in jobs.values():
        launches = [e["time"] for e in job_evs if e["type"] == "launch"]
        ends = [e["time"] for e in job_evs if e["type"] in ("finished", "failed", "stopped")]
        if launches:
            wall += (max(ends) if ends else max(e["time"] for e in job_evs)) - min(launches)
    return wall


def _round_badput(evs: list[Event], rounds: list[Event], step_s: float, cat: dict[str, float]) -> int:
    """Add each round's start-up to ``cat``; the steps trained again by the round after (not a rollback's).

    A round's first step counts beyond a steady step (``step_s``): the step itself is productive.
    """
    steps_lost = 0
    for i, launch in enumerate(rounds):
        rnd = launch.get("round", launch.get("attempt"))
        mine = [e for e in evs if e.get("attempt") == rnd and e["time"] >= launch["time"]]
        started = next((e for e in mine if e["type"] == "worker_started" and e.get("process_id") == 0), None)
        restored = next((e for e in mine if e["type"] in ("restore", "init")), None)
        compiled = next((e for e in mine if e["type"] == "compiled"), None)
        resumed = next((e for e in mine if e["type"] == "resumed"), None)
        if started:
            cat["worker_start"] += started["time"] - launch["time"]
        if started and restored:
            cat["restore"] += float(restored.get("seconds") or 0)
            cat["setup"] += max(restored["time"] - float(restored.get("seconds") or 0) - started["time"], 0.0)
        if compiled:
            cat["compile"] += float(compiled.get("seconds") or 0)
        if compiled and resumed:
            cat["first_step"] += max(resumed["time"] - compiled["time"] - step_s, 0.0)
        # Steps this round trained that the next round trained again.
        if i + 1 < len(rounds):
            nxt = rounds[i + 1]
            done = [e["step"] for e in mine if e["type"] == "progress" and e["time"] < nxt["time"]]
            back = next((e for e in evs if e["type"] in ("restore",) and e["time"] > nxt["time"]), None)
            # Steps given up by a validation rollback are its own category (rollback_replay), not replay.
            rolled_back = any(
                e["type"] == "rollback" and e.get("kind") == "validation" and launch["time"] < e["time"] < nxt["time"]
                for e in evs
            )
            if done and back is not None and back["step"] < max(done) and not rolled_back:
                steps_lost += max(done) - int(back["step"])
    return steps_lost


def _event_badput(evs: list[Event], rounds: list[Event], step_s: float, cat: dict[str, float]) -> None:
    """Add what single events cost to ``cat``: failures, saves, validation rollbacks, waits for capacity."""
    for e in evs:
        if e["type"] == "failure":
            cat["detect"] += e.get("detect_s") or 0.0
            following = next((r for r in rounds if r["time"] > e["time"]), None)
            if following is not None:
                cat["form_round"] += following["time"] - e["time"]
        elif e["type"] == "checkpoint" and not e.get("committed") and e.get("blocking_s"):
            cat["checkpoint"] += float(e["blocking_s"])
        elif e["type"] == "progress" and e.get("local_save_blocking_s"):
            cat["checkpoint"] += e.get("local_save_blocking_s") or 0.0  # the local tier's saves
        elif e["type"] == "rollback" and e.get("kind") == "validation":
            cat["rollback_replay"] += max(int(e["from_step"]) - int(e["to_step"]), 0) * step_s
        elif e["type"] == "waiting_for_capacity":
            back = next(
                (r for r in evs if r["type"] in ("capacity", "launch", "failed", "stopped") and r["time"] > e["time"]),
                None,
            )
            if back is not None:
                cat["waiting_for_capacity"] += back["time"] - e["time"]


def _recoveries(evs: list[Event]) -> dict[str, dict[str, float]]:
    """What each kind of recovery cost, as the agents measured it (failure, notice, guard)."""
    recoveries: dict[str, dict[str, float]] = {}
    for e in evs:
        if e["type"] == "recovered":
            r = recoveries.setdefault(str(e.get("kind") or "failure"), {"count": 0, "seconds": 0.0, "steps_lost": 0})
            r["count"] += 1
            r["seconds"] = round(r["seconds"] + float(e.get("seconds") or 0.0), 3)
            r["steps_lost"] += int(e.get("steps_lost") or 0)
    return recoveries


def save_costs(evs: list[Event]) -> SaveCosts | None:
    """What the persistent saves cost, from their commit events (medians over the run's saves).

    ``paused_s``: the loop's pause per save; ``copy_bound_s``: the least time copying the bytes this
    process saves could take at the host's measured memory bandwidth (the pause's lower bound);
    ``save_thread_s``: Orbax's blocking part, run in the save thread; ``commit_s``: save to commit.
    """
    import statistics

    done: list[Mapping[str, Any]] = [
        e for e in evs if e["type"] == "checkpoint" and e.get("committed") and e.get("write_s") is not None
    ]
    if not done:
        return None

    def med(key: str) -> float | None:
        xs = [float(e[key]) for e in done if isinstance(e.get(key), int | float)]
        return round(statistics.median(xs), 6) if xs else None

    return {
        "saves": len(done),
        "bytes": med("bytes"),
        "paused_s": med("blocking_s"),
        "copy_bound_s": med("copy_bound_s"),
        "copy_GBps": med("copy_GBps"),
        "save_thread_s": med("save_s"),
        "commit_s": med("write_s"),
    }


def _job_of(e: Event, evs: list[Event]) -> str:
    """The job an event belongs to: the newest "config" event (each job's launch writes one) before it."""
    job = ""
    for c in evs:
        if c["time"] > e["time"]:
            break
        if c["type"] == "config":
            job = str(c.get("job") or "")
    return job
