"""What the Training view reads of a run: each read a one-line error, and the page's data (curves, hosts, goodput)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from rtrain_airflow.runroots import Refused
from training.api import ALIVE_STATES as ALIVE
from training.api import Event, mesh_text

log = logging.getLogger(__name__)


class StorageError(RuntimeError):
    """A run that cannot be read (a 503); the message is one line."""


def one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def storage(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, with any failure to read the run turned into a StorageError naming ``what``."""
    from training.api import RunNotFound

    try:
        return fn()
    except (RunNotFound, Refused, StorageError):
        raise
    except Exception as e:  # noqa: BLE001 - a file system, GCS, credential or format error: one line, no trace
        log.warning("rtrain: cannot read %s", what, exc_info=True)
        raise StorageError(one_line(f"cannot read {what}: {type(e).__name__}: {e}")) from None


def finite(x: Any) -> Any:
    """JSON has no NaN or infinity: those become strings (as the ledger records them); the rest is unchanged."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x


def number(x: Any) -> float | None:
    """A finite number for a chart (NaN, infinities and strings such as "nan" are gaps)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def run_known(uri: str) -> bool:
    """Has the run at ``uri`` begun: written its root, or been submitted to its storage root's queue?"""
    from training import api
    from training.service import commands

    def submitted() -> bool:
        root, _, name = uri.rstrip("/").rpartition("/")
        try:
            commands.look(root, name)
        except commands.QueueError:
            return False
        return True

    return bool(storage("the run", lambda: api.run_exists(uri) or api.status(uri) is not None or submitted()))


# --- the page's data --------------------------------------------------------------------------------


def events_cursor(events: list[Event]) -> str | None:
    """What the page compares to know the events changed: the newest name, and how many (a late one adds one)."""
    return f"{events[-1]['_key']}#{len(events)}" if events and "_key" in events[-1] else None


NOTABLE = frozenset(
    {
        "launch",
        "failure",
        "resumed",
        "resize",
        "rollback",
        "validation",
        "finished",
        "failed",
        "stopped",
        "cancelled",
        "host_lost",
        "checkpoint_corrupt",
        "chaos",
        "leader",
        "restore",
        "waiting_for_capacity",
        "pods_waiting",
        "guard",
        "rescale_requested",
    }
)  # the event types the Training view's timeline shows


def chart_data(events: list[Event], ledger: dict[int, dict[str, Any]], status: dict[str, Any] | None) -> dict[str, Any]:
    """What the Training view draws, from the run's events, its ledger and its status.

    * ``loss``: aligned columns over ``step``: ``train`` (the newest loss logged at each step),
      ``discarded`` (losses of steps that were trained again after a restore or a rollback),
      ``validated`` and ``rejected`` (validation loss by verdict);
    * ``hosts``: aligned columns over ``time``: ``workers`` (hosts in the job, 0 once it ended),
      ``mesh`` (its name) and ``step`` (progress over time);
    * ``markers``: ``{kind, step, time, label}``, kind one of failure, recovery, resize, rollback, promotion;
    * ``rounds``, ``checkpoints`` (the ledger), ``timeline`` (notable events in words), ``latest``.
    """
    seen = _ChartEvents()
    for ev in events:
        seen.add(ev)
    st = finite(status) if status else None
    if st is not None and st.get("state") in ALIVE and isinstance(st.get("updated_at"), int | float):
        st["stale_s"] = round(time.time() - float(st["updated_at"]), 1)
    return {
        "status": st,
        "cursor": events_cursor(events),
        "loss": seen.loss_columns(),
        "hosts": seen.host_columns(),
        "markers": sorted([*seen.markers, *seen.recovery_markers()], key=lambda m: float(m["time"] or 0.0)),
        "rounds": seen.rounds,
        "checkpoints": _checkpoint_rows(ledger),
        "timeline": seen.timeline[-200:],
        "latest": seen.latest,
        "events": len(events),
    }


