"""The run root on ``gs://`` out for longer than the lease, for every process of the job (the agents, and the
workers' checkpoint writes): real jobs against the GCS emulator, the emulator's process stopped, then continued."""

from __future__ import annotations

import contextlib
import os
import time
from urllib.parse import urlparse

import psutil
import pytest
from jobs import assert_exact_data, job_config, start_job, wait_finished, wait_for

from training import api
from training.checkpoint.lock import RunLock
from training.layout import step_uri
from training.storage import open_store

pytestmark = pytest.mark.slow


def emulator_process() -> psutil.Process:
    """The GCS emulator's process: the one listening on the port this session's ``gs://`` is served on."""
    port = urlparse(os.environ["STORAGE_EMULATOR_HOST"]).port
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return psutil.Process(c.pid)
    raise AssertionError(f"nothing listens on port {port}")


@pytest.mark.extended
def test_an_outage_of_the_whole_root_longer_than_the_lease_is_ridden_out(
    gcs_root: str, tiny_dataset: str, jax_cache: str
) -> None:
    """The store stops answering for 3 leases, mid-training and with saves under way: the lease lapses and is taken
    over, Orbax's writes (OCDBT, the default) wait it out, and the job trains to its end on exactly
    the pipeline's examples, without a failure, and gives the lease back."""
    cfg = job_config(
        gcs_root, tiny_dataset, jax_cache, run_name="outage", steps=60, checkpoint_every=5, min_workers=1,
        max_workers=2, lease_s=10.0, heartbeat_timeout_s=20.0, trace_data_ids=True,
    )  # fmt: skip
    handle = start_job(cfg)
    wait_for(lambda: ((api.status(cfg.run_uri) or {}).get("latest_committed") or 0) >= 5, 300, "a checkpoint")
    emulator = emulator_process()
    emulator.suspend()
    try:
        time.sleep(cfg.elastic.lease_s * 3)
    finally:
        emulator.resume()
    st = wait_finished(handle, timeout=400)
    assert st["state"] == "finished" and st["step"] == 60, st
    evs = api.events(cfg.run_uri)
    assert len([e for e in evs if e["type"] == "leader"]) >= 2, "the lease lapsed in the outage: it was taken over"
    assert not [e for e in evs if e["type"] in ("failed", "failure")], [e for e in evs if e["type"] == "failure"]
    assert RunLock(open_store(cfg.run_uri), owner="test").held_by() is None, "the lease is given back"
    assert_exact_data(cfg.run_uri, tiny_dataset, cfg)
    newest = open_store(step_uri(cfg.run_uri, api.committed_steps(cfg.run_uri)[-1]))
    assert newest.exists("state/manifest.ocdbt") and not newest.exists("lean.json"), "saved in Orbax's OCDBT"


def test_a_bucket_deleted_under_a_running_job_ends_it_naming_the_bucket(
    gcs_emulator: str, tiny_dataset: str, jax_cache: str
) -> None:
    """The run's whole bucket deleted mid-training, saves under way: every write of every process is refused
    (not found), for good.  The job ends soon with one line naming the root and the error, no process is left,
    and the launcher's look says so (the end is kept on this machine: the root takes no writes)."""
    import uuid

    from training.storage import gcs_client

    client = gcs_client()
    bucket = client.create_bucket(f"vanish-{uuid.uuid4().hex[:8]}")  # type: ignore[attr-defined]
    cfg = job_config(
        f"gs://{bucket.name}/runs", tiny_dataset, jax_cache, run_name="vanish", steps=60, checkpoint_every=5,
        min_workers=1, max_workers=2, log_every=5,
    )  # fmt: skip
    handle = start_job(cfg)
    wait_for(lambda: ((api.status(cfg.run_uri) or {}).get("latest_committed") or 0) >= 5, 300, "a checkpoint")
    t = time.time()
    # The job's processes held still for the moment the bucket goes, so no write of theirs lands between the
    # last object's delete and the bucket's (a bucket is deleted only empty).
    job = [p for p in psutil.process_iter(["cmdline"]) if cfg.run_uri in " ".join(p.info["cmdline"] or [])]
    for p in job:
        p.suspend()
    try:
        _delete_bucket(client, bucket.name)
    finally:
        for p in job:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.resume()
    wait_finished(handle, timeout=150)
    took = time.time() - t
    look = api.job_state(handle)
    print(f"the job ended {took:.1f} s after its bucket was deleted: {look['reason']}")
    named = f"the run root {cfg.root}/vanish is gone (bucket {bucket.name} not found)"
    assert look["state"] == "failed" and named in look["reason"] and "\n" not in look["reason"], look
    assert took < 120, f"the job went on {took:.0f} s after its bucket was deleted"
    procs = [p for p in psutil.process_iter(["cmdline"]) if cfg.run_uri in " ".join(p.info["cmdline"] or [])]
    assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], procs


def _delete_bucket(client: object, name: str) -> None:
    """Delete bucket ``name`` and everything in it, while the job still writes into it."""
    from google.api_core import exceptions

    bucket = client.bucket(name)  # type: ignore[attr-defined]
    for _ in range(50):
        for blob in client.list_blobs(name):  # type: ignore[attr-defined]
            try:
                blob.delete()
            except exceptions.NotFound:
                pass
        try:
            bucket.delete()
            return
        except exceptions.Conflict:  # a write landed since the listing: not empty yet
            continue
    raise AssertionError(f"bucket {name} could not be deleted")
