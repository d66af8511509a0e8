"""Alerts on failure, retry and rollback, through Airflow's callbacks.

Every alert is one structured log line (``[rtrain-alert] {...json...}``) in the
task's log.  Where it goes beyond that is pluggable:

* pass notifiers (any ``BaseNotifier``: Slack, SMTP, ... from their providers) as
  ``forward=[...]`` to :func:`alert_callbacks`;
* or name a factory in the environment, ``RTRAIN_ALERT_NOTIFIER=package.module:make``,
  returning a notifier (or a callable taking the context);
* ``RTRAIN_ALERTS_FILE=/path/alerts.jsonl`` appends each alert as a JSON line (the
  demo prints them; the tests read them).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseNotifier

log = logging.getLogger("rtrain.alerts")
KINDS = ("failure", "retry", "rollback")


def _reason(context: Any) -> str:
    exc = context.get("exception")
    if exc is not None:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _resuming(context: Any) -> bool:
    """Whether the task is resuming after a deferral (the task runner's own record of it)."""
    ti = context.get("ti")
    server = getattr(ti, "_ti_context_from_server", None)
    return bool(getattr(server, "next_method", None))


class RTrainAlertNotifier(BaseNotifier):
    """Log (and forward) an alert about a training DAG's task.

    :param kind: ``failure``, ``retry`` or ``rollback``.
    :param forward: further notifiers to call with the same context.
    """

    template_fields = ("kind",)

    def __init__(self, kind: str, forward: Sequence[Any] = (), reason_from: str | None = None) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind: one of {KINDS}, got {kind!r}")
        self.kind = kind
        self.forward = list(forward)
        self.reason_from = reason_from

    def _reason_from_xcom(self, ti: Any) -> str:
        """The verdict that caused this alert, from the XCom of ``reason_from`` (e.g. the validate task)."""
        if not self.reason_from or ti is None:
            return ""
        try:
            v = ti.xcom_pull(task_ids=self.reason_from)
        except Exception:  # noqa: BLE001 - no XCom: no reason, the alert still goes out
            return ""
        if isinstance(v, dict) and "step" in v:
            return f"step {v['step']} {v.get('verdict', '')}: {v.get('reason', '')}".strip()
        return ""

    def alert(self, context: Any) -> dict[str, Any]:
        ti = context.get("ti") or context.get("task_instance")
        params = context.get("params") or {}
        return {
            "kind": self.kind,
            "time": time.time(),
            "dag_id": getattr(ti, "dag_id", None),
            "task_id": getattr(ti, "task_id", None),
            "run_id": getattr(ti, "run_id", None),
            "try_number": getattr(ti, "try_number", None),
            "run_name": params.get("run_name"),
            "reason": _reason(context) or self._reason_from_xcom(ti),
        }

    def notify(self, context: Any) -> None:
        if self.kind == "rollback" and _resuming(context):
            return  # on_execute_callback runs again when the task resumes from its deferral: one alert is enough
        alert = self.alert(context)
        line = json.dumps(alert, sort_keys=True, default=str)
        log.warning("[rtrain-alert] %s", line)
        sink = os.environ.get("RTRAIN_ALERTS_FILE")
        if sink:
            with open(sink, "a") as f:
                f.write(line + "\n")
        targets = list(self.forward)
        factory = os.environ.get("RTRAIN_ALERT_NOTIFIER")
        if factory:
            from airflow.sdk._shared.module_loading import import_string

            targets.append(import_string(factory.replace(":", "."))())
        for target in targets:
            try:
                if isinstance(target, BaseNotifier):
                    target.notify(context)
                else:
                    target(context)
            except Exception:  # noqa: BLE001 - an alert channel that fails must not fail the task
                log.exception("alert notifier %r failed", target)


def alert_callbacks(forward: Sequence[Any] = ()) -> dict[str, list[RTrainAlertNotifier]]:
    """``on_failure_callback`` and ``on_retry_callback`` for ``default_args``."""
    return {
        "on_failure_callback": [RTrainAlertNotifier("failure", forward)],
        "on_retry_callback": [RTrainAlertNotifier("retry", forward)],
    }


def rollback_alert(forward: Sequence[Any] = (), reason_from: str | None = "validate") -> list[RTrainAlertNotifier]:
    """``on_execute_callback`` of the rollback branch: it runs only when a rollback happens.

    The alert's reason is the verdict in the XCom of ``reason_from`` (the validate task).
    """
    return [RTrainAlertNotifier("rollback", forward, reason_from=reason_from)]
