"""The Airflow plugin of resilient-training.

What a plugin can usefully register for this project (hooks and operators are
plain imports from ``rtrain_airflow``, as in providers):

* ``macros``: ``{{ macros.rtrain_plugin.run_uri(params) }}`` and
  ``{{ macros.rtrain_plugin.run_status(params) }}`` in templates;
* ``fastapi_apps``: a small read-only JSON API mounted by the API server under
  ``/rtrain``: ``/rtrain/runs/{run_name}/status``, ``.../events?type=resize``,
  ``.../report``, on the project's run root (or ``?root=``);
* ``operator_extra_links``: a "Run status" button on the training sensor's task
  page, pointing at that API.

Importing this module imports nothing heavy (no JAX, no FastAPI until the API
server asks for the app).
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin
from rtrain_airflow.hooks.training import PROJECT_ROOT, RUN_NAME_PATTERN, absolute
from rtrain_airflow.sensors.training import RTrainRunStatusLink


def run_uri(params: dict[str, Any]) -> str:
    """The run root of a DAG run's params (``storage_root``/``run_name``)."""
    root = absolute(str(params.get("storage_root") or "var/runs"))
    return f"{root.rstrip('/')}/{params['run_name']}"


def run_status(params: dict[str, Any]) -> dict[str, Any] | None:
    from training.api import status

    return status(run_uri(params))


def create_app() -> Any:
    """The read-only run API (built when the API server loads plugins)."""
    import re

    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="resilient-training runs", description="Status, events and report of training runs")

    def uri(run_name: str, root: str | None) -> str:
        if not re.match(RUN_NAME_PATTERN, run_name):
            raise HTTPException(400, f"run_name must match {RUN_NAME_PATTERN}")
        base = absolute(root or "var/runs")
        if not base.startswith("gs://") and not base.startswith(str(PROJECT_ROOT)) and root is not None:
            raise HTTPException(400, "root: a gs:// URI or a path inside the project")
        return f"{base.rstrip('/')}/{run_name}"

    @app.get("/runs/{run_name}/status")
    def status(run_name: str, root: str | None = None) -> dict[str, Any]:
        from training.api import status as read_status

        st = read_status(uri(run_name, root))
        if st is None:
            raise HTTPException(404, f"no run {run_name}")
        return st

    @app.get("/runs/{run_name}/events")
    def events(run_name: str, root: str | None = None, type: str | None = None) -> list[dict[str, Any]]:
        from training.api import events as read_events

        return read_events(uri(run_name, root), (type,) if type else None)

    @app.get("/runs/{run_name}/report")
    def report(run_name: str, root: str | None = None) -> dict[str, Any]:
        from training.api import report as run_report

        return run_report(uri(run_name, root))

    return app


class _LazyApp:
    """An ASGI app built on first use, so loading the plugin outside the API server stays cheap."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:
            self._app = create_app()
        await self._app(scope, receive, send)


class RTrainPlugin(AirflowPlugin):
    name = "rtrain_plugin"
    macros = [run_uri, run_status]
    fastapi_apps = [{"app": _LazyApp(), "url_prefix": "/rtrain", "name": "rtrain runs"}]
    operator_extra_links = [RTrainRunStatusLink()]
