"""A round's start on the local slice: one compile per round, standbys that warm up in the idle class, one session.

Real jobs: host agents, standby workers, real JAX processes joined by gloo.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from jobs import hosts, job_config, kill_host, run_job, start_job, wait_finished, wait_for, worker_logs

from training import api
from training.background import BACKGROUND_NICE
from training.elastic.worker.warmup import WARM_UP_THREAD
from training.storage import open_store

pytestmark = pytest.mark.slow

SCHED_IDLE = 5


def _events(run_uri: str, type_: str) -> list[api.Event]:
    return api.events(run_uri, [type_])


def test_a_round_compiles_or_looks_up_its_programs_once_and_passes_them_on_whole_cold_or_warm(tmp_path, tiny_dataset):
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
    # Process 0 compiled the init and the step and passed them on; process 1 waited for the keys process 0
    # announced, found neither in the cache, and loaded both without lowering them; it compiled only the
    # round's small programs (a barrier, the batch's assembly).  Each compiling for itself, they spend about
    # the same.
    assert cpu[1] < 0.6 * cpu[0], cpu
    for program in ("init", "step"):
        assert f"process 1: {program} loaded as process 0 passed it on, not lowered here" in worker_logs(cfg.run_uri)

    # The same job again, the cache warm now: process 0's compile is a lookup, and it passes on what it looked
    # up, serialized whole from the cache's own entry (an executable loaded from the cache lacks its code when
    # serialized on CPU): process 1 neither lowers nor looks up anything, and the job runs on what it loaded.
    warm = job_config(str(tmp_path), tiny_dataset, cache, run_name="warm", steps=6, min_workers=2, compile_ahead=False)
    assert run_job(warm) == 0, worker_logs(warm.run_uri)
    [compiled] = _events(warm.run_uri, "compiled")
    assert compiled["cache_hit"] is True
    logs = worker_logs(warm.run_uri)
    for program in ("init", "step"):
        assert f"round 1 process 1: {program} loaded as process 0 passed it on, not lowered here" in logs, logs
    assert "passed none on" not in logs
    said = re.findall(r"round 1 process (\d): step \d+ done .* with ([\d.]+)s of CPU", logs)
    warm_cpu = {int(p): float(s) for p, s in said}
    assert warm_cpu[1] < 0.8 * warm_cpu[0], warm_cpu


@pytest.mark.extended
def test_a_size_compiled_ahead_by_an_earlier_job_is_looked_up_and_kept_not_compiled_again(tmp_path, tiny_dataset):
    """The second job of the same program finds the 1-host step in the cache, noted by the first job's compile
    ahead, and reports it so; it looks it up (no compile) and keeps it, so that a recovery loads it."""
    cache = str(tmp_path / "jax-cache")  # its own: the first job's compile ahead is a real one
    seen = []
    for name in ("first", "second"):
        cfg = job_config(str(tmp_path), tiny_dataset, cache, run_name=name, steps=200, min_workers=1, max_workers=2)
        handle = start_job(cfg)
        run_uri = cfg.run_uri
        [ahead] = wait_for(lambda: _events(run_uri, "compiled_ahead"), 300, "the 1-host step ahead")  # noqa: B023
        st = wait_finished(handle)
        assert st["state"] == "finished", worker_logs(cfg.run_uri)
        seen.append(ahead)
        # Compiling ahead starts once the round's first step was read, never on the round's busy start.
        order = [e["type"] for e in api.events(run_uri, ["resumed", "compiled_ahead"]) if e.get("attempt") == 1]
        assert order.index("resumed") < order.index("compiled_ahead"), order
    first, second = seen
    assert first["workers"] == second["workers"] == 1
    assert not first.get("already") and first["seconds"] > 0.5, first  # traced, lowered and compiled
    assert second["already"] is True, second  # traced, lowered and found in the cache
    assert "is in the compilation cache already" in api.describe(second)
    kept = open_store(cfg.run_uri).list("compiled/")
    assert any(k.endswith("/step-1.bin") for k in kept), f"kept for a recovery to load: {kept}"


def _threads(pid: int) -> list[tuple[int, int, str]]:
    """Each thread of ``pid``: (thread id, scheduling policy, OS name)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        out.append((int(tid), int(fields[38]), name))  # field 41 of stat: the policy
    return out


def _processes(run_uri: str) -> list[int]:
    """This run's processes now (agents, fork servers, workers): every process of a host's process group."""
    groups = set(_agents(run_uri))
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(_stat(int(pid))[2]) in groups:
                found.append(int(pid))
        except (OSError, ValueError):
            continue
    return found


def _agents(run_uri: str) -> list[int]:
    """The agents running now, by the pid their heartbeat gives (an agent leads its host's process group)."""
    pids = []
    for r in hosts(run_uri).values():
        try:
            if r.state != "gone" and os.getpgid(r.pid) == r.pid:
                pids.append(r.pid)
        except ProcessLookupError:
            continue
    return sorted(pids)


