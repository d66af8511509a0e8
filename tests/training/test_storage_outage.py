"""The run root on ``gs://`` out for longer than the lease, for every process of the job (the agents, and the
workers' checkpoint writes): real jobs against the GCS emulator, the emulator's process stopped, then continued."""

from __future__ import annotations

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


@pytest.mark.parametrize("checkpoint_format", ["auto", "lean"])
def test_an_outage_of_the_whole_root_longer_than_the_lease_is_ridden_out(
    gcs_root: str, tiny_dataset: str, jax_cache: str, checkpoint_format: str
) -> None:
    """The store stops answering for 3 leases, mid-training and with saves under way: the lease lapses and is taken
    over, Orbax's writes (auto: zarr against the emulator) wait it out, and the job trains to its end on exactly
    the pipeline's examples, without a failure, and gives the lease back."""
    cfg = job_config(
        gcs_root, tiny_dataset, jax_cache, run_name="outage", steps=60, checkpoint_every=5, min_workers=1,
        max_workers=2, lease_s=10.0, heartbeat_timeout_s=20.0, checkpoint_format=checkpoint_format,
        trace_data_ids=True,
    )  # fmt: skip
    handle = start_job(cfg)
    wait_for(lambda: ((api.status(cfg.run_uri) or {}).get("latest_committed") or 0) >= 5, 300, "a checkpoint")
    emulator = emulator_process()
    emulator.suspend()
    try:
        time.sleep(cfg.lease_s * 3)
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
    assert newest.exists("lean.json") == (checkpoint_format == "lean"), "saved in the format asked for"
