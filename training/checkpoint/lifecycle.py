"""Checkpoint lifecycle: validate, roll back, promote, prune, and the run report.

Surviving a failure is half of resilience; the other half is never training on
from a bad state.  A checkpoint is *committed* when Orbax finalised it,
*validated* or *rejected* when ``validate`` has judged it on the held-out split,
*quarantined* when a rollback moved it out of the resume path (kept for
inspection under ``<run>/quarantine/``), *promoted* when a pipeline blessed it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

from training.checkpoint import lean
from training.checkpoint import prune as prune_lib
from training.checkpoint.goodput import Goodput, SaveCosts, goodput, save_costs
from training.checkpoint.ledger import Ledger
from training.checkpoint.lock import RunLock
from training.checkpoint.resume import DataPosition, data_position
from training.checkpoint.steps import INTEGRITY, committed_steps
from training.config import Config, config_from_json
from training.event_text import mesh_text
from training.events import ALIVE_STATES, Event, EventLog
from training.layout import CHECKPOINTS, CONFIG, QUARANTINE, STATUS, step_uri
from training.records import ResumeHow
from training.sections import CheckpointSection
from training.storage import NotFound, Store, join, open_store


class LifecycleError(RuntimeError):
    pass


class RunNotFound(LifecycleError):
    """There is no run at that URI (no config.json)."""


def _run(run_uri: str) -> tuple[Store, Config, Ledger, EventLog]:
    store = open_store(run_uri)
    try:
        cfg = config_from_json(store.get(CONFIG).decode())
    except NotFound:
        raise RunNotFound(f"no run at {run_uri} (it has no {CONFIG})") from None
    return store, cfg, Ledger(store), EventLog(store, source="lifecycle")


def quarantine(store: Store, ledger: Ledger, step: int, reason: str, state: str = "quarantined") -> str:
    """Move checkpoint ``step`` out of the resume path into ``quarantine/`` (kept for inspection).

    ``state`` is the ledger state recorded (``quarantined``; ``corrupt`` for a
    step that failed its integrity check).  Returns where it went.
    """
    dest = f"{QUARANTINE}{step}-{time.time_ns()}"
    store.move(f"{CHECKPOINTS}/{step}", dest)
    ledger.record(step, state, reason=reason, location=dest)
    return dest


def evaluate(cfg: Config, params: Any) -> dict[str, float]:
    """The task's metrics averaged over the fixed evaluation set (``perplexity`` added beside a ``loss``)."""
    # JAX, flax and grain: only when a validation runs (this module is imported by the Airflow side).
    import jax
    import numpy as np

    from training.data.pipeline import eval_set
    from training.tasks import load_task

    task = load_task(cfg)
    source = task.data().validation
    if source is None:
        raise LifecycleError(f"task {cfg.task!r} has no validation data to judge a checkpoint on")
    fields = list(task.example_spec())
    fn = jax.jit(task.evaluate)
    sums: dict[str, list[float]] = {}
    for b in eval_set(source, batch=cfg.checkpoint.val_batch, max_batches=cfg.checkpoint.val_batches):
        for k, v in fn(params, {f: b[f] for f in fields}).items():
            sums.setdefault(k, []).append(float(v))
    out = {k: float(np.mean(v)) for k, v in sums.items()}
    if "loss" not in out:
        raise LifecycleError(f"task {cfg.task!r}: its evaluate() returned no 'loss' (it returned {sorted(out)})")
    if cfg.prepared_tokens:  # a language model's loss is a cross-entropy in nats
        out["perplexity"] = float(math.exp(min(out["loss"], 80.0)))
    return out


class Verdict(TypedDict):
    """A validation's verdict on one checkpoint."""

    step: int
    verdict: str  # validated | rejected
    metrics: dict[str, float | str]  # a non-finite value as text (NaN is not JSON)
    reason: str  # why it was rejected ("" when validated)
    evaluated_on: str  # host | slice


class Rollback(TypedDict):
    """What a rollback did: the step it left, the step it went back to, what it quarantined."""

    from_step: int
    to_step: int
    quarantined: list[int]
    resume: ResumeHow


class Promotion(TypedDict):
    """A checkpoint blessed by a pipeline."""

    step: int
    state: str


class LaunchRow(TypedDict):
    """One launch of the run: its attempt, its hosts and its mesh."""

    attempt: int
    workers: int
    mesh: dict[str, int]


