"""The plugin's web app: the run API, the Training view and the training queue, behind Airflow's login.

A run is named in one of two ways, each with its own authorization:

* ``/rtrain/runs/{run_name}/...?root=ROOT``: a run root (default the project's ``var/runs``), which
  must resolve inside the storage roots (``rtrain_airflow.runroots``); read access to every DAG's runs.
* ``/rtrain/dags/{dag_id}/runs/{run_id}/...``: the training run of a DAG run (its ``resolve_config``
  task's, else its conf's); read access to that DAG's runs.  The Training tab and extra link use it.

Under both: ``status``, ``events`` (``?type=``, ``?after=``, ``?limit=``), ``report``, ``checkpoints``,
``chart`` and ``view``; and ``POST .../stop?reason=`` (the view's Stop button), with edit access to the same
DAG runs: the run's job ends ``stopped`` (a run of a shared pool is cancelled: ``stopped`` once its job ran,
``cancelled`` before), resumable; a run with no live job is 409.  A storage root's queue: ``GET /rtrain/queue?root=ROOT`` and
``/rtrain/queue/view`` (a Cancel button per run not ended) with read access to every DAG's runs;
``POST /rtrain/queue/{run}/priority?priority=P`` and ``.../cancel`` (a queued run ends ``cancelled``, a running
one ``stopped``) with edit access to them (a bad request is 400).  An unknown run is 404, a storage
error 503, each with one line.  Nothing writes to a run (no stale-job repair); the POSTs write only
the service's submissions and a run's stop request (``stop.json``, as ``rtrain stop``).  FastAPI is imported when the app is built.
"""

# No `from __future__ import annotations`: FastAPI reads the annotations of the routes at run time, and
# those name what the route builders import.
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from rtrain_airflow.dagruns import RESOLVE_TASK_ID, dag_run_target
from rtrain_airflow.runroots import Refused, pool_root, root_query, run_root
from rtrain_airflow.runview import (
    StorageError,
    chart_data,
    events_cursor,
    finite,
    one_line,
    run_known,
    storage,
)

log = logging.getLogger(__name__)

WWW = Path(__file__).resolve().parent / "www"
# The page's files: name -> (path under www/, media type).  Nothing else is served.
STATIC = {
    "view.js": ("view.js", "text/javascript"),
    "view.css": ("view.css", "text/css"),
    "queue.js": ("queue.js", "text/javascript"),
    "uPlot.iife.min.js": ("vendor/uplot/uPlot.iife.min.js", "text/javascript"),
    "uPlot.min.css": ("vendor/uplot/uPlot.min.css", "text/css"),
}
# The page loads only its own files and talks only to this server.
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'self'; base-uri 'none'; form-action 'none'"
)


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


def stop_run(run: Run, reason: str) -> dict[str, str]:
    """Stop the run's job, as ``rtrain stop`` does (a run of a shared pool: cancel it, as ``rtrain cancel``).

    ``{"run", "asked", "state"}``; a run with no live job is a 409.
    """
    from fastapi import HTTPException

    from training import api
    from training.service import commands

    root = run.uri[: -len(run.name) - 1]

    def queued() -> Any:
        try:
            return commands.look(root, run.name)
        except commands.QueueError:
            return None

    row = storage("the queue", queued)
    if row is not None and row.state not in commands.ENDED and row.state != "cancelling":
        storage("the queue", lambda: commands.cancel(root, run.name, reason))
        return {"run": run.name, "asked": "cancel", "state": row.state}
    st = storage("the run's status", lambda: api.status(run.uri)) or {}
    state = str(st.get("state") or (row.state if row is not None else "never started"))
    if state not in api.ALIVE_STATES:
        raise HTTPException(409, f"run {run.name} has no job to stop ({state})")
    storage("the run's stop", lambda: api.stop_job(run.uri, reason))
    return {"run": run.name, "asked": "stop", "state": state}


def _run_routes(
    locate: Callable[..., Run], query: Callable[[Run], str], cache: Any, templates: Any, edit: Any = None
) -> Any:
    """A run's JSON API (status, events, report, checkpoints, chart), its Training view, and its Stop (``edit``)."""
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
        return JSONResponse(finite({**r, "breakdown": api.wall_split(r)}))

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

    @router.post("/stop", dependencies=[edit] if edit is not None else [])
    def stop(run: Run = Depends(locate), reason: str = "stopped in the Training view") -> JSONResponse:
        return JSONResponse(stop_run(run, reason))

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
        v = queue_of(root)
        prefix = str(request.scope.get("root_path", ""))
        return _page(
            templates,
            request,
            "queue.html",
            view=v,
            eta=api.duration,
            ended=commands.ENDED,
            api=f"{prefix}/queue",
            query=root_query(f"{v.root}/queue"),
        )

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
        _run_routes(by_name, lambda run: root_query(run.uri), cache, templates, Depends(_allowed_on_every_dag("PUT"))),
        prefix="/runs/{run_name}",
        dependencies=[Depends(_allowed_on_every_dag("GET"))],
    )
    # requires_access_dag reads {dag_id} from the path: access to that DAG's runs.
    app.include_router(
        _run_routes(
            by_dag_run, lambda run: "", cache, templates, Depends(requires_access_dag("PUT", DagAccessEntity.RUN))
        ),
        prefix="/dags/{dag_id}/runs/{run_id}",
        dependencies=[Depends(requires_access_dag("GET", DagAccessEntity.RUN))],
    )
    app.include_router(_queue_routes(cache, templates))
    app.include_router(_static_routes())
    _error_handlers(app, templates, pending)
    return app
