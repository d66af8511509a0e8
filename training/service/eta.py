"""When each run of the pool will finish: measured pace per host count, the scheduler's future, resize costs.

A run's pace is measured per host count from its own events (wall seconds per
step between the progress reports of each round past its warm-up, saves
included); a host count it has not run on is predicted from the nearest measured
one, with a constant global batch (step time inversely proportional to the
hosts); a run that has not run at all borrows the pace per host of the other
runs. The future allocation comes from replaying the scheduler's own policy until
every run is done, and each change of a run's hosts costs what its own
recoveries cost (or the pool's median). A run that starts a job costs what its
job starts cost, from the launch to the first step (or the pool's median); one
launched that has not stepped yet owes the rest of that. A run queued in its job
and given hosts again costs what its returns of capacity cost (or the pool's,
or a start's round less its wait for the compile: its job was launched already,
and on a host count it has run on it loads the step it kept).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from training.service.policy import Demand, allocate

DEFAULT_RESIZE_S = 10.0  # a resize's cost before any run of the pool has measured one
WARMUP_STEPS = 10  # a round's first steps, slower than its pace: not counted in it (unless nothing else is)


def step_seconds_by_hosts(events: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """Wall seconds per step per host count, from a run's ``launch`` and ``progress`` events.

    The time between a round's progress reports over the steps between them: what the loop does
    besides the steps (saves, evaluations) counts, as it does for the finish.  The count starts at a
    round's first report at least :data:`WARMUP_STEPS` in (before, the compile, the restore and warming
    caches slow it); a host count with no round that long is counted from each round's first report.
    """
    workers: dict[int, int] = {}
    first: dict[int, int] = {}  # round -> the step of its first report
    last: dict[int, tuple[int, float]] = {}  # round -> (step, time) of its previous report
    steady: dict[int, tuple[float, int]] = {}  # host count -> (seconds, steps) past the warm-up
    whole: dict[int, tuple[float, int]] = {}  # host count -> (seconds, steps) from each first report
    for e in events:
        if e.get("type") == "config":  # a new job: its rounds are numbered afresh
            workers, first, last = {}, {}, {}
        elif e.get("type") == "launch" and e.get("round") is not None and e.get("workers"):
            workers[int(e["round"])] = int(e["workers"])
            first.pop(int(e["round"]), None)
            last.pop(int(e["round"]), None)
        elif e.get("type") == "progress" and e.get("attempt") is not None and e.get("step") is not None:
            rnd, step, t = int(e["attempt"]), int(e["step"]), float(e["time"])
            start = first.setdefault(rnd, step)
            prev, last[rnd] = last.get(rnd), (step, t)
            if prev is None or rnd not in workers or step <= prev[0]:
                continue
            n = workers[rnd]
            _add(whole, n, t - prev[1], step - prev[0])
            if prev[0] >= start + WARMUP_STEPS:
                _add(steady, n, t - prev[1], step - prev[0])
    return {n: seconds / steps for n, (seconds, steps) in {**whole, **steady}.items()}


def _add(tally: dict[int, tuple[float, int]], hosts: int, seconds: float, steps: int) -> None:
    total, count = tally.get(hosts, (0.0, 0))
    tally[hosts] = (total + seconds, count + steps)


def resize_seconds(events: Iterable[Mapping[str, Any]]) -> list[float]:
    """Seconds out of training of each of a run's recoveries and resizes (its ``recovered`` events)."""
    return [float(e["seconds"]) for e in events if e.get("type") == "recovered" and e.get("seconds") is not None]


@dataclass(frozen=True)
class JobStart:
    """One of a run's job starts: its processes starting and taking the run (from the job's ``config``,
    written as it is launched, to its first ``launch``), then that round's start (to its first step).

    ``compile_s``: the part of the round spent waiting for its step's compile once set up (the first
    ``compiled`` event's ``seconds``); a round of a size the job has run on loads the step it kept.
    """

    spawn_s: float
    round_s: float
    compile_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.spawn_s + self.round_s

    @property
    def kept_round_s(self) -> float:
        """The round's start with its step loaded as kept, not compiled."""
        return max(self.round_s - self.compile_s, 0.0)


def start_seconds(events: Iterable[Mapping[str, Any]]) -> list[JobStart]:
    """Each of a run's job starts, from its events: what a run that starts a job pays."""
    out = []
    begun: float | None = None  # the newest job's launch, until its first round
    launched: float | None = None  # that round's launch, until its first step
    compile_s: float | None = None  # that round's wait for its compile
    for e in events:
        kind = e.get("type")
        if kind == "config":
            begun, launched, compile_s = float(e["time"]), None, None
        elif kind == "launch" and begun is not None and launched is None:
            launched = float(e["time"])
        elif kind == "compiled" and launched is not None and compile_s is None and e.get("seconds") is not None:
            compile_s = float(e["seconds"])
        elif kind == "resumed" and begun is not None and launched is not None:
            out.append(JobStart(launched - begun, float(e["time"]) - launched, compile_s or 0.0))
            begun = launched = compile_s = None
    return out