class RecoveryRow(TypedDict):
    """One recovery: a failure (or in-job rollback), those that came before training again, and the time it took."""

    cause: str | None  # the first failure's
    detect_s: float | None
    recovery_s: float | None  # from the first failure's fault to training again; None: not (yet) training again
    restored_step: int | None
    mesh_after: dict[str, int] | None
    failed_at: float  # the first failure's fault (else when it was seen)
    resumed_at: float | None
    resumed_step: int | None
    failures: int  # the failures this one recovery absorbed (a fault during a recovery is the same recovery)


def find_recoveries(evs: Iterable[Event]) -> list[RecoveryRow]:
    """The run's recoveries, by the events' times: each from the first failure (or in-job rollback) not yet
    recovered from to the next ``resumed``; the failures in between are part of the same recovery.

    The one measure of a recovery: ``rtrain report``, the demo's summary, the Training view and the Airflow
    task all take theirs from here.
    """
    rows: list[RecoveryRow] = []
    failed: list[Event] = []
    restore: Event | None = None
    for e in sorted(evs, key=lambda e: float(e.get("time") or 0.0)):
        kind = e["type"]
        if kind == "failure" or (kind == "rollback" and e.get("kind") == "in-job"):
            failed.append(e)
        elif failed and kind in ("restore", "init") and restore is None:
            restore = e
        elif failed and kind == "resumed":
            rows.append(_recovery(failed, restore, e))
            failed, restore = [], None
    if failed:
        rows.append(_recovery(failed, restore, None))
    return rows


def _recovery(failed: list[Event], restore: Event | None, resumed: Event | None) -> RecoveryRow:
    first = failed[0]
    start = float(first.get("fault_at") or first["time"])
    return {
        "cause": first.get("reason"),
        "detect_s": first.get("detect_s"),
        "recovery_s": round(float(resumed["time"]) - start, 3) if resumed is not None else None,
        "restored_step": restore.get("step") if restore is not None else None,
        "mesh_after": restore.get("mesh") if restore is not None else None,
        "failed_at": start,
        "resumed_at": float(resumed["time"]) if resumed is not None else None,
        "resumed_step": resumed.get("step") if resumed is not None else None,
        "failures": len(failed),
    }


ResizeRow = TypedDict("ResizeRow", {"from": int, "to": int, "old_mesh": dict[str, int], "new_mesh": dict[str, int]})
ResizeRow.__doc__ = "One resize of the job: hosts and meshes before and after."

RollbackRow = TypedDict("RollbackRow", {"from": int, "to": int, "kind": str | None, "reason": str})
RollbackRow.__doc__ = "One rollback: the step left, the step gone back to, in-job or by a pipeline, why."


class ValidationRow(TypedDict):
    """One verdict as the report lists it."""

    step: int
    verdict: str
    loss: float | str | None
    reason: str


class StopRow(TypedDict):
    """A person's stop of a job (``stopped``), or a cancel of the run before any job of it ran (``cancelled``)."""

    kind: str
    step: int | None
    reason: str


class RunReport(TypedDict):
    """The run's story (``rtrain report``): steps, failures, recoveries, meshes, verdicts, checkpoints, goodput."""

    run: str
    state: str | None
    steps: int | None
    steps_total: int
    final_loss: float | None
    launches: list[LaunchRow]
    failures: int
    recoveries: list[RecoveryRow]
    resizes: list[ResizeRow]
    validations: list[ValidationRow]
    rollbacks: list[RollbackRow]
    stops: list[StopRow]
    checkpoints_kept: list[int]
    checkpoints_pruned: list[int]
    resume_pointer: int | None
    saves: SaveCosts | None
    wall_s: float
    goodput: float | None
    goodput_breakdown: Goodput


