"""The small API the CLI and the Airflow plugins call (plan, launch, status, ...).

Nothing here imports JAX at module level: planning is arithmetic, and launching
starts the agent in its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from training.config import Config, config_from_json
from training.events import EventLog, read_status
from training.mesh import PlanError, plan_report
from training.storage import NotFound, Store, open_store

ALIVE_STATES = ("starting", "running", "recovering", "waiting_for_capacity")


class LaunchError(RuntimeError):
    pass


def plan(cfg: Config) -> dict[str, Any]:
    """Mesh plans and the memory-fit check; raises PlanError with the numbers."""
    return plan_report(cfg)


def run_store(cfg_or_uri: Config | str) -> Store:
    uri = cfg_or_uri.run_uri if isinstance(cfg_or_uri, Config) else cfg_or_uri
    return open_store(uri)


def committed_steps(run_uri: str) -> list[int]:
    """Committed checkpoint steps of a run, as Orbax decides (without JAX devices)."""
    from orbax.checkpoint import path as ocp_path

    from training.storage import join

    ckpt = join(run_uri, "checkpoints") if run_uri.startswith("gs://") else os.path.join(run_uri, "checkpoints")
    from etils import epath

    root = epath.Path(ckpt)
    if not root.exists():
        return []
    steps = []
    for p in root.iterdir():
        if p.name.isdigit() and ocp_path.step.is_checkpoint_finalized(p):
            steps.append(int(p.name))
    return sorted(steps)


def prepare_run(cfg: Config) -> Store:
    """Write the run's resolved config (and keep each version of it)."""
    from training import data as data_lib

    try:
        data_lib.load_manifest(cfg.dataset)
    except Exception as e:  # noqa: BLE001 - any failure to read it means the same thing
        raise LaunchError(f"dataset {cfg.dataset!r} is not prepared ({e}); run `rtrain prepare` first") from None
    store = run_store(cfg)
    try:
        old = config_from_json(store.get("config.json").decode())
    except NotFound:
        old = None
    if old is not None and cfg.resume_from == "none":
        raise LaunchError(
            f"run {cfg.run_name!r} already exists at {cfg.run_uri} and resume_from=none; "
            "pick another run_name or resume_from=latest"
        )
    if old is not None:
        fixed: tuple[str, ...] = (
            "seq_len",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "d_ff",
            "vocab_size",
            "param_dtype",
            "global_batch",
            "dataset",
        )
        if cfg.on_dataset_change == "restart":
            fixed = tuple(k for k in fixed if k != "dataset")
        changed = [k for k in fixed if getattr(old, k) != getattr(cfg, k)]
        if changed:
            raise LaunchError(
                f"run {cfg.run_name!r} exists with different {', '.join(changed)}; "
                "these cannot change on resume (start a new run_name)"
            )
    data = cfg.to_json().encode()
    store.put("config.json", data)
    store.create(f"config-history/{time.time_ns():020d}.json", data)
    return store


def agent_alive(store: Store) -> dict[str, Any] | None:
    """The status of a live agent for this run on this machine, else None."""
    st = read_status(store)
    if not st or st.get("state") not in ALIVE_STATES:
        return None
    pid = st.get("agent_pid")
    if not pid or st.get("host") != os.uname().nodename:
        return None
    try:
        os.kill(int(pid), 0)
    except OSError:
        return None
    return st


def launch(cfg: Config, *, detach: bool = True, display: Any = print, log_dir: str = "var/logs") -> dict[str, Any]:
    """Launch the run's agent, or re-attach to the live one. Never starts over, never overwrites.

    The plan and the memory-fit check run first, so a config that cannot run is
    refused before any worker starts.
    """
    plan(cfg)
    store = run_store(cfg)
    live = agent_alive(store)
    if live:
        return {"attached": True, "agent_pid": live["agent_pid"], "run_uri": cfg.run_uri}
    prepare_run(cfg)
    if not detach:
        from training.agent import run_agent

        rc = run_agent(cfg.run_uri, display=display)
        return {"attached": False, "returncode": rc, "run_uri": cfg.run_uri}
    logs = Path(log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    log = open(logs / f"agent-{cfg.run_name}.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "training.agent", cfg.run_uri],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # outlives the caller (an Airflow task, a shell)
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return {"attached": False, "agent_pid": proc.pid, "run_uri": cfg.run_uri}


def status(run_uri: str) -> dict[str, Any] | None:
    return read_status(open_store(run_uri))


def events(run_uri: str, types: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    return EventLog(open_store(run_uri)).read(types=types)


def set_capacity(run_uri: str, workers: int, reason: str = "manual") -> None:
    from training.capacity import LocalCapacity

    LocalCapacity(open_store(run_uri), default=workers).set(workers, reason=reason)
    EventLog(open_store(run_uri), source="cli").emit("capacity", available=workers, reason=reason)


def validate(run_uri: str, step: int | None = None) -> dict[str, Any]:
    from training import lifecycle

    return lifecycle.validate(run_uri, step)


def validate_pending(run_uri: str) -> list[dict[str, Any]]:
    from training import lifecycle

    return lifecycle.validate_pending(run_uri)


def rollback(run_uri: str, to: int | None = None, reason: str = "manual rollback") -> dict[str, Any]:
    from training import lifecycle

    return lifecycle.rollback(run_uri, to, reason)


def promote(run_uri: str, step: int | None = None) -> dict[str, Any]:
    from training import lifecycle

    return lifecycle.promote(run_uri, step)


def prune(run_uri: str, dry_run: bool = False) -> dict[str, Any]:
    from training import lifecycle

    return lifecycle.prune(run_uri, dry_run)


def report(run_uri: str) -> dict[str, Any]:
    from training import lifecycle

    return lifecycle.report(run_uri)


def load_run_config(run_uri: str) -> Config:
    return config_from_json(open_store(run_uri).get("config.json").decode())


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)


__all__ = [
    "LaunchError",
    "PlanError",
    "plan",
    "launch",
    "status",
    "events",
    "set_capacity",
    "committed_steps",
    "validate",
    "validate_pending",
    "rollback",
    "promote",
    "prune",
    "report",
]
