"""A backend added beside the engine in one module (``tests/backend_added``), found by its entry point, run by
``rtrain train`` through the one driver: nothing of the engine changes for it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from training import api

REPO = Path(__file__).resolve().parents[2]


def test_without_its_install_no_config_can_name_it() -> None:
    from training.backends import names

    assert "journaled" not in names()
    with pytest.raises(api.ConfigError, match="backend: one of local, gke, not 'journaled'"):
        api.load_config("tiny", None, {"placement.backend": "journaled"})


def test_an_installed_backend_is_named_made_and_readied_by_the_registry(added_backend: None, tmp_path: Path) -> None:
    from training.backends import BackendError, Context, PoolSpec, backend, backend_for, names, placement, preparation
    from training.backends.spec import JobSpec
    from training.placement_traits import traits

    assert names()[:2] == ("local", "gke") and "journaled" in names()
    cfg = api.load_config("tiny", None, {"root": str(tmp_path), "run_name": "j", "placement.backend": "journaled"})
    assert traits("journaled").hosts_here  # its module was imported by the config's check, once
    made = backend("journaled", by="rtrain")
    assert made.name == "journaled" and type(made).__module__ == "journaled_backend"
    job = JobSpec(cfg, placement("journaled"))
    assert type(backend_for(job, Context(foreground=True))) is type(made)
    prep = preparation("journaled")
    assert prep.fit(cfg, {}, None, set()) is cfg
    with pytest.raises(BackendError, match="at most 4 hosts"):
        prep.fit(cfg.model_copy(update={"elastic.max_workers": 6}), {}, None, set())
    assert placement("journaled", None, "high") == PoolSpec("high")  # the shared pool's, launched through it


@pytest.mark.slow
def test_rtrain_train_runs_an_installed_backend_through_the_one_driver(
    added_backend: None, tmp_path: Path, tiny_dataset: str, jax_cache: str
) -> None:
    from journaled_backend import read_journal

    args = [f"root={tmp_path}", f"dataset={tiny_dataset}", f"compilation_cache={jax_cache}", "steps=6"]
    args += ["placement.backend=journaled", "checkpoint_every=3"]
    cmd = [sys.executable, "-m", "training.cli", "train"]
    out = subprocess.run([*cmd, *args, "run_name=j", "max_workers=2"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    assert "finished: step 6/6" in out.stdout
    st = api.status(str(tmp_path / "j")) or {}
    assert st.get("state") == "finished" and st.get("latest_committed") == 6
    verbs = [(e["verb"], e["by"]) for e in read_journal(str(tmp_path / "j"))]
    assert verbs == [("provision", "rtrain"), ("launch", "rtrain"), ("poll", "rtrain"), ("release", "rtrain")]
    # Its preparation refuses before anything starts, as Airflow's resolve task would.
    refused = subprocess.run([*cmd, *args, "run_name=k", "max_workers=6"], cwd=REPO, capture_output=True, text=True)
    assert refused.returncode != 0 and "at most 4 hosts" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "k").exists()


def test_a_broken_install_is_said_as_the_config_s_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "rtrain_broken-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rtrain-broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rtrain.backends]\nbroken = no_such_backend_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from training.backends import names

    assert "broken" in names()
    with pytest.raises(api.ConfigError, match="backend 'broken': its module no_such_backend_module did not load"):
        api.load_config("tiny", None, {"placement.backend": "broken"})


@pytest.mark.slow
def test_the_shared_pool_s_scheduler_launches_an_installed_backend_s_run_through_it(
    added_backend: None, tmp_path: Path, tiny_dataset: str, jax_cache: str
) -> None:
    from journaled_backend import read_journal

    from training.service.commands import submit

    over: dict[str, object] = {"root": str(tmp_path), "run_name": "q", "dataset": tiny_dataset}
    over["compilation_cache"] = jax_cache
    over |= {"steps": 6, "checkpoint_every": 3, "max_workers": 2, "placement.backend": "journaled"}
    cfg = api.load_config("tiny", None, over)
    submit(cfg, "high", pool_hosts=2)  # starts the root's scheduler, a process of its own
    deadline = time.time() + 240
    while time.time() < deadline and (api.status(cfg.run_uri) or {}).get("state") != "finished":
        time.sleep(0.5)
    assert (api.status(cfg.run_uri) or {}).get("state") == "finished"
    assert [(e["verb"], e["by"]) for e in read_journal(cfg.run_uri)] == [("launch", "scheduler")]
