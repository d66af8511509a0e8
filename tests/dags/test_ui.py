"""The Training view against a real ``airflow api-server`` (started here as in test_rest_trigger.py): Airflow's
login in front of every plugin route, the storage roots, 404s and 503s, the DAG run's Training tab, the
sensor's extra link of a real ``watch_job`` run, and a real browser (headless Chromium driven by Playwright)
drawing a finished run and following a live one.

The run roots are written by hand (tests/dags/fake_runs.py): no JAX runs here.  The screenshots go to
``var/screenshots/`` of the repository.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import fake_runs
import pytest
import requests
from airflow_test_env import REPO, api_server, wait_for

DAG_ID = "resilient_training"
ROUTES = ("status", "events", "report", "checkpoints", "chart", "view")
CHROMIUM = "/usr/bin/chromium"
# A closed network: nothing but the server under test is reached.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = REPO / "var" / "screenshots"


@pytest.fixture(scope="module")
def ui(airflow_db: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """An API server whose project root (default storage root ``<project>/var/runs``) is a temp directory,
    with one more storage root listed in RTRAIN_STORAGE_ROOTS, and the runs the tests look at."""
    base_dir = tmp_path_factory.mktemp("ui")
    project, extra, outside = base_dir / "project", base_dir / "extra", base_dir / "outside"
    runs = project / "var" / "runs"
    fake_runs.write_run(runs, "ui-demo")
    fake_runs.write_run(runs, "ui-link")
    fake_runs.write_run(extra, "elsewhere")
    fake_runs.write_run(outside, "secret")
    fake_runs.write_run(project / "var" / "runs-evil", "ui-demo")
    (runs / "escape").symlink_to(outside / "secret")
    (runs / "out").symlink_to(outside)
    broken = Path(fake_runs.write_run(runs, "broken"))
    (broken / "status.json").unlink()
    (broken / "status.json").mkdir()  # unreadable: a storage error

    env = {"RTRAIN_PROJECT_ROOT": str(project), "RTRAIN_STORAGE_ROOTS": f"{extra}:gs://rtrain-ui-test/runs"}
    with api_server(base_dir, env) as server:
        base, token = server.base, server.token
        # A DAG run of the pipeline (no scheduler runs here: it stays queued until a test moves it).
        dag_run = requests.post(
            f"{base}/api/v2/dags/{DAG_ID}/dagRuns",
            headers=server.headers,
            json={"logical_date": None, "conf": {"run_name": "ui-demo"}},
            timeout=30,
        )
        dag_run.raise_for_status()
        yield {
            "base": base,
            "token": token,
            "headers": server.headers,
            "project": project,
            "runs": runs,
            "extra": extra,
            "outside": outside,
            "dag_run": dag_run.json()["dag_run_id"],
            "log": server.log,
        }


def get(ui: dict[str, Any], path: str, auth: bool = True, root: str | None = None) -> requests.Response:
    return requests.get(
        f"{ui['base']}{path}",
        headers=ui["headers"] if auth else None,
        params={"root": root} if root is not None else None,
        timeout=60,
    )


def dag_run_path(ui: dict[str, Any], run_id: str | None = None) -> str:
    return f"/rtrain/dags/{DAG_ID}/runs/{quote(run_id or ui['dag_run'], safe='')}"


# --- Airflow's login, roots, 404 and 503 -------------------------------------------------------------------


def test_every_plugin_route_refuses_without_login_and_serves_with_it(ui: dict[str, Any]) -> None:
    paths = (
        [f"/rtrain/runs/ui-demo/{r}" for r in ROUTES]
        + [f"{dag_run_path(ui)}/{r}" for r in ROUTES]
        + ["/rtrain/static/view.js", "/rtrain/static/uPlot.iife.min.js"]
    )
    for path in paths:
        anonymous = get(ui, path, auth=False)
        assert anonymous.status_code in (401, 403), (path, anonymous.status_code)
        forged = requests.get(f"{ui['base']}{path}", headers={"Authorization": "Bearer x.y.z"}, timeout=30)
        assert forged.status_code in (401, 403), path
        served = get(ui, path)
        assert served.status_code == 200, (path, served.text[:300])
    # The UI's session cookie is as good as the bearer token.
    with_cookie = requests.get(f"{ui['base']}/rtrain/runs/ui-demo/view", cookies={"_token": ui["token"]}, timeout=30)
    assert with_cookie.status_code == 200 and 'data-run="ui-demo"' in with_cookie.text
    assert get(ui, "/rtrain/runs/ui-demo/status").json()["state"] == "finished"
    assert get(ui, "/rtrain/runs/ui-demo/report").json()["breakdown"]["productive_s"] > 0


@pytest.mark.parametrize(
    ("what", "name", "root"),
    [
        ("..", "secret", "{runs}/../../../outside"),
        ("relative ..", "secret", "../outside"),
        ("a run that is a symlink out", "escape", None),
        ("a root that is a symlink out", "secret", "{runs}/out"),
        ("an absolute path outside", "secret", "{outside}"),
        ("a sibling prefix", "ui-demo", "{project}/var/runs-evil"),
        ("the file system root", "etc", "/"),
        ("an unlisted bucket", "ui-demo", "gs://another-bucket/runs"),
        ("a listed bucket path with ..", "ui-demo", "gs://rtrain-ui-test/runs/../x"),
    ],
)
def test_traversal_is_refused(ui: dict[str, Any], what: str, name: str, root: str | None) -> None:
    where = root.format(**{k: ui[k] for k in ("runs", "outside", "project")}) if root else None
    for route in ("status", "events", "view"):
        r = get(ui, f"/rtrain/runs/{name}/{route}", root=where)
        assert r.status_code == 403, (what, route, r.status_code, r.text[:200])
        assert "not inside the storage roots" in r.text or "not a plain gs://" in r.text


def test_the_allowed_roots_serve(ui: dict[str, Any]) -> None:
    assert get(ui, "/rtrain/runs/ui-demo/status", root=f"{ui['runs']}/../runs").status_code == 200
    assert get(ui, "/rtrain/runs/elsewhere/status", root=str(ui["extra"])).status_code == 200
    page = get(ui, "/rtrain/runs/elsewhere/view", root=str(ui["extra"])).text
    assert f'data-query="?root={quote(str(ui["extra"]))}"' in page
    for bad in ("..%2F..%2Fetc", "..", "a..b"):
        assert get(ui, f"/rtrain/runs/{bad}/status").status_code in (403, 404), bad


def test_an_unknown_run_is_404_on_every_route(ui: dict[str, Any]) -> None:
    for route in ROUTES:
        for path in (f"/rtrain/runs/no-such-run/{route}", f"{dag_run_path(ui, 'no-such-dag-run')}/{route}"):
            r = get(ui, path)
            assert r.status_code == 404, (path, r.status_code)
    assert "No training run here" in get(ui, "/rtrain/runs/no-such-run/view").text


def test_a_storage_error_is_503_with_a_one_line_reason(ui: dict[str, Any]) -> None:
    for route in ("status", "chart"):
        r = get(ui, f"/rtrain/runs/broken/{route}")
        assert r.status_code == 503, (route, r.text)
        detail = r.json()["detail"]
        assert "\n" not in detail and "Traceback" not in detail and "IsADirectoryError" in detail


# --- the DAG run's tab and the sensor's link --------------------------------------------------------------


def test_the_training_tab_is_registered_for_dag_runs(ui: dict[str, Any]) -> None:
    plugins = get(ui, "/api/v2/plugins").json()["plugins"]
    (ours,) = [p for p in plugins if p["name"] == "rtrain_plugin"]
    view, queue = ours["external_views"]
    assert queue["destination"] == "nav" and queue["href"] == "/rtrain/queue/view"
    assert view["destination"] == "dag_run" and view["url_route"] == "rtrain-training"
    assert view["href"] == "/rtrain/dags/{DAG_ID}/runs/{RUN_ID}/view"
    # What the tab loads for this DAG run (queued: its run_name comes from the conf until resolve_config ran).
    page = get(ui, f"{dag_run_path(ui)}/view")
    assert page.status_code == 200 and 'data-run="ui-demo"' in page.text


def test_the_watch_jobs_extra_link_is_the_training_view(ui: dict[str, Any], dagbag: Any) -> None:
    """watch_job runs for real (Airflow's task runner, its trigger inline) on a run whose job has finished;
    the task runner stores the link, the API server's links endpoint returns it, and it opens the view
    of the run that resolve_config resolved (ui-link, not the conf's ui-demo)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.sdk.definitions.dag import _run_task
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState
    from rtrain_airflow.hooks.training import RTrainHook
    from sqlalchemy import select, update

    r = requests.post(
        f"{ui['base']}/api/v2/dags/{DAG_ID}/dagRuns",
        headers=ui["headers"],
        json={"logical_date": None, "conf": {"run_name": "ui-demo"}},
        timeout=30,
    )
    r.raise_for_status()
    run_id = r.json()["dag_run_id"]
    cfg = RTrainHook().build_config({"run_name": "ui-link", "root": str(ui["runs"]), "steps": fake_runs.STEPS})
    spec = {
        "config": cfg.model_dump(mode="json"),
        "run_uri": cfg.run_uri,
        "run_name": cfg.run_name,
        "backend": "local",
        "dataset": {"source": "stdlib", "max_bytes": None},
        "gke": {},
    }
    handle = {
        "backend": "local",
        "run_uri": cfg.run_uri,
        "job": "j2",
        "attached": False,
        "host": "h0",
        "launched_at": time.time(),
        "events_after": None,
    }
    dag = dagbag.dags[DAG_ID]
    with create_session() as session:
        dr = session.scalar(select(DagRun).where(DagRun.dag_id == DAG_ID, DagRun.run_id == run_id))
        assert dr is not None
        for task_id, value in (("resolve_config", spec), ("training.launch_job", handle)):
            # As the task's own push stores it (the execution API: a JSON value, not serialized again).
            XComModel.set(
                key="return_value",
                value=value,
                dag_id=DAG_ID,
                task_id=task_id,
                run_id=run_id,
                serialize=False,
                session=session,
            )
            dr.get_task_instance(task_id, session=session).state = TaskInstanceState.SUCCESS
        ti = dr.get_task_instance("training.watch_job", session=session)
        ti.try_number += 1
        ti.state = TaskInstanceState.SCHEDULED
        session.commit()
        result = _run_task(ti=ti, task=dag.task_dict["training.watch_job"], run_triggerer=True)
        assert result is not None and ti.state == TaskInstanceState.SUCCESS, ti.state
    with create_session() as session:  # the rest of the DAG run is not the point here: it ends as a finished run
        session.execute(
            update(TaskInstance)
            .where(
                TaskInstance.dag_id == DAG_ID,
                TaskInstance.run_id == run_id,
                TaskInstance.state.is_distinct_from(TaskInstanceState.SUCCESS),
            )
            .values(state=TaskInstanceState.SKIPPED)
        )
        session.execute(
            update(DagRun).where(DagRun.dag_id == DAG_ID, DagRun.run_id == run_id).values(state=DagRunState.SUCCESS)
        )
    assert get(ui, f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}").json()["state"] == "success"

    links = get(ui, f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/training.watch_job/links")
    assert links.status_code == 200, links.text
    url = links.json()["extra_links"]["Training view"]
    assert url == f"/rtrain/dags/{DAG_ID}/runs/{quote(run_id, safe='')}/view"
    page = get(ui, url)
    assert page.status_code == 200 and 'data-run="ui-link"' in page.text
    assert get(ui, url, auth=False).status_code == 401
    chart = get(ui, url.replace("/view", "/chart")).json()
    assert chart["run"] == "ui-link" and chart["status"]["state"] == "finished"


# --- a real browser ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(ui: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless Chromium (Debian's package) with Airflow's session cookie, as the UI's login page sets it."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is absent (apt-get install -y chromium chromium-driver)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
            timeout=60_000,
        )
        # The simple auth manager's login page does this: POST /auth/token, then the `_token` cookie.
        context.add_cookies([{"name": "_token", "value": ui["token"], "url": ui["base"], "sameSite": "Lax"}])
        errors: list[str] = []
        context.on("weberror", lambda e: errors.append(str(e.error)))
        try:
            yield context, errors
        finally:
            context.close()


def test_the_training_tab_draws_a_finished_run(ui: dict[str, Any], browser: Any) -> None:
    context, errors = browser
    page = context.new_page()
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{ui['base']}/dags/{DAG_ID}/runs/{quote(ui['dag_run'], safe='')}/plugin/rtrain-training")
    frame = page.frame_locator('iframe[title="Training"]')
    frame.locator("body[data-loaded=true]").wait_for(timeout=90_000)
    frame.locator("#goodput-figure").wait_for(timeout=60_000)  # the report (Orbax's first import takes a while)
    # The charts are uPlot canvases; the markers are DOM elements over them, at uPlot's positions.
    assert frame.locator("#loss-chart canvas").count() >= 1 and frame.locator("#hosts-chart canvas").count() >= 1
    loss_markers = frame.locator("#loss-chart .rt-marker")
    kinds = [loss_markers.nth(i).get_attribute("data-kind") for i in range(loss_markers.count())]
    assert sorted(kinds) == ["failure", "promotion", "recovery", "resize", "rollback"], kinds
    assert frame.locator('#loss-chart .rt-marker[data-kind="failure"]').get_attribute("data-step") == "15"
    assert frame.locator('#loss-chart .rt-marker[data-kind="recovery"]').get_attribute("data-step") == "11"
    assert "host h1 lost" in frame.locator('#loss-chart .rt-marker[data-kind="failure"] .rt-flag').get_attribute(
        "title"
    )
    assert frame.locator('#hosts-chart .rt-marker[data-kind="failure"]').count() == 1
    assert frame.locator("#state").inner_text() == "finished"
    assert frame.locator("#checkpoints tbody tr").count() == 4
    assert frame.locator('#checkpoints tr[data-step="40"]').get_attribute("data-state") == "promoted"
    assert frame.locator("#rounds tbody tr").count() == 3
    assert frame.locator("#goodput-figure").inner_text().endswith("% goodput")
    assert frame.locator("#problem").is_hidden()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "training-view.png"), full_page=True)
    # The same page on its own (as the sensor's extra link opens it), all of it.
    view = context.new_page()
    view.goto(f"{ui['base']}{dag_run_path(ui)}/view")
    view.locator("#goodput-figure").wait_for(timeout=60_000)
    view.screenshot(path=str(SCREENSHOTS / "training-view-page.png"), full_page=True)
    assert errors == []
    view.close()
    page.close()


