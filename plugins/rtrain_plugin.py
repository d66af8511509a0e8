"""The Airflow plugin of resilient-training.

What a plugin can usefully register for this project (hooks and operators are
plain imports from ``rtrain_airflow``, as in providers):

* ``macros``: ``{{ macros.rtrain_plugin.run_uri(params) }}`` and
  ``{{ macros.rtrain_plugin.run_status(params) }}`` in templates;
* ``fastapi_apps``: a small read-only app mounted by the API server under
  ``/rtrain``, behind Airflow's own login (the JWT of ``POST /auth/token`` as a
  bearer token, or the UI's session cookie): a JSON API and the *Training view*,
  a page with the run's loss curve, workers and mesh, goodput and checkpoints;
* ``external_views``: that page as a "Training" tab of every DAG run page;
* ``operator_extra_links``: a "Training view" button on the training sensor's task page.

Two ways to name a run, each with its own authorization:

* ``/rtrain/runs/{run_name}/...?root=ROOT``: a run root; the caller needs read access
  to the DAG runs of all DAGs.  ``root`` (default: the project's ``var/runs``) is
  resolved (symlinks, ``..``) and must lie inside the storage roots: the project's
  ``var/runs`` and those listed in ``RTRAIN_STORAGE_ROOTS`` (colon-separated; a
  ``gs://bucket/prefix`` is allowed only when listed there).
* ``/rtrain/dags/{dag_id}/runs/{run_id}/...``: the training run of a DAG run (what its
  ``resolve_config`` task resolved, else its conf's ``run_name``/``storage_root``); the
  caller needs read access to that DAG's runs.  The Training tab and the extra link use this.

The queue of a storage root's shared pool: ``GET /rtrain/queue?root=ROOT`` (JSON) and
``/rtrain/queue/view`` (the *Training queue* page, in the navigation), with read access to
every DAG's runs; ``POST /rtrain/queue/{run}/priority?priority=P`` and ``.../cancel``
change it, with edit access to every DAG's runs (a bad request is 400 with one line).

Routes under both: ``status``, ``events`` (``?type=``, ``?after=``, ``?limit=``), ``report``,
``checkpoints`` (the ledger), ``chart`` (the page's data) and ``view`` (the page).  An
unknown run is 404 everywhere; a storage error is 503 with a one-line reason.  Nothing
here writes to a run (the status is read without the stale-job repair the sensor does); the
queue's two POSTs write the service's submissions only.

Importing this module imports nothing heavy (no JAX, no FastAPI until the API server
asks for the app); ``report`` imports Orbax when called (``training.api.report``).
"""

# No `from __future__ import annotations`: FastAPI reads the annotations of the routes in create_app() at run
# time, and those name what create_app() imports.
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from airflow.plugins_manager import AirflowPlugin
from rtrain_airflow.hooks.training import PROJECT_ROOT, absolute
from rtrain_airflow.sensors.training import VIEW_PREFIX, RTrainRunStatusLink, base_path

from training.api import ALIVE_STATES as ALIVE
from training.api import RUN_NAME_PATTERN

log = logging.getLogger(__name__)

WWW = Path(__file__).resolve().parent / "rtrain_airflow" / "www"
STORAGE_ROOTS_ENV = "RTRAIN_STORAGE_ROOTS"
RESOLVE_TASK_ID = "resolve_config"  # the task whose result (the RunSpec) names a DAG run's training run
# The page's files: name -> (path under www/, media type).  Nothing else is served.
STATIC = {
    "view.js": ("view.js", "text/javascript"),
    "view.css": ("view.css", "text/css"),
    "uPlot.iife.min.js": ("vendor/uplot/uPlot.iife.min.js", "text/javascript"),
    "uPlot.min.css": ("vendor/uplot/uPlot.min.css", "text/css"),
}
# The page loads only its own files and talks only to this server.
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'self'; base-uri 'none'; form-action 'none'"
)


def run_uri(params: dict[str, Any]) -> str:
    """The run root of a DAG run's params (``storage_root``/``run_name``)."""
    root = absolute(str(params.get("storage_root") or "var/runs"))
    return f"{root.rstrip('/')}/{params['run_name']}"