def resume_seconds(events: Iterable[Mapping[str, Any]]) -> list[float]:
    """Seconds from each return of capacity to a job that waited for it (queued, its hosts gone) to its next
    first step: what a run queued in its job pays when it is given hosts again."""
    out = []
    waiting = False
    returned: float | None = None
    for e in events:
        kind = e.get("type")
        if kind == "waiting_for_capacity":
            waiting, returned = True, None
        elif kind == "capacity" and waiting and returned is None:
            returned = float(e["time"])
        elif kind == "resumed" and returned is not None:
            out.append(float(e["time"]) - returned)
            waiting, returned = False, None
        elif kind == "config":
            waiting, returned = False, None  # a new job: its start is a start
    return out


def starting_since(events: Iterable[Mapping[str, Any]]) -> float | None:
    """When the run's newest job was launched, while it has not taken its first step yet; else None."""
    begun: float | None = None
    for e in events:
        if e.get("type") == "config":
            begun = float(e["time"])
        elif e.get("type") == "resumed":
            begun = None
    return begun


@dataclass
class RunOutlook:
    """One run as the forecast sees it."""

    demand: Demand
    steps_left: int
    hosts: int  # what it holds now
    step_s: dict[int, float] = field(default_factory=dict)  # measured: host count -> seconds per step
    resize_s: list[float] = field(default_factory=list)
    start_s: list[JobStart] = field(default_factory=list)
    resume_s: list[float] = field(default_factory=list)  # its job given hosts again after a wait, to first step
    starting_for: float | None = None  # seconds its job has been starting (launched, no step yet); None: not


@dataclass(frozen=True)
class Eta:
    """A run's forecast: seconds from now to its last step, and the assumptions behind it."""

    run: str
    seconds: float | None
    assumptions: tuple[str, ...]


@dataclass(frozen=True)
class PoolCosts:
    """What a change of hosts costs a run: its own measurements, else the pool's medians."""

    resizes: list[float]
    starts: list[JobStart]
    resumes: list[float]

    @classmethod
    def of(cls, runs: Sequence[RunOutlook]) -> PoolCosts:
        return cls(
            [x for o in runs for x in o.resize_s],
            [x for o in runs for x in o.start_s],
            [x for o in runs for x in o.resume_s],
        )

    def resize(self, o: RunOutlook) -> float:
        """Resized in its job: what its recoveries cost."""
        seen = o.resize_s or self.resizes
        return statistics.median(seen) if seen else DEFAULT_RESIZE_S

    def start(self, o: RunOutlook) -> float:
        """A job of its own starts: what its starts cost (before any, what a resize costs)."""
        seen = o.start_s or self.starts
        return statistics.median(x.seconds for x in seen) if seen else self.resize(o)

    def resume(self, o: RunOutlook, hosts: int) -> float:
        """Queued in its job and given ``hosts`` again: what its returns of capacity cost; before any, what a
        start's round costs (its agents come back into the job, which has been launched already), less the
        wait for its compile where it has run on that many hosts (it loads the step it kept)."""
        if o.resume_s or self.resumes:
            return statistics.median(o.resume_s or self.resumes)
        seen = o.start_s or self.starts
        if not seen:
            return self.resize(o)
        return statistics.median(x.kept_round_s if hosts in o.step_s else x.round_s for x in seen)


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
    costs = PoolCosts.of(runs)
    left = {o.demand.run: float(o.steps_left) for o in runs}
    hosts = {o.demand.run: o.hosts for o in runs}
    stall = {o.demand.run: 0.0 for o in runs}  # seconds still to pass before a resized run steps again
    notes: dict[str, list[str]] = {o.demand.run: [] for o in runs}
    for o in runs:
        if o.hosts and o.starting_for is not None:  # launched, no step yet: the rest of its start
            stall[o.demand.run] = max(costs.start(o) - o.starting_for, 0.0)
            notes[o.demand.run].append(f"starting: its first step in {stall[o.demand.run]:.1f}s")
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
                    stall[d.run] = costs.resize(o)
                elif n > 0:  # queued in its job (it has run), or a job of its own starts
                    stall[d.run] = costs.resume(o, n) if o.step_s else costs.start(o)
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