def validate(run_uri: str, step: int | None = None, evaluated: list[Event] | None = None) -> Verdict:
    """Judge a committed checkpoint (default: the newest) and record the verdict in the ledger.

    ``evaluated``: the run's ``evaluated`` events, when the caller has read them already.
    """
    from training.checkpoint.manager import all_finite, load_params_host  # JAX: only for a validation

    store, cfg, ledger, events = _run(run_uri)
    steps = committed_steps(run_uri)
    if not steps:
        raise LifecycleError(f"run {run_uri} has no committed checkpoint to validate")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise LifecycleError(f"step {step} is not a committed checkpoint of {run_uri} (committed: {steps})")
    reasons: list[str] = []
    metrics = None
    if cfg.checkpoint.validate_on == "slice":
        evaluated = events.read(types=("evaluated",)) if evaluated is None else evaluated
        metrics = _evaluated_on_slice(cfg, ledger, evaluated, step)
    evaluated_on = "host" if metrics is None else "slice"
    if metrics is None:
        if cfg.checkpoint.validate_on == "slice":
            logging.getLogger("rtrain.lifecycle").warning(
                "the job recorded no evaluation of step %s on its mesh: evaluating it on this host", step
            )
        params = load_params_host(run_uri, step)  # the parameters only: no optimizer state
        if not all_finite(params):
            reasons.append("parameters are not all finite")
            metrics = {"loss": float("nan"), "perplexity": float("nan"), "accuracy": 0.0}
        else:
            metrics = evaluate(cfg, params)
    if not reasons and not math.isfinite(metrics["loss"]):
        reasons.append(f"validation loss is {metrics['loss']}")
    best = [s for s in ledger.best("loss", 1) if s != step]
    best_loss = (best[0], float(ledger.state(best[0])["metrics"]["loss"])) if best else None  # type: ignore[index]
    reasons += quality_reasons(metrics, best_loss, cfg.checkpoint)

    # NaN is not JSON: record non-finite numbers as strings.
    clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
    verdict = "rejected" if reasons else "validated"
    reason = "; ".join(reasons)
    if verdict == "validated":
        ledger.record(step, "validated", metrics=clean)
    else:
        ledger.record(step, "rejected", metrics=clean, reason=reason)
    events.emit("validation", step=step, verdict=verdict, metrics=clean, reason=reason, evaluated_on=evaluated_on)
    _validation_scalars(run_uri, step, metrics, verdict)
    return Verdict(step=step, verdict=verdict, metrics=clean, reason=reason, evaluated_on=evaluated_on)


def quality_reasons(metrics: Mapping[str, float], best: tuple[int, float] | None, ck: CheckpointSection) -> list[str]:
    """Why a checkpoint's finite validation metrics fall short of the checkpoint section's bars: worse than the best
    validated loss (``best``: its step and loss) by more than ``val_tolerance``, above ``val_max_loss``, below
    ``val_min_accuracy``; none when they pass."""
    reasons = []
    if best is not None and math.isfinite(metrics["loss"]) and metrics["loss"] > best[1] * (1 + ck.val_tolerance):
        reasons.append(
            f"loss {metrics['loss']:.4f} is worse than the best validated {best[1]:.4f} "
            f"(step {best[0]}) by more than {ck.val_tolerance:.0%}"
        )
    if ck.val_max_loss and metrics["loss"] > ck.val_max_loss:
        reasons.append(f"loss {metrics['loss']:.4f} > val_max_loss {ck.val_max_loss}")
    if ck.val_min_accuracy and metrics.get("accuracy", 0.0) < ck.val_min_accuracy:
        reasons.append(f"accuracy {metrics['accuracy']:.4f} < val_min_accuracy {ck.val_min_accuracy}")
    return reasons


def _evaluated_on_slice(cfg: Config, ledger: Ledger, evaluated: list[Event], step: int) -> dict[str, float] | None:
    """The metrics the job recorded for ``step`` evaluated on its own mesh (``validate_on: slice``), or None.

    Only the round that saved the committed step counts: a step trained again after a rollback is another state.
    """
    record = ledger.state(step)
    attempt = record.get("attempt") if record is not None else None
    found = [e for e in evaluated if e.get("step") == step and (attempt is None or e.get("attempt") == attempt)]
    if not found:
        return None
    metrics = {k: float(v) for k, v in found[-1]["metrics"].items()}  # "nan" and "inf" were written as text
    if cfg.prepared_tokens and "loss" in metrics:  # a language model's loss is a cross-entropy in nats
        metrics["perplexity"] = float(math.exp(min(metrics["loss"], 80.0)))
    return metrics


def _validation_scalars(run_uri: str, step: int, metrics: dict[str, float], verdict: str) -> None:
    """The verdict's metrics beside the training curves (TensorBoard run ``validation``); never fails a validation."""
    from training.scalars import ScalarLog

    values = {k: float(v) for k, v in metrics.items() if math.isfinite(v)}
    values["rejected"] = float(verdict == "rejected")
    try:
        log = ScalarLog(run_uri, "validate", subdir="validation")
        log.add(step, values)
        log.flush()
    except Exception as e:  # noqa: BLE001 - the verdict is in the ledger; the curve is a view of it
        logging.getLogger("rtrain.lifecycle").warning("validation scalars of step %s not written: %s", step, e)


