"""What a GKE run is checked for before its node pools bill; each refusal one line, none worth a retry.

The launch checks most of this too, but only after ``provision`` has made the pools: here the
config for the slice, the plan, the memory fit at the minimum topology (the estimate; ``remat:
auto`` was compiled by ``resolve_config``), the task and its data, the run lock (a live job that
holds the run refuses the launch), a write to the run root (the launcher's own: the job's service
account is the pods', which the launcher cannot act as), and the image (its registry's manifest).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from training import api
from training.api import Config
from training.backends.base import BackendError
from training.checkpoint.lock import RunLock
from training.cloud_errors import cloud_error
from training.gke import GKEConfigError, TPUSlice, check_config
from training.storage import open_store


def check_before_billing(cfg: Config, tpu: TPUSlice, image: str, find_image: Callable[[str], bool | None]) -> list[str]:
    """Refuse (BackendError, one line) a run the launch would refuse once the pools bill; what went unchecked."""
    try:
        check_config(cfg, tpu)
        api.check_fit(cfg)
        api.check_task(cfg)
    except (GKEConfigError, api.PlanError, api.TaskError, api.LaunchError) as e:
        raise BackendError(str(e)) from None
    _check_write(cfg.run_uri)
    _check_lock(cfg.run_uri)
    found = find_image(image)
    if found is False:
        raise BackendError(
            f"gke.image: {image} is not in its registry (no such manifest): push it first "
            "(docker push, or gcloud builds submit; docs/gke.md section 3)"
        )
    return [] if found else [f"gke.image: {image} not checked (its registry did not say whether it has it)"]


def _check_lock(run_uri: str) -> None:
    """Refuse a run whose lock a live job holds, as the launch would: a lease that lapses within the launch's
    wait is watched, and refused only if its holder refreshes it."""
    reader = RunLock(open_store(run_uri), owner="the GKE check before billing")  # only reads
    held = reader.held_by()
    if held is None:
        return
    if reader.lapses_in(held) <= api.LAPSE_WAIT_MAX_S:
        newer = reader.wait_lapse(held)
        if newer is None or newer.get("token") != held.get("token") or newer["action"] == "release":
            return  # lapsed, released, or another owner's: the launch decides
        held = newer
    raise BackendError(f"refused before any node pool: {reader.message(held)}")


def _check_write(run_uri: str) -> None:
    """A probe written to the run root and deleted: the bucket exists and takes the launcher's writes."""
    store = open_store(run_uri)
    probe = f".preflight-{uuid.uuid4().hex[:12]}"
    try:
        store.put(probe, b"")
        store.delete(probe)
    except Exception as e:
        cloud = cloud_error(e)
        if cloud is None and not isinstance(e, OSError):
            raise
        why = cloud.line if cloud is not None else " ".join(str(e).split())
        raise BackendError(f"root: the run root {run_uri} does not take a write from the launcher ({why})") from None
