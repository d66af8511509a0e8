"""Helpers to run jobs in tests and read what they left in the run root."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training.config import Config, load_config


def job_config(root: str, dataset: str, cache: str, **overrides: Any) -> Config:
    base = {
        "root": root,
        "dataset": dataset,
        "compilation_cache": cache,
        "log_every": 5,
        "hang_timeout_s": 120,
        "capacity_timeout_s": 30,
    }
    base.update(overrides)
    return load_config("tiny", None, base)


def run_job(cfg: Config) -> int:
    from training.api import launch

    lines: list[str] = []
    res = launch(cfg, detach=False, display=lines.append)
    return int(res["returncode"])


def step_ids(run_uri: str) -> dict[int, list[int]]:
    """Per step, the sorted example ids the final attempt covering that step consumed."""
    from training.storage import open_store

    store = open_store(run_uri)
    by_step: dict[int, dict[int, list[int]]] = {}
    for key in store.list("trace/"):
        _, step_s, name = key.split("/")
        attempt = int(name[1:4])
        ids = json.loads(store.get(key))["ids"]
        by_step.setdefault(int(step_s), {}).setdefault(attempt, []).extend(ids)
    return {s: sorted(atts[max(atts)]) for s, atts in sorted(by_step.items())}


def worker_logs(run_uri: str) -> str:
    logs = Path(run_uri) / "logs"
    return "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(logs.rglob("*.log"))) if logs.exists() else ""