def test_the_view_follows_a_live_run(ui: dict[str, Any], browser: Any) -> None:
    """A run that is training: new steps show up without a reload (the page polls every 3 s)."""
    from training.events import write_status
    from training.storage import open_store

    context, errors = browser
    uri = fake_runs.write_run(ui["runs"], "ui-live", t0=time.time() - 60, state="running")
    try:
        page = context.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{ui['base']}/rtrain/runs/ui-live/view")
        page.locator("body[data-loaded=true]").wait_for(timeout=60_000)
        assert page.locator("#state").inner_text() == "running"
        assert "step 40" in page.locator("#summary").inner_text()
        writer = fake_runs._Writer(uri, time.time())
        writer.steps(41, 45, 4)
        write_status(
            open_store(uri), state="running", step=45, steps_total=50, loss=2.0, failures=0, job="j2", workers=4
        )
        assert page.locator("body").get_attribute("data-last-step") == "40"
        page.locator("#summary", has_text="step 45 / 50").wait_for(timeout=20_000)
        page.locator('body[data-last-step="45"]').wait_for(timeout=20_000)  # the loss chart has the new steps
        assert "computed once the run has ended" in page.locator("#goodput").inner_text()
        assert page.locator("#queue").is_hidden()  # not submitted to a shared pool: no queue line
        fake_runs.write_submission(ui["runs"], "ui-live", "high")
        page.locator("#queue", has_text="In the queue: priority high · queued · 4 host(s) assigned of 2..4").wait_for(
            timeout=20_000
        )
        page.screenshot(path=str(SCREENSHOTS / "training-view-live.png"), full_page=True)
        assert errors == []
        page.close()
    finally:
        shutil.rmtree(uri, ignore_errors=True)