def validate_pending(run_uri: str) -> list[Verdict]:
    """Validate every committed checkpoint the ledger has no verdict for, oldest first.

    With ``validate_on: slice``, a step the job did not evaluate (one saved at a preemption notice) is left
    unjudged unless it is the newest committed one: only that one is evaluated on this host.
    """
    _, cfg, ledger, events = _run(run_uri)
    states = ledger.states()
    committed = committed_steps(run_uri)
    todo = [s for s in committed if s not in states or states[s]["state"] == "committed"]
    if cfg.checkpoint.validate_on != "slice":
        return [validate(run_uri, s) for s in todo]
    evaluated = events.read(types=("evaluated",))  # once for every step
    todo = [s for s in todo if s == committed[-1] or _evaluated_on_slice(cfg, ledger, evaluated, s) is not None]
    return [validate(run_uri, s, evaluated) for s in todo]


def _data_position(run_uri: str, step: int) -> DataPosition:
    """The data position saved with a step: in a lean step's description, else Orbax's JSON item (``data/metadata``)."""
    if lean.is_lean(step_uri(run_uri, step)):
        return lean.saved_data_position(step_uri(run_uri, step))
    store = open_store(join(step_uri(run_uri, step), "data"))
    keys = store.list()
    for key in sorted(keys, key=lambda k: k != "metadata"):  # its name first; an older layout's file else
        if not key.startswith("_") and key != INTEGRITY:
            try:
                return data_position(json.loads(store.get(key)))
            except (ValueError, UnicodeDecodeError):
                continue
    return DataPosition()


def rollback(run_uri: str, to: int | None = None, reason: str = "manual rollback") -> Rollback:
    """Move the resume pointer back to a validated checkpoint and quarantine what is newer.

    The next launch resumes from ``to`` (default: the newest validated checkpoint),
    skipping the data window since it (``rollback_skip_data``) and scaling the
    learning rate (``rollback_lr_scale``) as configured.  Refused while a job holds the run.
    """
    store, cfg, ledger, events = _run(run_uri)
    holder = RunLock(store, owner="rollback").held_by()
    if holder:
        raise LifecycleError(f"run {run_uri} is held by {holder.get('owner')} (pid {holder.get('pid')}); stop it first")
    steps = committed_steps(run_uri)
    target = ledger.newest_validated() if to is None else to
    if target is None:
        raise LifecycleError(f"run {run_uri} has no validated checkpoint to roll back to")
    if target not in steps:
        raise LifecycleError(f"step {target} is not a committed checkpoint of {run_uri} (committed: {steps})")
    state = ledger.state(target)
    if state and state["state"] in ("rejected", "quarantined"):
        raise LifecycleError(f"step {target} is {state['state']}; roll back to a good checkpoint")
    from_step = steps[-1]
    how = ResumeHow(lr_scale=cfg.checkpoint.rollback_lr_scale)
    if cfg.checkpoint.rollback_skip_data and from_step > target:
        how["skip_to_batch"] = int(_data_position(run_uri, from_step).get("next_batch", 0))
    quarantined = []
    for s in steps:
        if s > target:
            quarantine(store, ledger, s, reason)
            quarantined.append(s)
    ledger.set_pointer(target, reason, resume=how)
    events.emit(
        "rollback",
        from_step=from_step,
        to_step=target,
        reason=reason,
        quarantined=quarantined,
        kind="validation",
        resume=how,
    )
    return Rollback(from_step=from_step, to_step=target, quarantined=quarantined, resume=how)


def promote(run_uri: str, step: int | None = None) -> Promotion:
    """Bless a validated checkpoint (default: the newest validated)."""
    _, _, ledger, events = _run(run_uri)
    step = ledger.newest_validated() if step is None else step
    st = ledger.state(step) if step is not None else None
    if step is None or not st or st["state"] not in ("validated", "promoted"):
        raise LifecycleError(f"step {step} is not validated; only validated checkpoints are promoted")
    ledger.record(step, "promoted")
    events.emit("validation", step=step, verdict="promoted", metrics=st.get("metrics"))
    return Promotion(step=step, state="promoted")


