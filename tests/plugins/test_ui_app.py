"""The plugin's Training view and run API in this process (FastAPI's TestClient, Airflow's own auth manager):
what the routes refuse and serve, where runs may be read from, the page's data for a hand-written run,
and the sensor's link.  tests/dags/test_ui.py does the same against a real API server, with a browser."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import airflow_test_env
import fake_runs
import pytest

ROUTES = ("status", "events", "report", "checkpoints", "chart", "view")


@pytest.fixture(scope="module")
def token() -> str:
    """A JWT of Airflow's configured auth manager (simple), as ``POST /auth/token`` returns it."""
    airflow_test_env.migrate()  # token checks look up revoked tokens in the metadata DB
    from airflow.api_fastapi.app import create_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    manager = create_auth_manager()
    manager.init()
    return str(manager.generate_jwt(SimpleAuthManagerUser(username="ui-test", role="viewer")))


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project root of its own (its var/runs is the default storage root), and one extra root."""
    from rtrain_airflow import runroots

    monkeypatch.setattr(runroots, "PROJECT_ROOT", tmp_path / "project")
    (tmp_path / "project" / "var" / "runs").mkdir(parents=True)
    (tmp_path / "extra").mkdir()
    monkeypatch.setenv("RTRAIN_STORAGE_ROOTS", f"{tmp_path / 'extra'}:gs://rtrain-ui/runs:relative-root")
    return tmp_path / "project"


@pytest.fixture
def client(token: str, project: Path) -> Iterator[Any]:
    from fastapi.testclient import TestClient
    from rtrain_airflow import webapp

    with TestClient(webapp.create_app(), headers={"Authorization": f"Bearer {token}"}) as c:
        yield c


@pytest.fixture
def run(project: Path) -> str:
    return fake_runs.write_run(project / "var" / "runs", "ui-demo")


# --- Airflow's login ------------------------------------------------------------------------------------


def test_every_route_needs_airflows_login(token: str, project: Path, run: str) -> None:
    from fastapi.testclient import TestClient
    from rtrain_airflow import webapp

    paths = [f"/runs/ui-demo/{r}" for r in ROUTES] + [f"/dags/d/runs/r/{r}" for r in ROUTES] + ["/static/view.js"]
    with TestClient(webapp.create_app()) as anonymous:
        for path in paths:
            assert anonymous.get(path).status_code == 401, path
            assert anonymous.get(path, headers={"Authorization": "Bearer not-a-jwt"}).status_code == 403, path
            forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
            assert anonymous.get(path, headers={"Authorization": f"Bearer {forged}"}).status_code in (401, 403), path
        # The UI's session cookie is the same JWT.
        anonymous.cookies.set("_token", token)
        assert anonymous.get("/runs/ui-demo/status").status_code == 200
        assert anonymous.get("/runs/ui-demo/view").status_code == 200


def test_a_logged_in_user_gets_every_route(client: Any, run: str) -> None:
    for route in ROUTES:
        r = client.get(f"/runs/ui-demo/{route}")
        assert r.status_code == 200, (route, r.text)
    assert client.get("/runs/ui-demo/status").json()["state"] == "finished"
    assert [e["type"] for e in client.get("/runs/ui-demo/events", params={"type": "resize"}).json()] == ["resize"]
    both = client.get("/runs/ui-demo/events", params={"type": "failure,rollback"}).json()
    assert [e["type"] for e in both] == ["failure", "rollback"]
    after = client.get("/runs/ui-demo/events", params={"after": both[0]["_key"], "type": "failure"}).json()
    assert after == []
    assert len(client.get("/runs/ui-demo/events", params={"limit": 3}).json()) == 3
    assert client.get("/runs/ui-demo/checkpoints").json()["40"]["state"] == "promoted"
    report = client.get("/runs/ui-demo/report").json()
    assert report["failures"] == 1 and 0 < report["goodput"] < 1
    assert report["breakdown"]["recovery_s"] == pytest.approx(report["recoveries"][0]["recovery_s"])
    page = client.get("/runs/ui-demo/view")
    assert page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert 'data-api="/runs/ui-demo"' in page.text and 'data-query=""' in page.text
    assert client.get("/static/uPlot.iife.min.js").status_code == 200
    assert client.get("/static/..%2Frtrain_plugin.py").status_code == 404
    assert client.get("/static/view.html").status_code == 404


def test_unknown_runs_are_404_on_every_route(client: Any) -> None:
    for route in ROUTES:
        r = client.get(f"/runs/no-such-run/{route}")
        assert r.status_code == 404, route
        assert "no-such-run" in r.text
    assert "No training run here" in client.get("/runs/no-such-run/view").text


# --- where runs may be read from ------------------------------------------------------------------------


def test_roots_are_resolved_and_must_lie_inside_the_storage_roots(
    client: Any, project: Path, run: str, tmp_path: Path
) -> None:
    runs = project / "var" / "runs"
    outside = tmp_path / "outside"
    fake_runs.write_run(outside, "secret")
    evil = project / "var" / "runs-evil"
    fake_runs.write_run(evil, "ui-demo")
    fake_runs.write_run(tmp_path / "extra", "elsewhere")
    (runs / "escape").symlink_to(outside / "secret")
    (runs / "out").symlink_to(outside)

    def code(name: str, root: str | None = None) -> int:
        return int(client.get(f"/runs/{name}/status", params={"root": root} if root is not None else None).status_code)

    refused = {
        "a run that is a symlink out": code("escape"),
        "a root that is a symlink out": code("secret", str(runs / "out")),
        "..": code("secret", f"{runs}/../../../outside"),
        "relative ..": code("secret", "../outside"),
        "an absolute path outside": code("secret", str(outside)),
        "a sibling prefix": code("ui-demo", str(evil)),
        "the project itself": code("runs", str(project / "var")),
        "/": code("etc", "/"),
        "a NUL byte": code("ui-demo", f"{runs}\x00"),
        "an unlisted bucket": code("ui-demo", "gs://other-bucket/runs"),
        "a listed bucket's parent": code("ui-demo", "gs://rtrain-ui"),
        "a bucket path with ..": code("ui-demo", "gs://rtrain-ui/runs/../x"),
        "a bucket path with //": code("ui-demo", "gs://rtrain-ui/runs//x"),
    }
    assert {k: v for k, v in refused.items() if v != 403} == {}
    for bad in ("..", "a..b", ".hidden", "-x"):
        assert code(bad) in (403, 404), bad
    assert (
        client.get("/runs/escape/status").json()["detail"].startswith("root: the run is not inside the storage roots")
    )
    # Allowed: the default root however it is spelled, and a listed root.
    assert code("ui-demo", str(runs)) == 200
    assert code("ui-demo", f"{runs}/../runs") == 200
    assert code("ui-demo", "var/runs") == 200  # relative to the project
    assert code("elsewhere", str(tmp_path / "extra")) == 200
    assert code("nothing-here", str(tmp_path / "extra")) == 404


def test_storage_roots_env_keeps_gs_colons(project: Path, tmp_path: Path) -> None:
    from rtrain_airflow import runroots

    assert runroots._split_roots("/a:gs://b/c::relative:gs://d") == ["/a", "gs://b/c", "relative", "gs://d"]
    local, gcs = runroots.storage_roots()
    assert local == [
        os.path.realpath(project / "var" / "runs"),
        str(tmp_path / "extra"),
        str(project / "relative-root"),
    ]
    assert gcs == ["gs://rtrain-ui/runs"]
    assert runroots.run_root("r", "gs://rtrain-ui/runs/team-a/") == "gs://rtrain-ui/runs/team-a/r"
    with pytest.raises(runroots.Refused):
        runroots.run_root("r", "gs://rtrain-ui/runs-evil")


# --- storage errors and values JSON has no word for ------------------------------------------------------


def test_a_storage_error_is_503_with_one_line(client: Any, project: Path) -> None:
    uri = fake_runs.write_run(project / "var" / "runs", "broken")
    os.remove(f"{uri}/status.json")
    os.mkdir(f"{uri}/status.json")  # reading it fails (IsADirectoryError), as an unreadable file would
    for route in ("status", "chart"):
        r = client.get(f"/runs/broken/{route}")
        assert r.status_code == 503, (route, r.text)
        detail = r.json()["detail"]
        assert "\n" not in detail and "Traceback" not in detail and len(detail) <= 300
        assert "IsADirectoryError" in detail
    shutil.rmtree(f"{uri}/status.json")
    (Path(uri) / "events" / "00000000000000000001-x-y.json").write_text("{not json")
    r = client.get("/runs/broken/events")
    assert r.status_code == 503 and "JSONDecodeError" in r.json()["detail"]


def test_nan_and_infinity_are_served_as_strings(client: Any, project: Path) -> None:
    from training.events import EventLog, write_status
    from training.storage import open_store

    uri = fake_runs.write_run(project / "var" / "runs", "diverged")
    store = open_store(uri)
    EventLog(store).emit("progress", step=41, loss=float("nan"), grad_norm=float("inf"))
    write_status(store, state="failed", step=41, loss=float("nan"), reason="loss is nan")
    assert client.get("/runs/diverged/status").json()["loss"] == "nan"
    assert client.get("/runs/diverged/events", params={"type": "progress"}).json()[-1]["grad_norm"] == "inf"
    chart = client.get("/runs/diverged/chart").json()
    assert chart["loss"]["step"][-1] == 41 and chart["loss"]["train"][-1] is None  # a gap in the curve


# --- the page's data ---------------------------------------------------------------------------------------


def test_chart_data_of_a_finished_run(client: Any, run: str) -> None:
    chart = client.get("/runs/ui-demo/chart").json()
    assert chart["run"] == "ui-demo" and chart["status"]["state"] == "finished"
    loss = chart["loss"]
    assert loss["step"] == list(range(1, 41))
    assert all(isinstance(x, float) for x in loss["train"])
    # Steps trained twice: 11-15 after the restore from 10, 21-30 after the rollback to 20.
    assert [s for s, d in zip(loss["step"], loss["discarded"], strict=True) if d is not None] == [
        *range(11, 16),
        *range(21, 31),
    ]
    validated = [s for s, v in zip(loss["step"], loss["validated"], strict=True) if v is not None]
    rejected = [s for s, v in zip(loss["step"], loss["rejected"], strict=True) if v is not None]
    assert validated == [10, 20, 30, 40] and rejected == [30]
    markers = {(m["kind"], m["step"]) for m in chart["markers"]}
    assert markers == {("failure", 15), ("resize", 15), ("recovery", 11), ("rollback", 30), ("promotion", 40)}
    recovery = next(m for m in chart["markers"] if m["kind"] == "recovery")
    assert recovery["recovery_s"] > 0 and "host h1 lost" in recovery["label"]
    hosts = chart["hosts"]
    assert len(hosts["time"]) == len(hosts["workers"]) == len(hosts["mesh"]) == len(hosts["step"])
    assert hosts["time"] == sorted(hosts["time"])
    changes = [w for i, w in enumerate(hosts["workers"]) if i == 0 or w != hosts["workers"][i - 1]]
    assert changes == [4, 3, 0, 4, 0]  # launch, resize, job 1 ends, job 2, job 2 ends
    assert [r["workers"] for r in chart["rounds"]] == [4, 3, 4] and chart["rounds"][1]["mesh"] == "data3"
    assert [(c["step"], c["state"]) for c in chart["checkpoints"]] == [
        (10, "validated"),
        (20, "validated"),
        (30, "validated"),
        (40, "promoted"),
    ]
    assert chart["checkpoints"][2]["history"] == ["committed", "rejected", "quarantined", "committed", "validated"]
    assert any("rollback" in t["text"] for t in chart["timeline"])
    # Nothing new: the next look says so (the page then redraws nothing).
    again = client.get("/runs/ui-demo/chart", params={"since": chart["cursor"]}).json()
    assert again["unchanged"] is True and again["cursor"] == chart["cursor"]
    # An event that lands after a later-stamped one (a slow upload) sorts before the newest: it changes the
    # chart all the same.
    import json

    from training.storage import open_store

    newest = sorted((Path(run) / "events").iterdir())[-1].name
    ns = int(newest.split("-", 1)[0]) - 1_000_000_000
    late = {"type": "host_lost", "time": ns / 1e9, "source": "slow", "host": "h9", "reason": "a late one"}
    open_store(run).create(f"events/{ns:020d}-slow-x.json", json.dumps(late).encode())
    later = client.get("/runs/ui-demo/chart", params={"since": chart["cursor"]}).json()
    assert "unchanged" not in later and any("h9" in t["text"] for t in later["timeline"])


def test_goodput_breakdown_adds_up() -> None:
    from training.api import wall_split as goodput_breakdown

    b = goodput_breakdown({"wall_s": 100.0, "goodput": 0.6, "recoveries": [{"recovery_s": 10.0}, {"recovery_s": None}]})
    assert b is not None
    assert (b["productive_s"], b["recovery_s"], b["other_s"]) == pytest.approx((60.0, 10.0, 30.0))
    assert math.isclose(sum(b["fractions"].values()), 1.0)
    assert goodput_breakdown({"wall_s": None, "goodput": None, "recoveries": []}) is None
    live = {"state": "running", "wall_s": 100.0, "goodput": 0.6, "recoveries": []}
    assert goodput_breakdown(live) is None, "a live run's wall time is not known yet"


def test_the_page_escapes_what_it_shows(client: Any, project: Path) -> None:
    from training.events import write_status
    from training.storage import open_store

    name = "x.y-z_1"
    write_status(open_store(str(project / "var" / "runs" / name)), state="running", step=1)
    page = client.get(f"/runs/{name}/view").text
    assert f"<title>Training: {name}</title>" in page
    tricky = client.get("/runs/ui-demo/view", params={"root": '"><script>alert(1)</script>'})
    assert tricky.status_code == 403 and "<script>alert" not in tricky.text


# --- the plugin's registrations and the sensor's link ---------------------------------------------------


def test_external_view_is_a_dag_run_tab() -> None:
    import rtrain_plugin
    from airflow.api_fastapi.core_api.datamodels.plugins import ExternalViewResponse

    view, queue = rtrain_plugin.RTrainPlugin.external_views
    parsed = ExternalViewResponse.model_validate(view)
    assert parsed.destination == "dag_run" and parsed.url_route == "rtrain-training"
    assert view["href"] == "/rtrain/dags/{DAG_ID}/runs/{RUN_ID}/view"
    parsed = ExternalViewResponse.model_validate(queue)
    assert parsed.destination == "nav" and parsed.url_route == "rtrain-queue"
    assert queue["href"] == "/rtrain/queue/view"


def test_the_sensors_link_is_the_training_view() -> None:
    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.sdk import DAG
    from rtrain_airflow.hooks.training import absolute
    from rtrain_airflow.sensors.training import RTrainRunStatusLink, RTrainTrainingJobSensor

    link = RTrainRunStatusLink()
    assert link.name == "Training view" and link.xcom_key == "_link_RTrainRunStatusLink"
    key = TaskInstanceKey("resilient_training", "training.watch_job", "manual__2026-01-01T00:00:00+00:00", 1, -1)
    expected = "/rtrain/dags/resilient_training/runs/manual__2026-01-01T00%3A00%3A00%2B00%3A00/view"
    with DAG("t", schedule=None):
        unrendered = RTrainTrainingJobSensor(
            task_id="w", spec="{{ ti.xcom_pull('resolve_config') }}", handle="{{ ti.xcom_pull('launch_job') }}"
        )
    assert link.get_link(unrendered, ti_key=key) == expected  # what the API server would get, too
    unrendered.spec = {"run_uri": absolute("var/runs/demo")}
    assert link.get_link(unrendered, ti_key=None) == "/rtrain/runs/demo/view"
    unrendered.spec = {"run_uri": "gs://b/runs/demo"}
    assert link.get_link(unrendered, ti_key=None) == "/rtrain/runs/demo/view?root=gs%3A//b/runs"
    unrendered.spec = "{{ not rendered }}"
    assert link.get_link(unrendered, ti_key=None) == ""


def test_the_plugin_module_stays_light() -> None:
    """Importing the plugin (every Airflow process does) imports neither the ML stack nor FastAPI's app."""
    import subprocess
    import sys

    code = (
        "import json, sys; import rtrain_plugin; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'jax', 'jaxlib', 'flax', 'optax', 'orbax', 'grain', 'tensorstore', 'array_record'})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "PYTHONPATH": str(airflow_test_env.REPO / "plugins")},
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_an_unknown_dag_run_is_404(client: Any) -> None:
    airflow_test_env.migrate()
    for route in ROUTES:
        r = client.get(f"/dags/resilient_training/runs/no-such-dag-run/{route}")
        assert r.status_code == 404, (route, r.text)
        assert re.search("no DAG run no-such-dag-run", r.text)


def test_no_route_of_the_app_is_left_open(project: Path) -> None:
    """Every route the app has (its schema included; it serves no docs pages) answers 401 without a login."""
    from fastapi.testclient import TestClient
    from rtrain_airflow import webapp

    app = webapp.create_app()
    routes = sorted(
        {(re.sub(r"\{[^}]+\}", "x", r.path), m) for r in app.routes for m in getattr(r, "methods", ()) or ()}
    )
    paths = [p for p, _ in routes]
    assert "/openapi.json" in paths and "/runs/x/view" in paths and "/dags/x/runs/x/view" in paths
    assert ("/queue/x/priority", "POST") in routes and ("/queue/view", "GET") in routes
    with TestClient(app) as anonymous:
        for path, method in routes:
            if method in ("GET", "POST"):
                assert anonymous.request(method, path).status_code == 401, (method, path)
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert anonymous.get(path).status_code in (401, 404), path


@pytest.mark.parametrize(
    ("target", "code", "says", "waits"),
    [
        (None, 404, "no DAG run", False),
        (dict(name="", root=None, resolved=False, resolve_state=None, has_resolve=False), 404, "trains nothing", False),
        (
            dict(name="", root=None, resolved=False, resolve_state="failed", has_resolve=True),
            404,
            "resolve_config failed",
            False,
        ),
        (dict(name="", root=None, resolved=False, resolve_state="queued", has_resolve=True), 404, "not resolved", True),
        (
            dict(name="later", root=None, resolved=True, resolve_state="success", has_resolve=True),
            404,
            "no run later yet",
            True,
        ),
        (dict(name="ui-demo", root=None, resolved=False, resolve_state=None, has_resolve=True), 200, "ui-demo", False),
        (
            dict(name="ui-demo", root="/etc", resolved=True, resolve_state="success", has_resolve=True),
            403,
            "not inside the storage roots",
            False,
        ),
    ],
)
def test_a_dag_runs_tab(
    client: Any,
    run: str,
    monkeypatch: pytest.MonkeyPatch,
    target: dict[str, Any] | None,
    code: int,
    says: str,
    waits: bool,
) -> None:
    """What the Training tab shows for a DAG run, from what the DAG run says of its training run."""
    from rtrain_airflow import webapp
    from rtrain_airflow.dagruns import Target

    monkeypatch.setattr(
        webapp,
        "dag_run_target",
        lambda dag_id, run_id: None if target is None else Target(**target),
    )
    page = client.get("/dags/d/runs/r/view")
    assert page.status_code == code and says in page.text
    assert ('http-equiv="refresh"' in page.text) is waits
    if code == 200:
        assert (
            'data-api="/dags/d/runs/r"' in page.text and client.get("/dags/d/runs/r/chart").json()["run"] == "ui-demo"
        )


# --- the queue of a shared pool ---------------------------------------------------------------------------


def test_the_training_view_shows_a_submitted_runs_place_in_the_queue(client: Any, run: str, project: Path) -> None:
    assert client.get("/runs/ui-demo/chart").json()["queue"] is None  # not submitted: no queue line
    fake_runs.write_submission(project / "var" / "runs", "ui-demo", "high")
    chart = client.get("/runs/ui-demo/chart").json()
    q = chart["queue"]
    assert (q["priority"], q["state"], q["assigned"], q["min_hosts"], q["max_hosts"]) == ("high", "queued", 4, 2, 4)
    again = client.get("/runs/ui-demo/chart", params={"since": chart["cursor"]}).json()
    assert again["unchanged"] is True and again["queue"]["state"] == "queued"  # kept up to date between events
    # A run still waiting for its first launch has no root yet: its view shows its place in the queue.
    assert client.get("/runs/not-yet/chart").status_code == 404
    fake_runs.write_submission(project / "var" / "runs", "not-yet", "low")
    waiting = client.get("/runs/not-yet/chart")
    assert waiting.status_code == 200, waiting.text
    assert waiting.json()["status"] is None and waiting.json()["queue"]["state"] == "queued"
    assert client.get("/runs/not-yet/view").status_code == 200


def test_the_queue_is_served_read_only_to_viewers_and_changed_by_editors(client: Any, project: Path) -> None:
    from airflow.api_fastapi.app import create_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from fastapi.testclient import TestClient

    root = project / "var" / "runs"
    fake_runs.write_submission(root, "waiting", "low")
    fake_runs.write_submission(root, "done", "high", ended="finished")
    q = client.get("/queue").json()
    assert q["pool"] == 4 and {r["run"]: r["state"] for r in q["runs"]} == {"waiting": "queued", "done": "finished"}
    assert next(r for r in q["runs"] if r["run"] == "waiting")["assigned"] == 4, "what it would get: the whole pool"
    page = client.get("/queue/view")
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    assert '<tr data-run="waiting" data-state="queued">' in page.text and "A pool of 4 host(s)" in page.text
    # A Cancel button for the run not ended, none for the one that is; its script is the page's own file.
    buttons = re.findall(r'<button type="button" class="cancel"\s+data-run="([^"]+)"', page.text)
    assert buttons == ["waiting"], buttons
    assert 'data-api="/queue"' in page.text and 'src="/static/queue.js"' in page.text
    assert client.get("/static/queue.js").status_code == 200
    assert client.get("/queue", params={"root": "/etc"}).status_code == 403
    # A viewer may not change the queue.
    assert client.post("/queue/waiting/priority", params={"priority": "high"}).status_code == 403
    manager = create_auth_manager()
    manager.init()
    admin = str(manager.generate_jwt(SimpleAuthManagerUser(username="ui-admin", role="admin")))
    from rtrain_airflow import webapp

    with TestClient(webapp.create_app(), headers={"Authorization": f"Bearer {admin}"}) as editor:
        r = editor.post("/queue/waiting/priority", params={"priority": "top"})
        assert r.status_code == 400 and "unknown priority 'top'" in r.json()["detail"]
        r = editor.post("/queue/done/priority", params={"priority": "low"})
        assert r.status_code == 400 and "already ended (finished)" in r.json()["detail"]
        assert editor.post("/queue/nobody/cancel").status_code == 400
        r = editor.post("/queue/waiting/priority", params={"priority": "urgent"})
        assert r.status_code == 200 and r.json()["priority"] == "urgent", r.text
        runs = {x["run"]: x for x in client.get("/queue").json()["runs"]}
        assert runs["waiting"]["priority"] == "urgent" and runs["done"]["priority"] == "high"
        r = editor.post("/queue/waiting/cancel", params={"reason": "not needed"})
        assert r.status_code == 200 and r.json()["cancelled"] == "not needed"


# --- the Stop button ------------------------------------------------------------------------------------


def test_the_views_stop_ends_a_live_run_stopped_for_editors_only(client: Any, project: Path) -> None:
    """Stop asks the run's job to end as ``rtrain stop`` does; the view then shows it stopped, not failed."""
    from airflow.api_fastapi.app import create_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from fastapi.testclient import TestClient
    from rtrain_airflow import webapp

    from training.events import EventLog, RunState, write_status
    from training.layout import STOP
    from training.service.queue import Queue
    from training.storage import open_store

    root = project / "var" / "runs"
    live = fake_runs.write_run(root, "live", state="running")
    fake_runs.write_run(root, "done")
    fake_runs.write_submission(root, "waiting", "low")
    page = client.get("/runs/live/view").text
    assert '<button id="stop" type="button" hidden' in page
    assert client.post("/runs/live/stop").status_code == 403, "a viewer may not stop a run"
    manager = create_auth_manager()
    manager.init()
    admin = str(manager.generate_jwt(SimpleAuthManagerUser(username="ui-admin", role="admin")))
    with TestClient(webapp.create_app(), headers={"Authorization": f"Bearer {admin}"}) as editor:
        r = editor.post("/runs/live/stop")
        assert r.status_code == 200 and r.json() == {"run": "live", "asked": "stop", "state": "running"}, r.text
        assert json.loads(open_store(live).get(STOP)) == {
            "action": "stop_job",
            "reason": "stopped in the Training view",
        }
        r = editor.post("/runs/done/stop")
        assert r.status_code == 409 and r.json()["detail"] == "run done has no job to stop (finished)"
        r = editor.post("/runs/waiting/stop", params={"reason": "not today"})
        assert r.status_code == 200 and r.json()["asked"] == "cancel", r.text
        assert Queue(str(root)).submission("waiting").cancelled == "not today"
    # The job's leader ends it: the view shows the state, the sentence, and the hosts gone.
    store = open_store(live)
    EventLog(store, source="h0-agent").ended(RunState.STOPPED, "stopped in the Training view", step=40)
    write_status(store, state="stopped", reason="stopped in the Training view", job="j2", step=40, run_uri=live)
    chart = client.get("/runs/live/chart").json()
    assert (chart["status"]["state"], chart["status"]["reason"]) == ("stopped", "stopped in the Training view")
    assert "stale_s" not in chart["status"], "a stopped run is over: no staleness to warn of"
    said = [t for t in chart["timeline"] if t["type"] == "stopped"]
    assert said and said[0]["text"].startswith("the job was stopped: stopped in the Training view (at step 40)")
    assert chart["hosts"]["workers"][-1] == 0