def test_the_training_queue_is_a_page_of_airflows_navigation(ui: dict[str, Any], browser: Any) -> None:
    fake_runs.write_submission(ui["runs"], "q-waiting", "low")
    fake_runs.write_submission(ui["runs"], "q-done", "high", ended="finished")
    context, errors = browser
    page = context.new_page()
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{ui['base']}/plugin/rtrain-queue")
    frame = page.frame_locator('iframe[title="Training queue"]')
    frame.locator('tr[data-run="q-waiting"]').wait_for(timeout=60_000)
    assert frame.locator('tr[data-run="q-waiting"]').get_attribute("data-state") == "queued"
    assert frame.locator('tr[data-run="q-done"]').get_attribute("data-state") == "finished"
    assert "A pool of 4 host(s)" in frame.locator("main").inner_text()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "training-queue.png"), full_page=True)
    # A run not launched yet: its Training view says where it waits.
    page.goto(f"{ui['base']}/rtrain/runs/q-waiting/view")
    page.locator("body[data-loaded=true]").wait_for(timeout=60_000)
    assert page.locator("#state").inner_text() == "queued"
    assert page.locator("#queue").inner_text().startswith("In the queue: priority low · queued")
    assert "Not started yet" in page.locator("#summary").inner_text()
    assert errors == []
    page.close()