def run_status(params: dict[str, Any]) -> dict[str, Any] | None:
    from training.api import status

    return status(run_uri(params))


# --- where runs may be read from ------------------------------------------------------------------


class Refused(ValueError):
    """A run or root that is not allowed (the message says why); a 403."""


def _split_roots(value: str) -> list[str]:
    """``RTRAIN_STORAGE_ROOTS``: colon-separated, where ``gs://`` keeps its own colon."""
    parts, out, i = value.split(":"), [], 0
    while i < len(parts):
        if parts[i].strip() == "gs" and i + 1 < len(parts) and parts[i + 1].startswith("//"):
            out.append("gs:" + parts[i + 1].strip())
            i += 2
            continue
        if parts[i].strip():
            out.append(parts[i].strip())
        i += 1
    return out


_GCS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


def _gcs(uri: str) -> str | None:
    """``gs://bucket/a/b`` without a trailing slash, or None when it is not a plain one (``..``, ``//``, ``.``)."""
    if not uri.startswith("gs://"):
        return None
    segments = uri[len("gs://") :].rstrip("/").split("/")
    if not _GCS_BUCKET.match(segments[0]) or any(s in ("", ".", "..") or "\\" in s for s in segments[1:]):
        return None
    return "gs://" + "/".join(segments)


def default_root() -> str:
    return os.path.realpath(PROJECT_ROOT / "var" / "runs")


def storage_roots() -> tuple[list[str], list[str]]:
    """(local roots, resolved; gs:// roots): the project's var/runs and ``RTRAIN_STORAGE_ROOTS``."""
    local, gcs = [default_root()], []
    for item in _split_roots(os.environ.get(STORAGE_ROOTS_ENV, "")):
        if item.startswith("gs://"):
            if norm := _gcs(item):
                gcs.append(norm)
            else:
                log.warning("%s: ignoring %r (not a plain gs://bucket/prefix)", STORAGE_ROOTS_ENV, item)
        else:
            local.append(os.path.realpath(absolute(item, PROJECT_ROOT)))
    return local, gcs


def run_root(run_name: str, root: str | None) -> str:
    """The run root of ``run_name`` under ``root`` (default: var/runs), if both are allowed; else Refused."""
    if not isinstance(run_name, str) or not re.match(RUN_NAME_PATTERN, run_name):
        raise Refused(f"run_name must match {RUN_NAME_PATTERN}")
    local, gcs = storage_roots()
    if root and root.startswith("gs://"):
        base = _gcs(root)
        if base is None:
            raise Refused("root: not a plain gs://bucket/prefix")
        if not any(base == r or base.startswith(r + "/") for r in gcs):
            raise Refused(f"root: {base} is not inside the storage roots (see {STORAGE_ROOTS_ENV})")
        return f"{base}/{run_name}"
    try:
        base = default_root() if not root else os.path.realpath(absolute(root, PROJECT_ROOT))
        resolved = os.path.realpath(os.path.join(base, run_name))  # the run directory itself may be a link
    except (ValueError, OSError) as e:  # a NUL byte, a symlink loop
        raise Refused(f"root: cannot be resolved ({type(e).__name__})") from None
    if not any(Path(resolved).is_relative_to(r) and resolved != r for r in local):
        raise Refused(f"root: the run is not inside the storage roots (see {STORAGE_ROOTS_ENV})")
    return resolved


def pool_root(root: str | None) -> str:
    """A storage root (default: var/runs) whose runs share a pool, if it is allowed; else Refused."""
    return run_root("queue", root).rsplit("/", 1)[0]


def root_query(uri: str) -> str:
    """``?root=...`` for a run root's URLs ('' for the default root)."""
    parent = uri.rstrip("/").rsplit("/", 1)[0]
    return "" if parent == default_root() else f"?root={quote(parent)}"


# --- reading a run ----------------------------------------------------------------------------------


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


def mesh_name(m: Any) -> str:
    if not isinstance(m, dict) or not m:
        return "-"
    return " x ".join(f"{k}{v}" for k, v in m.items() if v != 1 or k == "data") or "-"


def events_cursor(events: list[dict[str, Any]]) -> str | None:
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


