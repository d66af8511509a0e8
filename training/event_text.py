"""One sentence per event type, for people (task logs, ``rtrain events``), and the readable forms it uses.

:func:`describe` gives any event its sentence; meshes, durations and values are written as people read them
(``data4 x fsdp2``, ``3m12s``), never as Python reprs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def mesh_text(m: Any) -> str:
    """A mesh by the axes that split something: ``data4 x fsdp2``."""
    if not isinstance(m, Mapping) or not m:
        return "-"
    return " x ".join(f"{k}{v}" for k, v in m.items() if v != 1 or k == "data") or "-"


def _num(x: Any, fmt: str = ".4f") -> str:
    return format(x, fmt) if isinstance(x, int | float) and not isinstance(x, bool) else str(x)


def duration(x: Any) -> str:
    """A duration people read: ``0.42s``, ``12.3s``, ``3m12s``, ``1h05m`` (``-`` for none)."""
    if x is None:
        return "-"
    if not isinstance(x, int | float) or isinstance(x, bool):
        return str(x)
    if x < 10:
        return f"{x:.2f}s"
    if x < 60:
        return f"{x:.1f}s"
    s = round(x)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _steps(x: Any) -> str:
    """A list of steps (``10, 20``) or ``none``."""
    if isinstance(x, list | tuple):
        return ", ".join(str(s) for s in x) if x else "none"
    return str(x)


def _plural(n: Any, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def readable(value: Any, sep: str = "; ") -> str:
    """Any value as text people read (no Python reprs).

    Mappings as ``key value`` pairs (underscores as spaces) joined by ``sep``, nested ones by ``", "``;
    lists joined by ``", "``; floats to 4 significant digits.
    """
    if isinstance(value, Mapping):
        return sep.join(f"{str(k).replace('_', ' ')} {readable(v, ', ')}" for k, v in value.items()) or "-"
    if isinstance(value, list | tuple):
        return ", ".join(readable(v, ", ") for v in value) or "none"
    if isinstance(value, float):
        return format(value, ".4g")
    return "-" if value is None else str(value)


def _launch(g: Any) -> str:
    rnd = g("round") if g("round") is not None else g("attempt")
    why = f" ({g('reason')})" if g("reason") else ""
    resume = str(g("resume") or "")
    start = {
        "": "",
        "none": ", from scratch",
        "latest": ", from the newest committed checkpoint (if any)",
    }.get(resume, f", from step {resume}")
    return f"round {rnd}{why}: {_plural(g('workers'), 'host')}, mesh {mesh_text(g('mesh'))}{start}"


def _worker_started(g: Any) -> str:
    on = f" on host {g('host')}" if g("host") else ""
    took = f" in {duration(g('seconds'))}" if g("seconds") is not None else ""
    return f"worker {g('process_id')} of round {g('attempt')} started{on}{took}"


def _restore(g: Any) -> str:
    hosts = f" ({_plural(g('workers'), 'host')})" if g("workers") is not None else ""
    ahead = "; its agent had checked the local copy" if g("checked_ahead") else ""
    return f"restored checkpoint {g('step')} onto mesh {mesh_text(g('mesh'))}{hosts} in {duration(g('seconds'))}{ahead}"


def _init(g: Any) -> str:
    took = f" in {duration(g('seconds'))}" if g("seconds") is not None else ""
    return f"initialised a new model on mesh {mesh_text(g('mesh'))}{took}"


def _compiled(g: Any) -> str:
    if g("compile_s") is None:  # compiled after the restore, not alongside it
        return f"compiled the train step in {duration(g('seconds'))}"
    return f"compiled the train step in {duration(g('compile_s'))}, {duration(g('seconds'))} of it after the restore"


def _resumed(g: Any) -> str:
    step = g("step")
    into = f", {duration(g('seconds'))} into the round" if g("seconds") is not None else ""
    if isinstance(step, int) and step <= 1:
        return f"training started: step {step} done{into}"
    return f"training resumed: step {step} done{into}"


def _resumed_with(g: Any) -> str:
    skipped = g("skipped") or []
    ranges = ", ".join(f"{r[0]}-{r[1]}" for r in skipped if isinstance(r, list | tuple) and len(r) == 2)
    return (
        f"resuming at step {g('step')} from batch {g('next_batch')} with learning-rate scale {_num(g('lr_scale'), 'g')}"
        + (f"; batches {ranges} skipped" if ranges else "")
    )


def _data_refreshed(g: Any) -> str:
    old, new = (str(g(k) or "-")[:12] for k in ("old", "new"))
    return f"dataset changed at step {g('step')} ({old} -> {new}): the data position restarts on the new data"


def _progress(g: Any) -> str:
    """``step 120/300 (40%), loss 2.3141, 5400 tok/s, ETA 3m12s, 4 workers, mesh data4 x fsdp2``.

    A progress event carries step, loss and tokens_per_s; ``steps_total``, ``eta_s``, ``workers`` and
    ``mesh`` are added by a watcher that knows them (the run's status, its launches).
    """
    step, total = g("step"), g("steps_total")
    parts = [f"step {step}"]
    if isinstance(step, int) and isinstance(total, int) and total > 0:
        parts[0] += f"/{total} ({min(step / total, 1.0):.0%})"
    if g("loss") is not None:
        parts.append(f"loss {_num(g('loss'))}")
    tps = g("tokens_per_s")
    if isinstance(tps, int | float):
        parts.append(f"{tps:.0f} tok/s")
    if isinstance(g("eta_s"), int | float):
        parts.append(f"ETA {duration(g('eta_s'))}")
    if g("workers") is not None:
        parts.append(_plural(g("workers"), "worker"))
    if g("mesh"):
        parts.append(f"mesh {mesh_text(g('mesh'))}")
    return ", ".join(parts)


def _checkpoint(g: Any) -> str:
    if g("committed"):
        took = f" ({duration(g('write_s'))} after the save began)" if g("write_s") is not None else ""
        return f"checkpoint {g('step')} committed{took}"
    blocked = f" (training paused {duration(g('blocking_s'))})" if g("blocking_s") is not None else ""
    return f"saving checkpoint {g('step')}{blocked}"


LOST_PHASES = ("detect", "relaunch", "restore", "compile", "first_step", "replay")


def _lost(g: Any) -> str:
    """``; 5 steps lost, 15.2s out of training (detect 1.20s, relaunch 3.00s, ...)`` when the event says so."""
    out = f"; {_plural(g('steps_lost'), 'step')} lost" if g("steps_lost") is not None else ""
    lost = g("lost_s") if isinstance(g("lost_s"), dict) else {}
    if lost:
        phases = [p for p in LOST_PHASES if p in lost] + sorted(set(lost) - set(LOST_PHASES))
        total = g("seconds") if isinstance(g("seconds"), int | float) else None
        if total is None:
            total = sum(v for v in lost.values() if isinstance(v, int | float))
        out += (
            f"{', ' if out else '; '}{duration(total)} out of training ("
            + ", ".join(f"{p.replace('_', ' ')} {duration(lost[p])}" for p in phases)
            + ")"
        )
    return out


def _failure(g: Any) -> str:
    det, by = g("detect_s"), g("detected_by")
    how = (f" in {duration(det)}" if isinstance(det, int | float) else "") + (f" by the {by}" if by else "")
    return f"failure: {g('reason')}" + (f" (detected{how})" if how else "") + _lost(g)


def _recovered(g: Any) -> str:
    """The engine's account of a recovery (the first step after a failure or a preemption notice)."""
    out = f"recovered from {g('cause') or 'a failure'}"
    if g("step") is not None:
        out += f": training again at step {g('step')}"
    if g("tier"):
        out += f" (from the {g('tier')} checkpoint" + (f" {g('resume_step')})" if g("resume_step") is not None else ")")
    return out + _lost(g)


def _chaos(g: Any) -> str:
    where = f" worker {g('worker')}" if g("worker") is not None else ""
    to = f" to {_plural(g('to'), 'host')}" if g("to") is not None else ""
    at = f" at step {g('step')}" if g("step") is not None else ""
    spec = f" ({g('spec')})" if g("spec") else ""
    return f"chaos: {g('action')}{where}{to}{at}{spec}"


def _finished(g: Any) -> str:
    extra = []
    if g("failures") is not None:
        extra.append(f"{_plural(g('failures'), 'failure')} absorbed")
    if isinstance(g("seconds"), int | float):
        extra.append(f"{duration(g('seconds'))} in all")
    return f"finished at step {g('step')}" + (f" ({', '.join(extra)})" if extra else "")


def _validation(g: Any) -> str:
    if g("verdict") == "promoted":
        return f"checkpoint {g('step')} promoted"
    m = g("metrics") or {}
    loss = m.get("loss") if isinstance(m, dict) else None
    out = f"validation of step {g('step')}: {g('verdict')}" + (f" (loss {_num(loss)})" if loss is not None else "")
    return out + (f": {g('reason')}" if g("reason") else "")


def _rollback(g: Any) -> str:
    quarantined = g("quarantined") or []
    return f"rollback ({g('kind') or 'manual'}): step {g('from_step')} -> {g('to_step')}: {g('reason')}" + (
        f"; quarantined {_steps(quarantined)}" if quarantined else ""
    )


def _prune(g: Any) -> str:
    freed = g("bytes_freed")
    return f"pruned steps {_steps(g('deleted'))}; kept {_steps(g('kept'))}" + (
        f" ({freed / 2**20:.1f} MiB freed)" if isinstance(freed, int | float) and freed else ""
    )


def _lock(g: Any) -> str:
    action = g("action")
    if action == "takeover":
        how = " (handed over)" if g("handoff") else ""
        return f"run lock taken over by {g('owner')} from {g('previous_owner')}{how}"
    verb = {"acquire": "taken", "release": "released", None: "held"}.get(action, str(action))
    return f"run lock {verb} by {g('owner')}"


def _config(g: Any) -> str:
    changed = g("changed") or []
    job = f" for job {g('job')}" if g("job") else ""
    return f"config written by {g('by')}{job}" + (f"; changed: {', '.join(map(str, changed))}" if changed else "")


def _preemption_notice(g: Any) -> str:
    who = f"host {g('host')}" if g("host") else "a host"
    after = f" {duration(g('seconds'))} after the notice" if isinstance(g("seconds"), int | float) else ""
    if g("committed"):
        return f"{who} got a preemption notice: stopped at step {g('step')} and committed it{after}"
    at = f" at step {g('step')}" if g("step") is not None else ""
    return f"{who} got a preemption notice{at}: no checkpoint committed" + (
        f" ({g('reason')})" if g("reason") else after
    )


# An event's sentence, made from its fields (given the event's ``get``).
Sentence = Callable[[Callable[[str], Any]], str]
# Every event type the engine writes (``EventType``), and the ones being added, with its sentence.
SENTENCES: dict[str, Sentence] = {
    "launch": _launch,
    "worker_started": _worker_started,
    "restore": _restore,
    "init": _init,
    "compiled": _compiled,
    "compiled_ahead": lambda g: (
        f"the train step for {_plural(g('workers'), 'host')} is in the compilation cache already"
        if g("already")
        else f"compiled the train step for {_plural(g('workers'), 'host')} ahead, in {duration(g('seconds'))}"
    ),
    "resumed": _resumed,
    "resumed_with": _resumed_with,
    "data_refreshed": _data_refreshed,
    "guard": lambda g: f"in-training guard at step {g('step')}: {g('reason')}",
    "progress": _progress,
    "checkpoint": _checkpoint,
    "checkpoint_corrupt": lambda g: f"checkpoint {g('step')} is corrupt ({g('reason')}); stepped over",
    "failure": _failure,
    "resize": lambda g: (
        f"resized {g('old_workers')} -> {g('new_workers')} hosts: mesh {mesh_text(g('old_mesh'))} -> {mesh_text(g('new_mesh'))}"
    ),
    "capacity": lambda g: (
        f"capacity is {_plural(g('available'), 'host')}" + (f" ({g('reason')})" if g("reason") else "")
    ),
    "waiting_for_capacity": lambda g: (
        f"waiting for capacity: {_plural(g('available'), 'host')} available, at least {g('min_workers')} needed"
    ),
    "pods_waiting": lambda g: f"pods waiting: {g('reason')}" if g("reason") else "no pod waits any more",
    "chaos": _chaos,
    "finished": _finished,
    "failed": lambda g: f"the job failed: {g('reason')}" + (f" (at step {g('step')})" if g("step") is not None else ""),
    "stopped": lambda g: (
        f"the job was stopped: {g('reason')}"
        + (f" (at step {g('step')})" if g("step") is not None else "")
        + "; resumable from the newest committed checkpoint"
    ),
    "cancelled": lambda g: f"the run was cancelled before it started: {g('reason')}",
    "rescale_requested": lambda g: (
        f"stopped at checkpoint {g('step')} to resize"
        + (f" (on {_plural(g('workers'), 'host')})" if g("workers") else "")
    ),
    "validation": _validation,
    "evaluated": lambda g: (
        f"evaluated step {g('step')} on the job's mesh in {duration(g('seconds'))}: "
        + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, int | float) else f"{k} {v}" for k, v in (g("metrics") or {}).items()
        )
    ),
    "rollback": _rollback,
    "prune": _prune,
    "lock": _lock,
    "leader": lambda g: f"host {g('host')} leads job {g('job')}" + (f" ({g('reason')})" if g("reason") else ""),
    "host_joined": lambda g: f"host {g('host')} joined",
    "host_lost": lambda g: f"host {g('host')} lost: {g('reason')}",
    "config": _config,
    "preemption_notice": _preemption_notice,
    "recovered": _recovered,
    "local_tier_off": lambda g: (
        "local checkpoint tier off" + (f" on host {g('host')}" if g("host") else "") + f": {g('reason')}"
    ),
    "local_checkpoint": lambda g: f"host {g('host')} saved local checkpoint {g('step')} in {duration(g('seconds'))}",
    "local_checkpoint_skipped": lambda g: f"host {g('host')} skipped local checkpoint {g('step')}: {g('reason')}",
}


def describe(ev: Mapping[str, Any]) -> str:
    """One readable sentence for any event (``rtrain events``, Airflow task logs)."""
    t = ev.get("type")
    sentence = SENTENCES.get(str(t))
    if sentence is not None:
        return str(sentence(ev.get))
    fields = {k: v for k, v in ev.items() if k not in ("type", "time", "source", "_key")}
    return f"{t}: " + (readable(fields) if fields else "")
