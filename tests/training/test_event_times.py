"""A worker's events are timed when the worker reported them, not when its agent got round to writing them.

A real job: host agents, real JAX processes joined by gloo.
"""

from __future__ import annotations

import statistics

import pytest
from jobs import job_config, run_job, worker_logs

from training import api

pytestmark = pytest.mark.slow


def test_the_step_times_read_from_a_job_s_events_are_the_ones_its_worker_measured(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="times",
        steps=40,
        min_workers=2,
        log_every=1,
        checkpoint_every=1000,
        compile_ahead=False,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    progress = {e["step"]: e for e in api.events(cfg.run_uri, ["progress"]) if e.get("attempt") == 1}
    assert sorted(progress) == list(range(1, 41))
    # Between two steps' events, the time the worker measured for the second (the agent reads its reports on
    # a 50 ms loop, and writes events from a thread of its own: timed by those, these differ by tens of ms).
    off = [abs((progress[s]["time"] - progress[s - 1]["time"]) - progress[s]["step_time"]) for s in range(5, 41)]
    assert statistics.median(off) < 0.003 and max(off) < 0.02, off
