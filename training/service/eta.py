"""When each run of the pool will finish: measured pace per host count, the scheduler's future, resize costs.

A run's pace is measured per host count from its own events (the median step
time of each round after its first step, which carries the compile); a host count
it has not run on is predicted from the nearest measured one, with a constant
global batch (step time inversely proportional to the hosts); a run that has not
run at all borrows the pace per host of the other runs. The future allocation
comes from replaying the scheduler's own policy until every run is done, and
each change of a run's hosts costs what its own recoveries cost (or the pool's
median); a run queued and given hosts again starts a job, and costs what its own
job starts cost, launch to first step (or the pool's median).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from training.service.policy import Demand, allocate

DEFAULT_RESIZE_S = 10.0  # a resize's cost before any run of the pool has measured one


def step_seconds_by_hosts(events: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """Median step seconds per host count, from a run's ``launch`` and ``progress`` events."""
    workers: dict[int, int] = {}
    samples: dict[int, list[float]] = {}
    first_seen: set[int] = set()
    for e in events:
        if e.get("type") == "launch" and e.get("round") is not None and e.get("workers"):
            workers[int(e["round"])] = int(e["workers"])
        elif e.get("type") == "progress" and e.get("step_time") and e.get("attempt") is not None:
            rnd = int(e["attempt"])
            if rnd not in first_seen:
                first_seen.add(rnd)  # a round's first step includes its compile and restore
                continue
            if rnd in workers:
                samples.setdefault(workers[rnd], []).append(float(e["step_time"]))
    return {n: statistics.median(v) for n, v in samples.items() if v}


def resize_seconds(events: Iterable[Mapping[str, Any]]) -> list[float]:
    """Seconds out of training of each of a run's recoveries and resizes (its ``recovered`` events)."""
    return [float(e["seconds"]) for e in events if e.get("type") == "recovered" and e.get("seconds") is not None]


def start_seconds(events: Iterable[Mapping[str, Any]]) -> list[float]:
    """Seconds from each of a run's job starts to its first step (a ``launch`` with reason ``start`` to the
    ``resumed`` of that round): what a run queued and given hosts again pays, a job of its own starting."""
    out = []
    started: dict[int, float] = {}  # round -> the time of its start's launch, until its first step
    for e in events:
        if e.get("type") == "launch" and e.get("reason") == "start" and e.get("round") is not None:
            started[int(e["round"])] = float(e["time"])
        elif e.get("type") == "resumed" and e.get("attempt") is not None and int(e["attempt"]) in started:
            out.append(float(e["time"]) - started.pop(int(e["attempt"])))
    return out


@dataclass
class RunOutlook:
    """One run as the forecast sees it."""

    demand: Demand
    steps_left: int
    hosts: int  # what it holds now
    step_s: dict[int, float] = field(default_factory=dict)  # measured: host count -> seconds per step
    resize_s: list[float] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)  # its job starts, launch to first step


@dataclass(frozen=True)
class Eta:
    """A run's forecast: seconds from now to its last step, and the assumptions behind it."""

    run: str
    seconds: float | None
    assumptions: tuple[str, ...]


def _pace(o: RunOutlook, hosts: int, per_host: float | None) -> tuple[float | None, str]:
    """Seconds per step on ``hosts`` hosts, and how it was obtained."""
    if hosts in o.step_s:
        return o.step_s[hosts], f"measured on {hosts} host(s)"
    if o.step_s:
        near = min(o.step_s, key=lambda n: (abs(n - hosts), -n))
        return o.step_s[near] * near / hosts, f"{hosts} host(s) predicted from {near} measured"
    if per_host is not None:
        return per_host / hosts, "not run yet: the pace per host of the pool's other runs"
    return None, "no pace measured in the pool yet"


def forecast(pool: int, runs: Sequence[RunOutlook], horizon_s: float = 30 * 24 * 3600.0) -> dict[str, Eta]:
    """Each run's seconds to finish, replaying the allocation policy through every run's end."""
    paces = [o.step_s[n] * n for o in runs for n in o.step_s]
    per_host = statistics.median(paces) if paces else None
    all_resizes = [s for o in runs for s in o.resize_s]
    pool_resize = statistics.median(all_resizes) if all_resizes else DEFAULT_RESIZE_S
    all_starts = [s for o in runs for s in o.start_s]
    pool_start = statistics.median(all_starts) if all_starts else pool_resize
    left = {o.demand.run: float(o.steps_left) for o in runs}
    hosts = {o.demand.run: o.hosts for o in runs}
    stall = {o.demand.run: 0.0 for o in runs}  # seconds still to pass before a resized run steps again
    notes: dict[str, list[str]] = {o.demand.run: [] for o in runs}
    done: dict[str, float] = {}
    by_run = {o.demand.run: o for o in runs}
    t = 0.0
    while len(done) < len(runs) and t < horizon_s:
        active = [by_run[r].demand for r in left if r not in done]
        alloc = allocate(pool, active)
        rate: dict[str, float] = {}
        for d in active:
            o, n = by_run[d.run], alloc[d.run]
            if n != hosts[d.run]:
                if n > 0 and hosts[d.run]:  # resized in its job: what its recoveries cost
                    stall[d.run] = statistics.median(o.resize_s) if o.resize_s else pool_resize
                elif n > 0:  # a job of its own starts: what its starts cost
                    stall[d.run] = statistics.median(o.start_s) if o.start_s else pool_start
                if n > 0:
                    what = "resized" if hosts[d.run] else ("resumes" if o.step_s else "starts")
                    notes[d.run].append(f"{what} on {n} host(s) at +{t:.0f}s, costing {stall[d.run]:.1f}s")
                else:
                    notes[d.run].append(f"queued at +{t:.0f}s")
                hosts[d.run] = n
            if n > 0:
                pace, how = _pace(o, n, per_host)
                if pace is None:
                    return {r: Eta(r, None, (how,)) for r in left}
                if how not in notes[d.run]:
                    notes[d.run].append(how)
                rate[d.run] = 1.0 / pace
        # The next event: a run finishes, or a stalled run resumes (its rate changes).
        ends = [stall[r] + left[r] / rate[r] for r in rate]
        resumes = [stall[r] for r in rate if stall[r] > 0]
        if not ends:
            break  # nothing can run: every remaining run's minimum exceeds the pool
        dt = min(ends + resumes)
        for r in rate:
            run_s = max(dt - stall[r], 0.0)
            stall[r] = max(stall[r] - dt, 0.0)
            left[r] -= run_s * rate[r]
            if left[r] <= 1e-6:
                done[r] = t + dt
        t += dt
    out = {}
    for o in runs:
        r = o.demand.run
        if r in done:
            out[r] = Eta(r, done[r], tuple(notes[r]))
        else:
            out[r] = Eta(r, None, (*notes[r], "never fits the pool as it is"))
    return out
