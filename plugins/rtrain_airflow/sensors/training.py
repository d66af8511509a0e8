"""The sensor that watches a training job, and whose retries relaunch it.

When a job dies beyond what its agents absorb (failure budget spent, capacity short past its
timeout, the agent killed, the JobSet failed or gone), this sensor fails, and Airflow's retry
relaunches the job through the same idempotent launch (``RTrainHook`` -> ``Backend.launch``:
re-attach if alive, else resume from the newest committed checkpoint; never from scratch, never
overwriting).  Why here: a watch that retried without relaunching would watch a dead job again,
and a retry cannot re-run the upstream launch task; the graph still shows plan, launch and watch.

A job a person stopped (``rtrain stop``, a cancel, the Training view's Stop, the teardown) ends the
task *skipped*, not failed: nothing is retried, the validation and promotion after it are skipped,
the teardown runs, and a new DAG run resumes the run from its newest committed checkpoint.

The first try never relaunches: it watches the job the launch task started (one already dead fails
it, and the retry relaunches).  Every try defers to :class:`RTrainTrainingJobTrigger`, so the wait
holds no worker slot.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any, NoReturn, cast
from urllib.parse import quote, urlsplit

from airflow.sdk import BaseOperatorLink, BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from rtrain_airflow.hooks.training import RTrainHook, absolute
from rtrain_airflow.operators.training import RESOLVE_TASK_ID, _is_deferred_value, check_spec
from rtrain_airflow.triggers.training import (
    PROGRESS_EVERY_S,
    RELAYED,
    RTrainTrainingJobTrigger,
    WatchEnd,
    check_watch_settings,
)
from training.api import Config, RunSpec, describe
from training.backends import ALIVE
from training.backends.base import JobHandle
from training.backends.watch import JobWatch, timeouts

if TYPE_CHECKING:
    from airflow.sdk import Context


def check_handle(handle: Any, who: str) -> JobHandle:
    """The job handle a launch task returned (through XCom), or an error naming the problem."""
    if not isinstance(handle, Mapping) or not handle.get("backend") or not handle.get("run_uri"):
        raise AirflowException(f"{who}: handle must be what the launch task returned, got {handle!r}")
    return cast(JobHandle, dict(handle))


# The plugin's Training view (plugins/rtrain_plugin.py, mounted by the API server under /rtrain).
VIEW_PREFIX = "/rtrain"


@cache
def base_path() -> str:
    """The path Airflow is served under (``[api] base_url``'s path, '' at the root): links are absolute paths."""
    try:
        from airflow.sdk.configuration import conf

        url = conf.get("api", "base_url", fallback="") or ""
    except Exception:  # noqa: BLE001 - no config here (a bare interpreter): links at the root
        url = ""
    return urlsplit(url).path.rstrip("/")


def dag_run_view_path(dag_id: str, run_id: str) -> str:
    """The Training view of a DAG run's training run (the plugin finds the run from the DAG run)."""
    return f"{base_path()}{VIEW_PREFIX}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}/view"


def run_view_path(run_uri: str) -> str:
    """The Training view of a run root (``<root>/<run_name>``); ``?root=`` unless it is the project's var/runs."""
    uri = str(run_uri).rstrip("/")
    name = uri.rsplit("/", 1)[-1]
    root = uri[: -len(name) - 1]
    query = "" if root == absolute("var/runs") else f"?root={quote(root)}"
    return f"{base_path()}{VIEW_PREFIX}/runs/{quote(name, safe='')}/view{query}"


class RTrainRunStatusLink(BaseOperatorLink):
    """A "Training view" button on the sensor's task page: the run's charts, served by the plugin (/rtrain).

    In Airflow 3 the API server never calls this: when a try of the task ends (deferred included), the task
    runner calls ``get_link`` on the task (templates rendered) and stores the URL as the XCom ``xcom_key``,
    which the API server's links endpoint reads back.  The URL names the DAG run (the plugin finds the run
    from that DAG run's ``resolve_config`` result, and checks access to that DAG); without a DAG run (a
    bare operator) it names the run root from the rendered spec.
    """

    name = "Training view"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        dag_id = getattr(ti_key, "dag_id", None)
        run_id = getattr(ti_key, "run_id", None)
        if dag_id and run_id:
            return dag_run_view_path(str(dag_id), str(run_id))
        spec = getattr(operator, "spec", None)
        run_uri = spec.get("run_uri") if isinstance(spec, Mapping) else None
        return run_view_path(str(run_uri)) if run_uri else ""


class RTrainTrainingJobSensor(BaseSensorOperator):
    """Wait for a training job to finish; fail when it is gone for good; a retry relaunches it.

    :param spec: the run spec (output of the resolve task), or
    :param spec_from: the id of the task whose XCom it is (pulled when the task runs: no data edge).
    :param handle: the job handle (output of the launch task).
    :param poll_interval: seconds between looks at the run's status and events.
    :param start_timeout_s: a launched agent that never reports is failed after this long.
    :param progress_every_s: at most one progress line in the task log per this many seconds
        (``step 120/300 (40%), loss 2.3141, 5400 tok/s, ETA 3m12s, 4 workers, mesh data4 x fsdp2``);
        0: none.
    :param deferrable: wait in the triggerer (default); else poke in a worker slot.

    Returns (XCom) the trigger's final event: ``state``, ``step``, ``latest_committed``,
    ``failures``, ``recoveries`` (each with ``recovery_s``, as seen from the events),
    and the ``handle`` that finished.
    """

    template_fields: Sequence[str] = ("spec", "handle")
    ui_color = "#fdf0d5"
    operator_extra_links = (RTrainRunStatusLink(),)

    def __init__(
        self,
        *,
        spec: Any = None,
        spec_from: str | None = None,
        handle: Any,
        poll_interval: float = 5.0,
        start_timeout_s: float = 300.0,
        progress_every_s: float = PROGRESS_EVERY_S,
        deferrable: bool = True,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("timeout", timedelta(days=7))
        super().__init__(poke_interval=poll_interval, mode="poke", **kwargs)
        check_watch_settings(poll_interval, start_timeout_s, progress_every_s)
        if spec is None and spec_from is None:
            raise ValueError(
                f"{type(self).__name__}: give spec (the output of {RESOLVE_TASK_ID}) or spec_from (its task id)"
            )
        if spec is not None and not _is_deferred_value(spec):
            check_spec(spec, type(self).__name__)
        if not _is_deferred_value(handle):
            check_handle(handle, type(self).__name__)
        self.spec = spec
        self.spec_from = spec_from
        self.handle = handle
        self.poll_interval = poll_interval
        self.start_timeout_s = start_timeout_s
        self.progress_every_s = progress_every_s
        self.deferrable = deferrable
        self._progress_at: float | None = None

    @cached_property
    def hook(self) -> RTrainHook:
        return RTrainHook()

    def _spec(self, context: Context) -> RunSpec:
        if self.spec is not None:
            return check_spec(self.spec, self.task_id)
        value = context["ti"].xcom_pull(task_ids=self.spec_from)
        if value is None:
            raise AirflowException(f"{self.task_id}: {self.spec_from} left no run spec (did it run?)")
        return check_spec(value, self.task_id)

    def _job(self, context: Context) -> tuple[RunSpec, Config, JobHandle]:
        """(spec, config, handle of the job to watch), relaunching on a retry when the job is gone."""
        spec = self._spec(context)
        handle = check_handle(self.handle, self.task_id)
        cfg = self.hook.config_from_dict(spec["config"])
        backend = self.hook.backend_for(spec)
        try_number = int(context["ti"].try_number)
        if try_number > 1:
            # The run's current job: the one an earlier try relaunched, if it did (its status names it).
            current = (self.hook.status(cfg.run_uri) or {}).get("job")
            if current and current != handle.get("job"):
                handle = {**handle, "job": str(current), "attached": True, "launched_at": time.time()}
            look = backend.poll(handle, timeouts(cfg.elastic, self.start_timeout_s))
            if look["state"] == "failed":
                self.log.warning(
                    "[rtrain] try %d: the job is gone (%s); relaunching from the newest committed checkpoint",
                    try_number,
                    look.get("reason"),
                )
                committed = self.hook.committed_steps(cfg.run_uri)[-1:] or None
                handle = self.hook.relaunch(backend, spec, cfg, attempt=try_number)
                self.log.warning(
                    "[rtrain] relaunched %s (newest committed step %s): %s", cfg.run_name, committed, handle
                )
            else:
                self.log.info("[rtrain] try %d: the job is %s; watching it again", try_number, look["state"])
        return spec, cfg, handle

    def execute(self, context: Context) -> Any:
        spec, cfg, handle = self._job(context)
        self._watching = handle
        context["ti"].xcom_push(key="handle", value=handle)  # for the teardown: what to stop if still alive
        if not self.deferrable:
            return super().execute(context)
        self.defer(
            trigger=RTrainTrainingJobTrigger.for_task(self, cfg, handle),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout) if self.timeout else None,
        )

    def _looks(self, spec: Mapping[str, Any], cfg: Config) -> JobWatch:
        """The engine's watch of the job, kept for all pokes (one backend: GKE, one cluster and its clients)."""
        if getattr(self, "_job_watch", None) is None:
            handle = getattr(self, "_watching", None) or check_handle(self.handle, self.task_id)
            self._job_watch = JobWatch(
                lambda: self.hook.backend_for(spec),
                handle,
                timeouts(cfg.elastic, self.start_timeout_s),
                handle.get("events_after"),
            )
        return self._job_watch

    def poke(self, context: Context) -> PokeReturnValue:
        spec = self._spec(context)
        cfg = self.hook.config_from_dict(spec["config"])
        watch = self._looks(spec, cfg)
        look = watch.look()
        for ev in look.events:
            if ev["type"] in RELAYED and (ev["type"] != "checkpoint" or ev.get("committed")):
                self.log.info("[rtrain] %s", describe(ev))
        st = look.status
        if look.outcome == "failed":
            fail = AirflowException if look.retry else AirflowFailException  # a retry that cannot help is not made
            raise fail(f"training job {spec['run_name']} failed: {look.reason}")
        if look.outcome == "stopped":
            self._stopped(spec["run_uri"], look.state, look.reason, st.get("latest_committed"))
        if look.outcome == "success":
            return PokeReturnValue(
                True,
                {
                    "status": "success",
                    "state": "finished",
                    "step": st.get("step"),
                    "latest_committed": st.get("latest_committed"),
                    "failures": st.get("failures"),
                    "handle": dict(watch.handle),
                },
            )
        if look.state not in ALIVE:
            raise AirflowException(f"training job {spec['run_name']}: unexpected state {look.state!r}")
        now = time.monotonic()
        if self.progress_every_s and (self._progress_at is None or now - self._progress_at >= self.progress_every_s):
            self._progress_at = now
            keys = ("step", "steps_total", "loss", "tokens_per_s", "workers", "mesh")
            line = describe({"type": "progress", **{k: st.get(k) for k in keys}})
            self.log.info("[rtrain] %s: %s", look.state.replace("_", " "), line)
        return PokeReturnValue(False)

    def _stopped(self, run_uri: Any, state: str, reason: Any, committed: Any) -> NoReturn:
        """A person stopped the job (or cancelled the run): this task is skipped, and so is what needs a trained run."""
        self.log.warning(
            "[rtrain] the run at %s was %s by request: %s. Not a failure: this task and the validation, promotion "
            "and pruning after it are skipped; the teardown still runs. Newest committed checkpoint: %s; trigger "
            "the DAG again (or clear this task group) to resume from it.",
            run_uri,
            state,
            reason,
            committed,
        )
        raise AirflowSkipException(f"training run {run_uri} was {state}: {reason} (resumable)")

    def execute_complete(self, context: Context, event: WatchEnd) -> WatchEnd:
        if event.get("status") == "stopped":
            self._stopped(
                event.get("run_uri"), str(event.get("state")), event.get("message"), event.get("latest_committed")
            )
        if event.get("status") == "failed" and event.get("retry") is False:
            raise AirflowFailException(f"training job at {event.get('run_uri')} failed: {event.get('message')}")
        if event.get("status") != "success":
            raise AirflowException(
                f"training job at {event.get('run_uri')} is gone: {event.get('message')} "
                f"(state {event.get('state')}, step {event.get('step')}, newest committed {event.get('latest_committed')}); "
                "a retry of this task relaunches it from the newest committed checkpoint"
            )
        for i, rec in enumerate(event.get("recoveries") or [], 1):
            self.log.info(
                "[rtrain] recovery %d: from %s, training again at step %s after %.1fs",
                i,
                rec.get("cause"),
                rec.get("resumed_step"),
                rec.get("recovery_s") or 0,
            )
        self.log.info(
            "[rtrain] job finished at step %s; %s failure(s) absorbed by the job itself",
            event.get("step"),
            event.get("failures") or 0,
        )
        return event


RTrainRunStatusLink.operators = [RTrainTrainingJobSensor]
