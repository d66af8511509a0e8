"""The engine's backends, chosen by name: the CLI launches through the local one; bad choices are one-line errors."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
from jobs import wait_for

from training import api, backends
from training.backends import (
    REGISTRY,
    BackendError,
    Context,
    GKEBackend,
    GKESpec,
    JobSpec,
    LocalSliceBackend,
    LocalSpec,
    PoolSpec,
    SharedPoolBackend,
    backend_for,
    register,
)
from training.backends.base import LocalHandle, Provisioned, Released, Timeouts
from training.backends.drive import Drive, Say
from training.backends.local import pid_alive
from training.cli import Exit, main
from training.gke import GKESettings

GKE: GKESettings = {
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
    from training.layout import STOP
    from training.storage import open_store

    for name, backend in (("local", backends.backend("local")), ("gke", backends.backend("gke", gke=GKE))):
        run_uri = str(tmp_path / name)
        backend.stop({"run_uri": run_uri, "job": "j1"}, f"stopped from {name}")
        control = json.loads(open_store(run_uri).get(STOP))
        assert control == {"action": "stop_job", "reason": f"stopped from {name}"}


# --- the registry: a job spec's placement kind chooses its backend; a new kind is one registered factory ---


class NoCluster:
    """A GKE cluster nobody may call (the registry only makes the backend)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the cluster was called: {name}")


def test_each_placement_kind_makes_its_backend(tmp_path: Path) -> None:
    cfg = api.load_config("tiny", None, {"root": str(tmp_path), "run_name": "r"})
    assert type(backend_for(JobSpec.local(cfg))) is LocalSliceBackend
    pool = backend_for(JobSpec(cfg, PoolSpec("high")), Context(by="rtrain"))
    assert isinstance(pool, SharedPoolBackend) and (pool.priority, pool.by) == ("high", "rtrain")
    gke = backend_for(GKESpec(GKE), Context(cluster=NoCluster()))
    assert isinstance(gke, GKEBackend) and gke.gke == GKE
    # By name, as the hook and the CLI ask: a priority puts a local run in the shared pool.
    assert type(backends.backend("local")) is LocalSliceBackend
    assert isinstance(backends.backend("local", priority="low"), SharedPoolBackend)
    with pytest.raises(BackendError, match="backend: one of local, gke, not 'ray'"):
        backends.backend("ray")


def test_a_run_spec_s_json_reads_back_as_a_typed_job_spec(tmp_path: Path) -> None:
    cfg = api.load_config("tiny", None, {"root": str(tmp_path), "run_name": "r"})
    spec = api.RunSpec(config=cfg.model_dump(mode="json"), run_uri=cfg.run_uri, backend="local", priority=None)
    job = JobSpec.from_run_spec(spec)
    assert job.config == cfg and job.placement == LocalSpec()
    assert JobSpec.from_run_spec({**spec, "priority": "urgent"}).placement == PoolSpec("urgent")
    on_gke = JobSpec.from_run_spec({**spec, "backend": "gke", "gke": dict(GKE), "priority": "high"})
    assert on_gke.placement == GKESpec(GKE, "high")
    resumed = job.with_config(cfg.model_copy(update={"resume_from": "latest"}))
    assert resumed.placement is job.placement and resumed.config.checkpoint.resume_from == "latest"


@dataclass(frozen=True)
class DrySpec:
    """A placement of a kind the engine does not ship: a dry run that only records what it was asked."""

    kind: Literal["dry"] = "dry"


class DryBackend:
    """A backend that runs nothing: the smallest one the Backend protocol allows."""

    name = "dry"

    def __init__(self, by: str) -> None:
        self.by = by
        self.asked: list[str] = []

    def provision(self, job: JobSpec) -> Provisioned:
        self.asked.append(f"provision {job.config.run_name}")
        return {"backend": self.name, "run_uri": job.config.run_uri}

    def launch(self, job: JobSpec, attempt: int) -> LocalHandle:
        self.asked.append(f"launch {job.config.run_name} try {attempt}")
        return LocalHandle(
            backend=self.name, run_uri=job.config.run_uri, job="dry", attached=False, launched_at=0.0, events_after=None
        )

    def poll(self, handle: Any, timeouts: Timeouts, now: float | None = None) -> api.JobLook:
        return api.JobLook(state="finished", reason="", status={})

    def stop(self, handle: Any, reason: str) -> None:
        self.asked.append(f"stop: {reason}")

    def release(self, job: JobSpec, handles: Any) -> Released:
        return {"backend": self.name, "released": True}


class DryLines:
    """What rtrain train would say of the dry backend's steps."""

    def provisioned(self, up: Provisioned) -> str:
        return f"provisioned {up['run_uri'].rsplit('/', 1)[-1]}"

    def launched(self, handle: Any) -> str:
        return f"launched {handle['job']}"

    def detached(self, handle: Any) -> str:
        return ""

    def out_of_touch(self, error: Exception) -> str:
        return str(error)

    def released(self, out: Released) -> str:
        return f"released: {out.get('released')}"

    def release_failed(self, error: Exception) -> str:
        return str(error)


def test_a_new_backend_is_one_registered_factory(tmp_path: Path) -> None:
    cfg = api.load_config("tiny", None, {"root": str(tmp_path), "run_name": "r"})
    with pytest.raises(BackendError, match="no backend runs placements of kind 'dry'"):
        backend_for(DrySpec())
    register("dry")(lambda where, ctx: DryBackend(ctx.by))
    try:
        made = backend_for(JobSpec(cfg, DrySpec()), Context(by="rtrain"))
        assert isinstance(made, DryBackend) and made.by == "rtrain"
        handle = made.launch(JobSpec(cfg, DrySpec()), attempt=1)
        assert handle["job"] == "dry" and made.asked == ["launch r try 1"]
        with pytest.raises(ValueError, match="'dry' is registered already"):
            register("dry")(lambda where, ctx: DryBackend(ctx.by))
        # rtrain train's one driver drives it as it drives the local slice and GKE: provision, launch, follow, release.
        said: list[str] = []
        drive = Drive(made, JobSpec(cfg, DrySpec()), DryLines(), Say(said.append), {}, poll_s=0.01)
        look = drive.run()
        assert look is not None and look["state"] == "finished"
        assert made.asked == ["launch r try 1", "provision r", "launch r try 1"]
        assert said == ["provisioned r", "launched dry", "released: True"]
    finally:
        REGISTRY.pop("dry", None)
    assert set(REGISTRY) == {"local", "pool", "gke"}