def prune(run_uri: str, dry_run: bool = False) -> prune_lib.Pruned:
    """Apply the run's retention policy to checkpoints/ and expire old quarantined ones."""
    store, cfg, ledger, events = _run(run_uri)
    policy = prune_lib.retention_policy(cfg.checkpoint)
    plan = prune_lib.prune(run_uri, policy, dry_run=dry_run, events=None if dry_run else events)
    out = plan.to_dict()
    now = time.time()
    expired = []
    for name in sorted({k.split("/")[1] for k in store.list(QUARANTINE)}):
        born = int(name.rsplit("-", 1)[1]) / 1e9 if "-" in name else now
        if now - born > cfg.checkpoint.quarantine_ttl_s:
            expired.append(name)
            if not dry_run:
                store.delete(f"{QUARANTINE}{name}")
    out["quarantine_expired"] = expired
    return out


def report(run_uri: str) -> RunReport:
    """The run's story from its events and ledger: steps, failures, recoveries, meshes, verdicts, goodput.

    Reads no checkpoint (no Orbax, no JAX): the ledger knows which steps are kept.
    """
    store, cfg, ledger, events = _run(run_uri)
    evs = events.read()
    status = json.loads(store.get(STATUS)) if store.exists(STATUS) else {}
    launches = [e for e in evs if e["type"] == "launch"]
    recoveries = find_recoveries(evs)
    pruned = sorted({s for e in evs if e["type"] == "prune" for s in e.get("deleted", [])})
    states = ledger.states()
    kept = sorted(s for s, r in states.items() if r["state"] not in ("pruned", "quarantined", "corrupt"))
    gp = goodput(
        evs,
        int(status.get("step") or cfg.optimizer.steps) if status.get("state") == "finished" else cfg.optimizer.steps,
    )
    loss = status.get("loss")
    return {
        "run": run_uri,
        "state": status.get("state"),
        "steps": status.get("step"),
        "steps_total": cfg.optimizer.steps,
        "final_loss": round(float(loss), 4) if isinstance(loss, int | float) else loss,
        "launches": [{"attempt": e["attempt"], "workers": e["workers"], "mesh": e["mesh"]} for e in launches],
        "failures": len([e for e in evs if e["type"] == "failure"]),
        "recoveries": recoveries,
        "resizes": [
            {"from": e["old_workers"], "to": e["new_workers"], "old_mesh": e["old_mesh"], "new_mesh": e["new_mesh"]}
            for e in evs
            if e["type"] == "resize"
        ],
        "validations": [
            {
                "step": e["step"],
                "verdict": e["verdict"],
                "loss": (e.get("metrics") or {}).get("loss"),
                "reason": e.get("reason", ""),
            }
            for e in evs
            if e["type"] == "validation"
        ],
        "rollbacks": [
            {"from": e["from_step"], "to": e["to_step"], "kind": e.get("kind"), "reason": e["reason"]}
            for e in evs
            if e["type"] == "rollback"
        ],
        "stops": [
            {"kind": e["type"], "step": e.get("step"), "reason": e["reason"]}
            for e in evs
            if e["type"] in ("stopped", "cancelled")
        ],
        "checkpoints_kept": kept,
        "checkpoints_pruned": pruned,
        "resume_pointer": ledger.pointer(),
        "saves": save_costs(evs),
        "wall_s": gp["wall_s"],
        "goodput": gp["goodput"],
        "goodput_breakdown": gp,
    }


class WallSplit(TypedDict):
    """Where a finished run's wall time went: steps that count, recoveries, and the rest."""

    wall_s: float
    productive_s: float  # goodput x wall
    recovery_s: float  # each failure to training again, summed
    other_s: float  # start-up, compilation, checkpoints, validation, waiting for capacity, steps trained again
    fractions: dict[str, float]  # the three as fractions of the wall time


def wall_split(r: Mapping[str, Any]) -> WallSplit | None:
    """The report's wall time in three parts; None for a live run (its wall time is not known yet)."""

    def seconds(x: Any) -> float | None:
        return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None

    wall, goodput = seconds(r.get("wall_s")), seconds(r.get("goodput"))
    if not wall or goodput is None or r.get("state") in ALIVE_STATES:
        return None
    productive = min(wall, goodput * wall)
    recovery = min(wall - productive, sum(seconds(x.get("recovery_s")) or 0.0 for x in r.get("recoveries") or []))
    other = max(0.0, wall - productive - recovery)
    return {
        "wall_s": wall,
        "productive_s": productive,
        "recovery_s": recovery,
        "other_s": other,
        "fractions": {"productive": productive / wall, "recovery": recovery / wall, "other": other / wall},
    }


