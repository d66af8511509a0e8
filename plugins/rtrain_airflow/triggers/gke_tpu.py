"""A deferrable wait for a GKE node pool operation (create, resize, delete).

Creating a multi-host TPU slice takes minutes (longer when capacity is short),
so the operators hand the wait to the triggerer instead of holding a worker
slot.  Unlike a bare status check, a DONE operation that carries an error
(a stockout, a quota refusal) is reported as a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

CLASSPATH = "rtrain_airflow.triggers.gke_tpu.GKETPUNodePoolOperationTrigger"


class GKETPUNodePoolOperationTrigger(BaseTrigger):
    """Poll a cluster manager operation until it is done.

    Yields one event: ``{"status": "success", "operation_name", "target_link", "message"}``,
    or ``{"status": "failed" | "error", "operation_name", "message"}``.

    :param operation_name: the operation's short name (``operation-...``), as the create/delete call returned it.
    :param project_id: the cluster's project.
    :param location: the cluster's region or zone.
    :param node_pool_name: for messages only.
    :param poll_interval: seconds between polls.
    :param max_poll_errors: consecutive failed polls (network, 5xx) tolerated before giving up.
    """

    def __init__(
        self,
        operation_name: str,
        project_id: str | None,
        location: str,
        node_pool_name: str = "",
        gcp_conn_id: str = "google_cloud_default",
        impersonation_chain: str | Sequence[str] | None = None,
        poll_interval: float = 15.0,
        max_poll_errors: int = 3,
    ) -> None:
        super().__init__()
        self.operation_name = operation_name
        self.project_id = project_id
        self.location = location
        self.node_pool_name = node_pool_name
        self.gcp_conn_id = gcp_conn_id
        self.impersonation_chain = impersonation_chain
        self.poll_interval = poll_interval
        self.max_poll_errors = max_poll_errors
        self._hook: Any = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            CLASSPATH,
            {
                "operation_name": self.operation_name,
                "project_id": self.project_id,
                "location": self.location,
                "node_pool_name": self.node_pool_name,
                "gcp_conn_id": self.gcp_conn_id,
                "impersonation_chain": self.impersonation_chain,
                "poll_interval": self.poll_interval,
                "max_poll_errors": self.max_poll_errors,
            },
        )

    def _get_hook(self) -> Any:
        if self._hook is None:
            from airflow.providers.google.cloud.hooks.kubernetes_engine import GKEAsyncHook

            self._hook = GKEAsyncHook(
                gcp_conn_id=self.gcp_conn_id, location=self.location, impersonation_chain=self.impersonation_chain
            )
        return self._hook

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from google.cloud.container_v1 import Operation

        from rtrain_airflow.hooks.gke_tpu import operation_error

        hook = self._get_hook()
        what = f"operation {self.operation_name}" + (
            f" on node pool {self.node_pool_name}" if self.node_pool_name else ""
        )
        errors = 0
        while True:
            try:
                operation = await hook.get_operation(operation_name=self.operation_name, project_id=self.project_id)
            except Exception as e:  # noqa: BLE001 - any failure to poll is reported, after a few tries
                errors += 1
                self.log.warning("Polling %s failed (%d/%d): %s", what, errors, self.max_poll_errors, e)
                if errors >= self.max_poll_errors:
                    yield TriggerEvent(
                        {"status": "error", "operation_name": self.operation_name, "message": f"polling {what}: {e}"}
                    )
                    return
                await asyncio.sleep(self.poll_interval)
                continue
            errors = 0
            if operation.status in (Operation.Status.PENDING, Operation.Status.RUNNING):
                self.log.info("%s is %s; next poll in %ss", what, operation.status.name, self.poll_interval)
                await asyncio.sleep(self.poll_interval)
                continue
            error = operation_error(operation)
            if error:
                yield TriggerEvent(
                    {"status": "failed", "operation_name": self.operation_name, "message": f"{what} failed: {error}"}
                )
            else:
                yield TriggerEvent(
                    {
                        "status": "success",
                        "operation_name": self.operation_name,
                        "target_link": operation.target_link,
                        "message": f"{what} is done",
                    }
                )
            return