def chart_data(
    events: list[dict[str, Any]], ledger: dict[int, dict[str, Any]], status: dict[str, Any] | None
) -> dict[str, Any]:
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
        "markers": seen.markers,
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
        self.pending: list[dict[str, Any]] = []  # failures not yet recovered from (as the sensor's trigger counts them)
        self.host_points: list[tuple[float, int | None, str | None, int | None]] = []  # time, workers, mesh, step
        self.rounds: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.latest: dict[str, Any] = {}

    def at(self, ev: dict[str, Any]) -> int | None:
        """The event's step, or the newest step logged before it."""
        step = ev.get("step")
        return step if isinstance(step, int) and not isinstance(step, bool) else self.last_step

    def add(self, ev: dict[str, Any]) -> None:
        from training.api import describe

        kind, t = ev.get("type"), float(ev.get("time") or 0.0)
        handler = {
            "progress": self._progress,
            "validation": self._validation,
            "failure": self._failure,
            "resumed": self._resumed,
            "resize": self._resize,
            "rollback": self._rollback,
            "launch": self._launch,
        }.get(str(kind))
        if handler is not None:
            handler(ev, t)
        elif kind in ("finished", "failed"):
            self.host_points.append((t, 0, "-", None))
        if kind in NOTABLE:
            self.timeline.append({"time": t, "type": kind, "step": self.at(ev), "text": one_line(describe(ev), 240)})

    def _progress(self, ev: dict[str, Any], t: float) -> None:
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

    def _validation(self, ev: dict[str, Any], t: float) -> None:
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

    def _failure(self, ev: dict[str, Any], t: float) -> None:
        self.pending.append(ev)
        self.markers.append(
            {"kind": "failure", "step": self.at(ev), "time": t, "label": f"failure: {ev.get('reason')}"}
        )

    def _resumed(self, ev: dict[str, Any], t: float) -> None:
        if not self.pending:
            return
        first = self.pending[0]
        self.pending.clear()  # one recovery may absorb several failures
        took = t - float(first.get("fault_at") or first.get("time") or t)
        self.markers.append(
            {
                "kind": "recovery",
                "step": self.at(ev),
                "time": t,
                "recovery_s": round(took, 3),
                "label": f"training again at step {ev.get('step')} after {took:.1f}s "
                f"({one_line(str(first.get('reason')), 80)})",
            }
        )

    def _resize(self, ev: dict[str, Any], t: float) -> None:
        self.host_points.append((t, ev.get("new_workers"), mesh_name(ev.get("new_mesh")), None))
        self.markers.append(
            {
                "kind": "resize",
                "step": self.at(ev),
                "time": t,
                "label": f"{ev.get('old_workers')} -> {ev.get('new_workers')} hosts, mesh "
                f"{mesh_name(ev.get('old_mesh'))} -> {mesh_name(ev.get('new_mesh'))}",
            }
        )

    def _rollback(self, ev: dict[str, Any], t: float) -> None:
        if ev.get("kind") == "in-job":
            self.pending.append(ev)
        from_step = ev.get("from_step") if isinstance(ev.get("from_step"), int) else self.at(ev)
        self.markers.append(
            {
                "kind": "rollback",
                "step": from_step,
                "time": t,
                "label": f"rollback ({ev.get('kind') or 'manual'}): step {ev.get('from_step')} -> {ev.get('to_step')}",
            }
        )

    def _launch(self, ev: dict[str, Any], t: float) -> None:
        n = ev.get("workers") if isinstance(ev.get("workers"), int) else None
        self.rounds.append(
            {
                "time": t,
                "round": ev.get("round", ev.get("attempt")),
                "workers": n,
                "mesh": mesh_name(ev.get("mesh")),
                "members": ev.get("members"),
            }
        )
        self.host_points.append((t, n, mesh_name(ev.get("mesh")), None))

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