def format_report(r: Mapping[str, Any]) -> str:
    """The run's story in lines, as ``rtrain report`` prints it (meshes by the axes that split something)."""
    mesh = mesh_text
    lines = [
        f"run            {r['run']}",
        f"state          {r['state']}  step {r['steps']}/{r['steps_total']}  final loss {r['final_loss']}",
        "launches       "
        + ", ".join(f"#{x['attempt']}: {x['workers']} workers ({mesh(x['mesh'])})" for x in r["launches"]),
        f"failures       {r['failures']}",
    ]
    for i, rec in enumerate(r["recoveries"], 1):
        det = f"{rec['detect_s']:.2f}s" if rec["detect_s"] is not None else "-"
        rs = f"{rec['recovery_s']:.1f}s" if rec["recovery_s"] is not None else "-"
        more = f" ({rec['failures']} failures, one recovery)" if (rec.get("failures") or 1) > 1 else ""
        lines.append(
            f"  recovery {i}   {rec['cause']}{more}: detected in {det}, training again after {rs}, "
            f"from step {rec['restored_step']} on {mesh(rec['mesh_after'])}"
        )
    for z in r["resizes"]:
        lines.append(f"  resize       {z['from']} -> {z['to']} workers: {mesh(z['old_mesh'])} -> {mesh(z['new_mesh'])}")
    for v in r["validations"]:
        loss = v["loss"] if isinstance(v["loss"], str) else (f"{v['loss']:.4f}" if v["loss"] is not None else "-")
        lines.append(f"  validation   step {v['step']}: {v['verdict']} (loss {loss}) {v['reason']}".rstrip())
    for b in r["rollbacks"]:
        lines.append(f"  rollback     {b['kind']}: step {b['from']} -> {b['to']} ({b['reason']})")
    for x in r.get("stops") or []:
        at = f" at step {x['step']}" if x["step"] is not None else ""
        lines.append(f"  {x['kind']:<12} {x['reason']}{at}")
    lines.append(
        f"checkpoints    kept {r['checkpoints_kept']}  pruned {r['checkpoints_pruned']}  "
        f"resume pointer {r['resume_pointer']}"
    )
    sv = r.get("saves")
    if sv and sv.get("paused_s") is not None:

        def ms(x: Any) -> str:
            return f"{x * 1000:.1f} ms" if isinstance(x, int | float) else "-"

        size = f"{sv['bytes'] / 1e6:.1f} MB" if sv.get("bytes") else "-"
        lines.append(
            f"saves          {sv['saves']} committed, median per save: training paused {ms(sv['paused_s'])} "
            f"(copying {size} at {sv.get('copy_GBps') or '-'} GB/s: {ms(sv.get('copy_bound_s'))} at least), "
            f"save thread {ms(sv.get('save_thread_s'))}, committed after {ms(sv.get('commit_s'))}"
        )
    if r["goodput"] is not None:
        lines.append(f"goodput        {r['goodput']:.1%} of {r['wall_s']:.0f}s wall time spent on steps that count")
        gp = r.get("goodput_breakdown") or {}
        thrown = (gp.get("badput_s") or {}).get("rollback_replay") or 0.0
        if thrown >= 0.05 and gp.get("engine_goodput") is not None:
            lines.append(
                f"  engine       {gp['engine_goodput']:.1%} without the {thrown:.1f}s of steps a validation rollback "
                "gave up on purpose"
            )
        bad = {k: v for k, v in (gp.get("badput_s") or {}).items() if v >= 0.05}
        if bad:
            parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}s" for k, v in sorted(bad.items(), key=lambda kv: -kv[1]))
            lines.append(f"  badput       {parts}; {gp.get('steps_lost', 0)} step(s) trained again")
        for kind, rec in sorted((gp.get("recoveries") or {}).items()):
            lines.append(
                f"  recoveries   {kind}: {int(rec['count'])}, {rec['seconds']:.1f}s out of training, "
                f"{int(rec['steps_lost'])} step(s) lost"
            )
    return "\n".join(lines)