# --- the buttons, on real jobs -------------------------------------------------------------------------------


@pytest.mark.slow
def test_cancel_in_the_queue_and_stop_in_the_view_end_real_runs_cancelled_and_stopped(
    ui: dict[str, Any], browser: Any, shared: dict[str, str], stop_agents: list[str]
) -> None:
    """A pool of 1 host under a storage root: run ``pa`` trains (a real job on the local slice, placed by a real
    scheduler), ``pb`` waits.  The queue page's Cancel on ``pb`` ends it cancelled; the Training view's Stop on
    ``pa`` ends its job stopped; both pages show it, without a hand-made record."""
    from rtrain_airflow.hooks.training import RTrainHook

    from training import api
    from training.service import commands

    context, errors = browser
    root = str(ui["extra"] / "pool")
    hook = RTrainHook()
    cfgs = {
        name: hook.build_config(
            {"root": root, "run_name": name, "dataset": shared["dataset"], "steps": 100_000}
            | {"min_workers": 1, "max_workers": 1, "checkpoint_every": 20, "compilation_cache": shared["cache"]}
            | {"hang_timeout_s": 120, "log_every": 5}
        )
        for name in ("pa", "pb")
    }
    stop_agents.extend(cfg.run_uri for cfg in cfgs.values())
    hook.prepare_dataset("stdlib", shared["dataset"], cfgs["pa"].model.seq_len, 1_000_000)
    commands.submit(cfgs["pa"], "normal", pool_hosts=1)
    commands.submit(cfgs["pb"], "normal")
    try:
        wait_for(
            lambda: (api_status(cfgs["pa"].run_uri).get("step") or 0) >= 3, 300, what="pa training on the pool's host"
        )
        assert commands.look(root, "pb").state == "queued"
        page = context.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("dialog", lambda d: d.accept())  # the buttons ask "are you sure?"
        page.goto(f"{ui['base']}/rtrain/queue/view?root={quote(root)}")
        row = {name: page.locator(f'tr[data-run="{name}"]') for name in cfgs}
        row["pa"].locator("td", has_text="running").first.wait_for(timeout=30_000)
        assert row["pb"].get_attribute("data-state") == "queued"
        assert row["pa"].locator("button.cancel").is_visible() and row["pb"].locator("button.cancel").is_visible()
        row["pb"].locator("button.cancel").click()
        page.locator('tr[data-run="pb"][data-state="cancelled"]').wait_for(timeout=60_000)  # after the page's reloads
        assert page.locator('tr[data-run="pb"] button.cancel').count() == 0, "an ended run has no Cancel"
        assert page.locator('tr[data-run="pa"]').get_attribute("data-state") == "running"

        view = context.new_page()
        view.on("pageerror", lambda e: errors.append(str(e)))
        view.on("dialog", lambda d: d.accept())
        view.goto(f"{ui['base']}/rtrain/runs/pa/view?root={quote(root)}")
        view.locator("body[data-stoppable=true]").wait_for(timeout=60_000)
        view.locator("#stop").click()
        view.locator("#stop-said", has_text="Cancelled in the queue").wait_for(timeout=30_000)
        view.locator("#state", has_text="stopped").wait_for(timeout=180_000)
        assert view.locator("#stop").is_hidden()
        page.locator('tr[data-run="pa"][data-state="stopped"]').wait_for(timeout=60_000)
        st = api_status(cfgs["pa"].run_uri)
        assert (st["state"], st["reason"]) == ("stopped", "cancelled: stopped in the Training view"), st
        assert max(api.committed_steps(cfgs["pa"].run_uri)) == st["step"], "the step it stopped at is committed"
        assert api_status(cfgs["pb"].run_uri)["state"] == "cancelled"
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "training-queue-cancelled.png"), full_page=True)
        assert errors == []
    finally:
        for name in cfgs:
            if commands.look(root, name).state not in commands.ENDED:
                commands.cancel(root, name, "the test is over")
        wait_for(lambda: all(commands.look(root, n).state in commands.ENDED for n in cfgs), 120, what="both runs ended")


def api_status(run_uri: str) -> dict[str, Any]:
    from training import api

    return dict(api.status(run_uri) or {})
