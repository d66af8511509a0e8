"""The engine's backends, chosen by name: the CLI launches through the local one; bad choices are one-line errors."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from jobs import wait_for

from training import api, backends
from training.backends import BackendError, GKEBackend, GKESpec, JobSpec, LocalSliceBackend, SharedPoolBackend
from training.backends.local import pid_alive
from training.cli import Exit, main

GKE = {
    "location": "us-east5",
    "cluster_name": "c",
    "machine_type": "ct6e-standard-4t",
    "tpu_topology": "2x2",
    "image": "img",
    "node_pools": ["p0"],
}


def test_backends_are_chosen_by_name() -> None:
    assert isinstance(backends.backend("local"), LocalSliceBackend)
    assert isinstance(backends.backend("local", priority="high"), SharedPoolBackend)
    assert isinstance(backends.backend("gke", gke=GKE), GKEBackend)
    with pytest.raises(BackendError, match="backend: one of local, gke, not 'slurm'"):
        backends.backend("slurm")
    with pytest.raises(BackendError, match="priority: "):
        backends.backend("local", priority="asap")
    with pytest.raises(BackendError, match="gke: backend 'gke' needs gke.image, gke.node_pools"):
        backends.backend("gke", gke={k: v for k, v in GKE.items() if k not in ("image", "node_pools")})


def test_the_gke_backend_without_cluster_calls_says_where_they_come_from(tmp_path: Path) -> None:
    cfg = api.load_config("tiny", None, {"root": str(tmp_path), "run_name": "g"})
    from training.backends.gke_cluster import CloudCluster

    made = backends.backend("gke", gke=GKE)  # by default: the engine's cluster calls, with ADC
    assert isinstance(made, GKEBackend) and type(made.cluster) is CloudCluster
    with pytest.raises(BackendError, match="no cluster client was given"):
        GKEBackend(GKE).provision(JobSpec(cfg, GKESpec(GKE)))
    assert not Path(cfg.run_uri).exists(), "nothing of the run is written"


def test_rtrain_train_refuses_a_gke_run_without_its_settings_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["train", f"root={tmp_path}", "run_name=g", "backend=gke"])
    err = capsys.readouterr().err.strip()
    assert rc == Exit.CONFIG
    assert err.count("\n") == 0 and "a 'gke' run needs its settings: rtrain train --gke FILE" in err
    assert not (tmp_path / "g").exists()


@pytest.mark.slow
def test_rtrain_train_detach_provisions_and_launches_through_the_local_backend(
    tmp_path: Path, tiny_dataset: str, jax_cache: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [f"root={tmp_path}", "run_name=d", f"dataset={tiny_dataset}", f"compilation_cache={jax_cache}"]
    assert main(["train", "--detach", *args, "steps=400", "max_workers=2"]) == Exit.OK
    started = re.search(r"^job (\S+) of run d started on the local slice", capsys.readouterr().out)
    assert started, "the job's id and where it runs"
    job = started.group(1)
    run_uri = str(tmp_path / "d")
    cfg = api.load_run_config(run_uri)
    [capacity] = api.events(run_uri, ("capacity",))
    assert (capacity["available"], capacity["reason"]) == (2, "provisioned by rtrain")
    wait_for(lambda: (api.status(run_uri) or {}).get("state") == "running", 120, "the job running")
    local = LocalSliceBackend(by="rtrain")
    look = local.poll({"run_uri": run_uri, "job": job, "launched_at": 0}, {})
    assert look["state"] == "running"
    pids = api.local_job_pids(run_uri)
    assert pids and all(pid_alive(p) for p in pids)
    released = local.release(JobSpec.local(cfg), [{"run_uri": run_uri, "job": job, "controller_pid": os.getpid()}])
    assert released["released"] is True
    assert not any(pid_alive(p) for p in pids)
    assert api.events(run_uri, ("capacity",))[-1]["reason"] == "released by the rtrain teardown"
    st = api.repair_status(run_uri) or {}
    assert (st.get("state"), st.get("reason")) == ("stopped", f"stopped by the rtrain teardown (job {job})"), st


def test_stop_asks_the_job_s_leader_to_end_it_on_every_backend_that_runs_agents(tmp_path: Path) -> None:
    from training.layout import CONTROL
    from training.storage import open_store

    for name, backend in (("local", backends.backend("local")), ("gke", backends.backend("gke", gke=GKE))):
        run_uri = str(tmp_path / name)
        backend.stop({"run_uri": run_uri, "job": "j1"}, f"stopped from {name}")
        control = json.loads(open_store(run_uri).get(CONTROL))
        assert control == {"action": "stop_job", "reason": f"stopped from {name}"}