def goodput_breakdown(report: dict[str, Any]) -> dict[str, Any] | None:
    """Where the run's wall time went, from ``training.api.report``: steps that count (goodput x wall),
    recoveries (failure to training again, summed) and the rest (start-up, compilation, checkpoints,
    validation, waiting for capacity, steps trained again)."""
    wall, goodput = number(report.get("wall_s")), number(report.get("goodput"))
    if not wall or goodput is None or report.get("state") in ALIVE:
        return None  # a live run's wall time is not known yet (the report's would end at an earlier job's end)
    productive = min(wall, goodput * wall)
    recovery = min(wall - productive, sum(number(r.get("recovery_s")) or 0.0 for r in report.get("recoveries") or []))
    other = max(0.0, wall - productive - recovery)
    return {
        "wall_s": wall,
        "productive_s": productive,
        "recovery_s": recovery,
        "other_s": other,
        "fractions": {"productive": productive / wall, "recovery": recovery / wall, "other": other / wall},
    }


# --- a DAG run's training run -----------------------------------------------------------------------


def _spec_run_uri(value: Any) -> str | None:
    """The ``run_uri`` of a stored RunSpec (plain JSON; nothing is deserialized into objects)."""
    import json

    if isinstance(value, bytes | str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, dict) and "__data__" in value and "__classname__" in value:
        value = value["__data__"]
    uri = value.get("run_uri") if isinstance(value, dict) else None
    return uri if isinstance(uri, str) and uri else None


@dataclass(frozen=True)
class Target:
    """What a DAG run says of its training run."""

    name: str  # '' when it does not say (yet)
    root: str | None
    resolved: bool  # from resolve_config's result (else from the conf)
    resolve_state: str | None  # the state of its resolve_config task; None: no such task (not a training DAG)
    has_resolve: bool


def dag_run_target(dag_id: str, run_id: str) -> Target | None:
    """The training run of a DAG run, or None when the DAG run does not exist.

    The ``resolve_config`` task's result when it ran; before that, the conf's ``run_name`` and
    ``storage_root`` (a DAG run triggered with the form's defaults has none: it waits for the result).
    The stored result is read as plain JSON: nothing is deserialized into objects.
    """
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.execute(
            select(DagRun.id, DagRun.conf).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
        ).first()
        if row is None:
            return None
        resolve = session.execute(
            select(TaskInstance.state).where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == RESOLVE_TASK_ID,
                TaskInstance.map_index == -1,
            )
        ).first()
        value = session.scalar(
            select(XComModel.value).where(
                XComModel.dag_id == dag_id,
                XComModel.run_id == run_id,
                XComModel.task_id == RESOLVE_TASK_ID,
                XComModel.key == "return_value",
                XComModel.map_index == -1,
            )
        )
    state = None if resolve is None or resolve[0] is None else str(getattr(resolve[0], "value", resolve[0]))
    uri = _spec_run_uri(value)
    if uri:
        name = uri.rstrip("/").rsplit("/", 1)[-1]
        return Target(name, uri.rstrip("/")[: -len(name) - 1] or None, True, state, resolve is not None)
    given = row[1] if isinstance(row[1], dict) else {}
    given_name, given_root = given.get("run_name"), given.get("storage_root")
    return Target(
        given_name if isinstance(given_name, str) else "",
        given_root if isinstance(given_root, str) and given_root else None,
        False,
        state,
        resolve is not None,
    )


# --- the app ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    name: str
    uri: str
    api: str  # the path of this run's routes, as the page calls them
    title: str  # what the page calls it


def queue_row(run: Run, events: Any = None) -> dict[str, Any] | None:
    """The run's row of its storage root's queue, with the ETA; None when it was not submitted there.

    ``events``: an ``EventReader`` kept across requests (each event is then read once).
    """
    from training.service import commands

    root = run.uri[: -len(run.name) - 1]
    try:
        commands.look(root, run.name)  # cheap: a run never submitted has no queue line (and no forecast to make)
    except commands.QueueError:
        return None
    try:
        row = commands.outlook(root, run.name, events)
    except Exception:  # noqa: BLE001 - the queue line is an extra: an unreadable queue leaves the view as it was
        log.warning("rtrain: cannot read the queue of %s", run.uri, exc_info=True)
        return None
    return None if row is None else row.to_dict()


