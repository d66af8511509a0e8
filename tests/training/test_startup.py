"""A round's start on the local slice: one compile per round, standbys that warm up in the idle class, one session.

Real jobs: host agents, standby workers, real JAX processes joined by gloo.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from jobs import job_config, run_job, start_job, wait_finished, wait_for, worker_logs

from training import api

pytestmark = pytest.mark.slow

SCHED_IDLE = 5


def _events(run_uri: str, type_: str) -> list[api.Event]:
    return api.events(run_uri, [type_])


def test_a_cold_round_compiles_its_step_once_and_a_warm_one_looks_it_up_in_every_process_at_once(tmp_path, tiny_dataset):
    # A cache of its own: nothing in it, so every process of the first round misses.
    cache = str(tmp_path / "jax-cache")
    cfg = job_config(str(tmp_path), tiny_dataset, cache, run_name="once", steps=6, min_workers=2, compile_ahead=False)
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    [compiled] = _events(cfg.run_uri, "compiled")
    assert compiled["cache_hit"] is False  # a miss: the case where every process would compile
    # Each process says in its log how much CPU it spent from its assignment to its round's first step.
    said = re.findall(r"round 1 process (\d): step \d+ done .* with ([\d.]+)s of CPU", worker_logs(cfg.run_uri))
    cpu = {int(p): float(s) for p, s in said}
    assert sorted(cpu) == [0, 1], said
    [resumed] = _events(cfg.run_uri, "resumed")  # rank 0's, on record
    assert resumed["cpu_s"] == pytest.approx(cpu[0], abs=0.1)
    # Process 0 compiled the init and the step and passed them on; process 1 loaded both and compiled only
    # the round's small programs (a barrier, the batch's assembly).  Each compiling for itself, they spend
    # about the same.
    assert cpu[1] < 0.6 * cpu[0], cpu
    assert "loaded as process 0 compiled it" in worker_logs(cfg.run_uri)

    # The same job again, the cache warm now: process 0's compile is a lookup, and process 1 makes its own
    # lookup beside it instead of waiting for process 0 to say it had nothing to pass on.
    warm = job_config(str(tmp_path), tiny_dataset, cache, run_name="warm", steps=6, min_workers=2, compile_ahead=False)
    assert run_job(warm) == 0, worker_logs(warm.run_uri)
    [compiled] = _events(warm.run_uri, "compiled")
    assert compiled["cache_hit"] is True
    logs = worker_logs(warm.run_uri)
    for program in ("init", "step"):
        assert f"round 1 process 1: {program} compiled at once: the cache holds it" in logs, logs
    assert "passed none on" not in logs and "loaded as process 0" not in logs


def _threads(pid: int) -> list[tuple[int, int]]:
    """Each thread of ``pid``: (thread id, scheduling policy)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out.append((int(tid), int(fields[38])))  # field 41 of stat: the policy
    return out


def _workers(run_uri: str) -> dict[int, str]:
    """This run's worker processes now: pid -> how the agent asked it to warm up ("1": in the background)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if env.get("RTRAIN_RUN_URI") == run_uri and "RTRAIN_WARM_BACKGROUND" in env:
            found[int(pid)] = env["RTRAIN_WARM_BACKGROUND"]
    return found


def _agents(run_uri: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue
        if "training.elastic.agent" in cmd and run_uri in cmd:
            pids.append(int(pid))
    return pids


def test_standbys_started_beside_a_round_warm_up_in_the_idle_class_and_the_hosts_share_a_session(
    tmp_path, tiny_dataset, jax_cache
):
    cfg = job_config(str(tmp_path), tiny_dataset, jax_cache, run_name="idle", steps=40, min_workers=2)
    handle = start_job(cfg)
    # The hosts' processes are in the local slice's session: the scheduler weighs their threads against
    # each other by priority, as on one host, instead of giving each simulated host a fair share.
    agents = wait_for(lambda: len(_agents(cfg.run_uri)) == 2 and _agents(cfg.run_uri), 60, "the two agents")
    for pid in agents:
        assert os.getpgid(pid) == pid, "each host is its own process group (killed whole)"
        assert os.getsid(pid) == os.getsid(int(handle["controller_pid"]))

    def idle_standby() -> tuple[int, list[tuple[int, int]]] | None:
        for pid, background in _workers(cfg.run_uri).items():
            try:
                threads = _threads(pid)
            except OSError:
                continue
            if background == "1" and any(policy == SCHED_IDLE for _, policy in threads):
                return pid, threads
        return None

    pid, threads = wait_for(idle_standby, 120, "a standby warming up in the idle class", every=0.05)
    assert dict(threads)[pid] == 0, "its main thread, which runs the round once assigned, keeps its class"
    st = wait_finished(handle)
    assert st["state"] == "finished" and st["step"] == 40, worker_logs(cfg.run_uri)