def _nice(tid: int) -> int:
    with open(f"/proc/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of stat: the thread's niceness


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
        # An agent takes the CPU the steps leave: each of its threads lowered (it forked its fork server first).
        assert {_nice(tid) for tid, _, _ in _threads(pid)} == {BACKGROUND_NICE}

    def idle_standby() -> tuple[int, list[tuple[int, int, str]]] | None:
        for pid in _processes(cfg.run_uri):
            try:
                threads = _threads(pid)
            except OSError:
                continue
            if any(name == WARM_UP_THREAD and policy == SCHED_IDLE for _, policy, name in threads):
                return pid, threads
        return None

    pid, threads = wait_for(idle_standby, 120, "a standby warming up in the idle class", every=0.05)
    assert {tid: policy for tid, policy, _ in threads}[pid] == 0, (
        "its main thread, which runs the round, keeps its class"
    )
    assert _nice(pid) == 0, "and its priority: a worker is forked by its host's fork server, not by the agent"
    st = wait_finished(handle)
    assert st["state"] == "finished" and st["step"] == 40, worker_logs(cfg.run_uri)


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # from field 3 (state) on


def _fork_servers(run_uri: str) -> list[int]:
    """This run's fork servers now: each agent's oldest child (its forked workers are its children too)."""
    by_agent: dict[int, int] = {}
    for agent in _agents(run_uri):
        for pid in _processes(run_uri):
            try:
                if int(_stat(pid)[1]) != agent:
                    continue
                if agent not in by_agent or int(_stat(pid)[19]) < int(_stat(by_agent[agent])[19]):
                    by_agent[agent] = pid
            except (OSError, ValueError):
                continue
    return sorted(by_agent.values())


@pytest.mark.extended
def test_a_job_s_workers_are_forked_by_a_server_per_agent_and_a_lost_server_costs_only_the_imports(
    tmp_path, tiny_dataset, jax_cache
):
    cfg = job_config(str(tmp_path), tiny_dataset, jax_cache, run_name="forked", steps=100, min_workers=2)
    handle = start_job(cfg)

    def warmed_standby() -> int | None:
        for pid in _processes(cfg.run_uri):
            try:
                if any(name == WARM_UP_THREAD for _, _, name in _threads(pid)):
                    return pid
            except OSError:
                continue
        return None

    standby = wait_for(warmed_standby, 120, "a standby warming up", every=0.02)
    agents = _agents(cfg.run_uri)
    assert int(_stat(standby)[1]) in agents, "the agent is its parent: it reaps it and reads its exit code"
    assert "training.elastic.worker.main" not in Path(f"/proc/{standby}/cmdline").read_text()  # forked, not started
    servers = _fork_servers(cfg.run_uri)
    assert len(servers) == 2
    # One template forked both agents, and each agent forked its server from itself: nothing imported twice.
    [template] = {int(_stat(pid)[1]) for pid in agents}
    assert Path(f"/proc/{template}/cmdline").read_text().startswith(f"rtrain template {cfg.run_uri} ")
    for pid in servers:
        cpu = (int(_stat(pid)[11]) + int(_stat(pid)[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        assert cpu < 0.3, f"fork server {pid} spent {cpu:.2f} s of CPU: it imported its libraries itself"
    st = wait_finished(handle)
    assert st["state"] == "finished" and st["step"] == 100, worker_logs(cfg.run_uri)

    # The template lost: a host's agent lost after it starts as a process of its own, and the job goes on.
    alone = job_config(str(tmp_path), tiny_dataset, jax_cache, run_name="alone", steps=60, min_workers=2)
    handle = start_job(alone)
    agents = wait_for(lambda: len(_agents(alone.run_uri)) == 2 and _agents(alone.run_uri), 60, "the two agents")
    os.kill(int(_stat(agents[0])[1]), 9)
    wait_for(lambda: (api.status(alone.run_uri) or {}).get("step", 0) >= 5, 120, "training")
    lost_pid = kill_host(alone.run_uri, "h1")
    again = wait_for(lambda: hosts(alone.run_uri)["h1"].pid != lost_pid and hosts(alone.run_uri)["h1"].pid, 60, "h1")
    assert Path(f"/proc/{again}/cmdline").read_text().startswith(f"rtrain agent h1 {alone.run_uri} ")
    parent = Path(f"/proc/{_stat(again)[1]}/cmdline").read_text()
    assert "training.elastic.local.template" not in parent and "rtrain template" not in parent  # started, not forked
    st = wait_finished(handle)
    assert st["state"] == "finished" and st["step"] == 60, worker_logs(alone.run_uri)

    # Fork servers lost at the job's start: its workers start as processes of their own, and the job goes on.
    lost = job_config(str(tmp_path), tiny_dataset, jax_cache, run_name="lost", steps=40, min_workers=2)
    handle = start_job(lost)
    servers = wait_for(lambda: len(_fork_servers(lost.run_uri)) == 2 and _fork_servers(lost.run_uri), 60, "servers")
    for pid in servers:
        os.kill(pid, 9)
    st = wait_finished(handle)
    assert st["state"] == "finished" and st["step"] == 40, worker_logs(lost.run_uri)
    assert "fork server" in worker_logs(lost.run_uri)
