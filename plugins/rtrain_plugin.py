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

The app is ``rtrain_airflow.webapp`` (its routes and their authorization are described
there). Importing this module imports nothing heavy (no JAX, no FastAPI until the API
server asks for the app).
"""

from __future__ import annotations

import threading
from typing import Any

from airflow.plugins_manager import AirflowPlugin
from rtrain_airflow.hooks.training import absolute
from rtrain_airflow.sensors.training import VIEW_PREFIX, RTrainRunStatusLink, base_path

from training.api import RunStatus


def run_uri(params: dict[str, Any]) -> str:
    """The run root of a DAG run's params (``storage_root``/``run_name``)."""
    root = absolute(str(params.get("storage_root") or "var/runs"))
    return f"{root.rstrip('/')}/{params['run_name']}"


def run_status(params: dict[str, Any]) -> RunStatus | None:
    """The status of a DAG run's training run, as written."""
    from training.api import status

    return status(run_uri(params))


class _LazyApp:
    """An ASGI app built on first use, so loading the plugin outside the API server stays cheap."""

    def __init__(self) -> None:
        self._app: Any = None
        self._lock = threading.Lock()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:
            with self._lock:
                if self._app is None:
                    from rtrain_airflow.webapp import create_app

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