class _ChartEvents:
    """The Training view's series, built one event at a time (in the events' order)."""

    def __init__(self) -> None:
        self.last_step: int | None = None
        self.train: dict[int, float | None] = {}
        self.discarded: dict[int, float | None] = {}
        self.verdicts: dict[str, dict[int, float | None]] = {"validated": {}, "rejected": {}}  # a step may have both
        self.markers: list[dict[str, Any]] = []
        self.recovery_events: list[Event] = []  # what the recoveries are measured from (find_recoveries)
        self.host_points: list[tuple[float, int | None, str | None, int | None]] = []  # time, workers, mesh, step
        self.rounds: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.latest: dict[str, Any] = {}

    def at(self, ev: Event) -> int | None:
        """The event's step, or the newest step logged before it."""
        step = ev.get("step")
        return step if isinstance(step, int) and not isinstance(step, bool) else self.last_step

    def add(self, ev: Event) -> None:
        from training.api import describe

        kind, t = ev.get("type"), float(ev.get("time") or 0.0)
        handler = {
            "progress": self._progress,
            "validation": self._validation,
            "failure": self._failure,
            "resize": self._resize,
            "rollback": self._rollback,
            "launch": self._launch,
        }.get(str(kind))
        if kind in ("failure", "rollback", "restore", "init", "resumed"):
            self.recovery_events.append(ev)
        if handler is not None:
            handler(ev, t)
        elif kind in ("finished", "failed", "stopped"):
            self.host_points.append((t, 0, "-", None))
        if kind in NOTABLE:
            self.timeline.append({"time": t, "type": kind, "step": self.at(ev), "text": one_line(describe(ev), 240)})

    def _progress(self, ev: Event, t: float) -> None:
        if not isinstance(ev.get("step"), int):
            return
        step = int(ev["step"])
        if step in self.train:
            self.discarded[step] = self.train[step]
        self.train[step] = number(ev.get("loss"))
        self.last_step = step
        self.host_points.append((t, None, None, step))
        self.latest = {
            k: finite(ev.get(k)) for k in ("step", "loss", "tokens_per_s", "step_time", "grad_norm", "accuracy")
        }

    def _validation(self, ev: Event, t: float) -> None:
        if not isinstance(ev.get("step"), int):
            return
        verdict = str(ev.get("verdict"))
        if verdict == "promoted":
            self.markers.append(
                {"kind": "promotion", "step": ev["step"], "time": t, "label": f"step {ev['step']} promoted"}
            )
        elif verdict in ("validated", "rejected"):
            loss = (ev.get("metrics") or {}).get("loss") if isinstance(ev.get("metrics"), dict) else None
            self.verdicts[verdict][int(ev["step"])] = number(loss)

    def _failure(self, ev: Event, t: float) -> None:
        self.markers.append(
            {"kind": "failure", "step": self.at(ev), "time": t, "label": f"failure: {ev.get('reason')}"}
        )

    def recovery_markers(self) -> list[dict[str, Any]]:
        """A marker for each recovery, measured as ``rtrain report`` measures it (one function for both)."""
        from training.api import find_recoveries

        return [
            {
                "kind": "recovery",
                "step": r["resumed_step"],
                "time": r["resumed_at"],
                "recovery_s": r["recovery_s"],
                "label": f"training again at step {r['resumed_step']} after {r['recovery_s']:.1f}s "
                f"({one_line(str(r['cause']), 80)})",
            }
            for r in find_recoveries(self.recovery_events)
            if r["resumed_at"] is not None and r["recovery_s"] is not None
        ]

    def _resize(self, ev: Event, t: float) -> None:
        self.host_points.append((t, ev.get("new_workers"), mesh_text(ev.get("new_mesh")), None))
        self.markers.append(
            {
                "kind": "resize",
                "step": self.at(ev),
                "time": t,
                "label": f"{ev.get('old_workers')} -> {ev.get('new_workers')} hosts, mesh "
                f"{mesh_text(ev.get('old_mesh'))} -> {mesh_text(ev.get('new_mesh'))}",
            }
        )

    def _rollback(self, ev: Event, t: float) -> None:
        from_step = ev.get("from_step") if isinstance(ev.get("from_step"), int) else self.at(ev)
        self.markers.append(
            {
                "kind": "rollback",
                "step": from_step,
                "time": t,
                "label": f"rollback ({ev.get('kind') or 'manual'}): step {ev.get('from_step')} -> {ev.get('to_step')}",
            }
        )

    def _launch(self, ev: Event, t: float) -> None:
        n = ev.get("workers") if isinstance(ev.get("workers"), int) else None
        self.rounds.append(
            {
                "time": t,
                "round": ev.get("round", ev.get("attempt")),
                "workers": n,
                "mesh": mesh_text(ev.get("mesh")),
                "members": ev.get("members"),
            }
        )
        self.host_points.append((t, n, mesh_text(ev.get("mesh")), None))

    def loss_columns(self) -> dict[str, list[Any]]:
        steps = sorted(
            set(self.train) | set(self.discarded) | set(self.verdicts["validated"]) | set(self.verdicts["rejected"])
        )
        return {
            "step": steps,
            "train": [self.train.get(s) for s in steps],
            "discarded": [self.discarded.get(s) for s in steps],
            "validated": [self.verdicts["validated"].get(s) for s in steps],
            "rejected": [self.verdicts["rejected"].get(s) for s in steps],
        }

    def host_columns(self) -> dict[str, list[Any]]:
        """Hosts over time: the number of hosts holds until the next launch, resize or end (a stepped line)."""
        hosts: dict[str, list[Any]] = {"time": [], "workers": [], "mesh": [], "step": []}
        workers: int | None = None
        mesh: str | None = None
        for when, w, m, at_step in sorted(self.host_points, key=lambda p: p[0]):
            if at_step is None:
                workers, mesh = w, m
            hosts["time"].append(round(when, 3))
            hosts["workers"].append(workers)
            hosts["mesh"].append(mesh)
            hosts["step"].append(at_step)
        return hosts


def _checkpoint_rows(ledger: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The ledger, one row a step: its state, history, validation metrics and reason."""
    rows = []
    for step, rec in sorted(ledger.items()):
        metrics = rec.get("metrics") if isinstance(rec.get("metrics"), dict) else None
        rows.append(
            {
                "step": step,
                "state": rec.get("state"),
                "history": rec.get("history") or [],
                "loss": finite((metrics or {}).get("loss")) if metrics is not None else None,
                "accuracy": finite((metrics or {}).get("accuracy")) if metrics is not None else None,
                "reason": rec.get("reason") or "",
                "time": rec.get("time"),
            }
        )
    return rows