def _allowed_on_every_dag(method: Literal["GET", "PUT"]) -> Callable[..., None]:
    """A dependency: the user may ``method`` (GET: read, PUT: edit) the DAG runs of every DAG.

    A run root or a pool is no one DAG's, so reading one takes read access to every DAG's runs.
    """
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
    from airflow.api_fastapi.core_api.security import GetUserDep
    from fastapi import HTTPException

    def check(user: GetUserDep) -> None:
        if not get_auth_manager().is_authorized_dag(
            method=method, access_entity=DagAccessEntity.RUN, details=DagDetails(id=None), user=user
        ):
            raise HTTPException(403, "Forbidden")

    return check


def _page(templates: Any, request: Any, name: str, status_code: int = 200, **context: Any) -> Any:
    """One of the plugin's HTML pages, with its content security policy and no caching."""
    from fastapi.responses import HTMLResponse

    html = templates.get_template(name).render(static=str(request.scope.get("root_path", "")) + "/static", **context)
    headers = {"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
    return HTMLResponse(html, status_code=status_code, headers=headers)


def _pending_error() -> type:
    """The 404 of a thing not there yet that will be (a DAG run's training run before it starts): the page waits."""
    from fastapi import HTTPException

    class Pending(HTTPException):
        """Not there yet, but it will be: the page looks again."""

    return Pending


def _locators(pending: type) -> tuple[Callable[..., Run], Callable[..., Run]]:
    """How a request names a run: by run name (and root), or by the DAG run that trains it."""
    from fastapi import HTTPException, Request

    def by_name(request: Request, run_name: str, root: str | None = None) -> Run:
        uri = run_root(run_name, root)
        if not run_known(uri):
            raise HTTPException(404, f"no run {run_name}")
        prefix = str(request.scope.get("root_path", ""))
        return Run(run_name, uri, f"{prefix}/runs/{quote(run_name, safe='')}", run_name)

    def by_dag_run(request: Request, dag_id: str, run_id: str) -> Run:
        target = storage("the DAG run", lambda: dag_run_target(dag_id, run_id))
        if target is None:
            raise HTTPException(404, f"no DAG run {run_id} of {dag_id}")
        if not target.has_resolve:
            raise HTTPException(404, f"DAG run {run_id} of {dag_id} trains nothing (it has no {RESOLVE_TASK_ID} task)")
        ended = target.resolve_state in ("failed", "upstream_failed", "skipped", "removed")
        if not target.resolved and ended:
            raise HTTPException(
                404, f"DAG run {run_id}: {RESOLVE_TASK_ID} {target.resolve_state}; it has no training run"
            )
        if not target.name:
            raise pending(404, f"DAG run {run_id} has not resolved its training run yet ({RESOLVE_TASK_ID})")
        uri = run_root(target.name, target.root)
        if not run_known(uri):
            raise pending(404, f"no run {target.name} yet (DAG run {run_id} has not started it)")
        prefix = str(request.scope.get("root_path", ""))
        return Run(
            target.name,
            uri,
            f"{prefix}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}",
            f"{target.name} (DAG run {run_id})",
        )

    return by_name, by_dag_run


def _run_routes(locate: Callable[..., Run], query: Callable[[Run], str], cache: Any, templates: Any) -> Any:
    """A run's JSON API (status, events, report, checkpoints, chart) and its Training view."""
    from fastapi import APIRouter, Depends, HTTPException, Query, Request
    from fastapi.responses import HTMLResponse, JSONResponse

    from training import api

    router = APIRouter()

    @router.get("/status")
    def status(run: Run = Depends(locate)) -> JSONResponse:
        st = storage("the run's status", lambda: api.status(run.uri))
        if st is None:
            raise HTTPException(404, f"run {run.name} has no status yet")
        return JSONResponse(finite(st))

    @router.get("/events")
    def events(
        run: Run = Depends(locate),
        type: list[str] | None = Query(None),
        after: str | None = None,
        limit: int | None = Query(None, ge=1, le=100_000),
    ) -> JSONResponse:
        types = tuple(t for item in type or [] for t in item.split(",") if t) or None
        evs = storage("the run's events", lambda: api.events(run.uri, types, after=after))
        return JSONResponse(finite(evs[-limit:] if limit else evs))

    @router.get("/report")
    def report(run: Run = Depends(locate)) -> JSONResponse:
        r = storage("the run's report", lambda: api.report(run.uri))
        return JSONResponse(finite({**r, "breakdown": goodput_breakdown(r)}))

    @router.get("/checkpoints")
    def checkpoints(run: Run = Depends(locate)) -> JSONResponse:
        states = storage("the run's checkpoint ledger", lambda: api.checkpoint_states(run.uri))
        return JSONResponse(finite({str(k): v for k, v in states.items()}))

    @router.get("/chart")
    def chart(run: Run = Depends(locate), since: str | None = None) -> JSONResponse:
        evs = storage("the run's events", lambda: cache.read(run.uri))
        cursor = events_cursor(evs)
        st = storage("the run's status", lambda: api.status(run.uri))
        queue = queue_row(run, cache)
        if since is not None and since == cursor:
            return JSONResponse(finite({"unchanged": True, "cursor": cursor, "status": st, "queue": queue}))
        ledger = storage("the run's checkpoint ledger", lambda: api.checkpoint_states(run.uri))
        return JSONResponse(finite({"run": run.name, **chart_data(evs, ledger, st), "queue": queue}))

    @router.get("/view", response_class=HTMLResponse)
    def view(request: Request, run: Run = Depends(locate)) -> HTMLResponse:
        return _page(templates, request, "view.html", run=run, query=query(run))

    return router


def _queue_routes(cache: Any, templates: Any) -> Any:
    """A shared pool's queue: read by viewers (JSON and the Training queue page), changed by editors."""
    from fastapi import APIRouter, Depends, HTTPException, Request
    from fastapi.responses import HTMLResponse, JSONResponse

    from training import api
    from training.service import commands

    router = APIRouter()
    read, edit = [Depends(_allowed_on_every_dag("GET"))], [Depends(_allowed_on_every_dag("PUT"))]

    def queue_of(root: str | None) -> Any:
        return storage("the queue", lambda: commands.view(pool_root(root), cache))

    @router.get("/queue", dependencies=read)
    def queue(root: str | None = None) -> JSONResponse:
        v = queue_of(root)
        return JSONResponse(finite({"root": v.root, "pool": v.pool, "runs": [r.to_dict() for r in v.rows]}))

    @router.get("/queue/view", response_class=HTMLResponse, dependencies=read)
    def queue_page(request: Request, root: str | None = None) -> HTMLResponse:
        return _page(templates, request, "queue.html", view=queue_of(root), eta=api.duration)

    def change(fn: Callable[[], Any]) -> JSONResponse:
        try:
            sub = fn()
        except (commands.PriorityError, commands.QueueError) as e:
            raise HTTPException(400, one_line(str(e))) from None
        except Refused:
            raise
        except Exception as e:  # noqa: BLE001 - a file system or GCS error: one line, no trace
            log.warning("rtrain: cannot change the queue", exc_info=True)
            raise StorageError(one_line(f"cannot change the queue: {type(e).__name__}: {e}")) from None
        return JSONResponse({"run": sub.run_name, "priority": sub.priority, "cancelled": sub.cancelled})

    @router.post("/queue/{run_name}/priority", dependencies=edit)
    def priority(run_name: str, priority: str, root: str | None = None) -> JSONResponse:
        return change(lambda: commands.set_priority(pool_root(root), run_name, priority))

    @router.post("/queue/{run_name}/cancel", dependencies=edit)
    def cancel(run_name: str, reason: str = "cancelled in Airflow", root: str | None = None) -> JSONResponse:
        return change(lambda: commands.cancel(pool_root(root), run_name, reason))

    return router


def _static_routes() -> Any:
    """The pages' scripts, styles and the vendored chart library (a fixed list of files)."""
    from fastapi import APIRouter, HTTPException
    from fastapi.responses import FileResponse

    router = APIRouter()

    @router.get("/static/{name}")
    def static(name: str) -> FileResponse:
        if name not in STATIC:
            raise HTTPException(404, "no such file")
        path, media = STATIC[name]
        return FileResponse(
            WWW / path,
            media_type=media,
            headers={"Cache-Control": "private, no-cache", "X-Content-Type-Options": "nosniff"},
        )

    return router


def _error_handlers(app: Any, templates: Any, pending: type) -> None:
    """Errors as one-line JSON, or as a page for the views (a page of a thing not there yet looks again)."""
    from fastapi import HTTPException, Request
    from fastapi.responses import JSONResponse

    from training import api

    def answer(request: Request, code: int, detail: str, wait: bool = False) -> Any:
        if request.url.path.endswith("/view"):
            return _page(templates, request, "error.html", status_code=code, code=code, detail=detail, wait=wait)
        return JSONResponse({"detail": detail}, status_code=code)

    app.add_exception_handler(StorageError, lambda request, exc: answer(request, 503, str(exc)))
    app.add_exception_handler(Refused, lambda request, exc: answer(request, 403, str(exc)))
    app.add_exception_handler(api.RunNotFound, lambda request, exc: answer(request, 404, one_line(str(exc))))

    def http(request: Request, exc: HTTPException) -> Any:
        if request.url.path.endswith("/view") and exc.status_code in (404, 503):
            return answer(request, exc.status_code, str(exc.detail), wait=isinstance(exc, pending))
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(HTTPException, http)


def create_app() -> Any:
    """The run API, the Training view and the queue (built when the API server loads plugins)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag, requires_authenticated
    from fastapi import Depends, FastAPI
    from fastapi.responses import JSONResponse
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    from training import api

    templates = Environment(loader=FileSystemLoader(WWW), autoescape=select_autoescape(default=True))
    cache = api.EventReader()  # every run's events, each read once across requests
    pending = _pending_error()
    by_name, by_dag_run = _locators(pending)
    app = FastAPI(
        title="resilient-training runs",
        description="Status, events, report, checkpoints and the Training view of training runs "
        "(Airflow's login: a bearer JWT from /auth/token, or the UI's session)",
        # Every route is behind Airflow's login, whatever a router adds; so is the schema (no docs pages: they
        # would be served without the dependencies, and load their scripts from a CDN).
        dependencies=[Depends(requires_authenticated())],
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    @app.get("/openapi.json", include_in_schema=False)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    app.include_router(
        _run_routes(by_name, lambda run: root_query(run.uri), cache, templates),
        prefix="/runs/{run_name}",
        dependencies=[Depends(_allowed_on_every_dag("GET"))],
    )
    # requires_access_dag reads {dag_id} from the path: access to that DAG's runs.
    app.include_router(
        _run_routes(by_dag_run, lambda run: "", cache, templates),
        prefix="/dags/{dag_id}/runs/{run_id}",
        dependencies=[Depends(requires_access_dag("GET", DagAccessEntity.RUN))],
    )
    app.include_router(_queue_routes(cache, templates))
    app.include_router(_static_routes())
    _error_handlers(app, templates, pending)
    return app


class _LazyApp:
    """An ASGI app built on first use, so loading the plugin outside the API server stays cheap."""

    def __init__(self) -> None:
        self._app: Any = None
        self._lock = threading.Lock()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:
            with self._lock:
                if self._app is None:
                    self._app = create_app()
        await self._app(scope, receive, send)


def _external_views() -> list[dict[str, Any]]:
    """The Training tab of a DAG run page (the UI fills in {DAG_ID} and {RUN_ID}), and the queue in the navigation."""
    return [
        {
            "name": "Training",
            "href": f"{base_path()}{VIEW_PREFIX}/dags/{{DAG_ID}}/runs/{{RUN_ID}}/view",
            "destination": "dag_run",
            "url_route": "rtrain-training",
        },
        {
            "name": "Training queue",
            "href": f"{base_path()}{VIEW_PREFIX}/queue/view",
            "destination": "nav",
            "url_route": "rtrain-queue",
        },
    ]


class RTrainPlugin(AirflowPlugin):
    name = "rtrain_plugin"
    macros = [run_uri, run_status]
    fastapi_apps = [{"app": _LazyApp(), "url_prefix": VIEW_PREFIX, "name": "rtrain runs"}]
    external_views = _external_views()
    operator_extra_links = [RTrainRunStatusLink()]
