"""The agent's fork server: workers forked with their libraries imported, as the agent's own children (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.elastic.host.workerproc import ForkServer, spawn_worker

pytestmark = pytest.mark.usefixtures("not_a_subreaper_after")


def _env(run: Path) -> dict[str, str]:
    return {
        **os.environ,
        "RTRAIN_RUN_URI": str(run),  # a run root without a config: the worker fails its warm-up, after its imports
        "RTRAIN_AGENT_PID": str(os.getpid()),
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
    }


def _reaped(pid: int) -> tuple[int, float]:
    """Wait for our child ``pid``: its exit code and the CPU it spent (only a child can be waited for so)."""
    _, status, usage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime


def test_a_forked_worker_is_this_process_s_child_and_skips_the_imports_a_started_one_pays(tmp_path):
    env = _env(tmp_path / "run")
    (tmp_path / "run").mkdir()
    server = ForkServer.start(env, tmp_path / "forkserver.log")
    try:
        forked = spawn_worker(env, tmp_path / "forked.log", server=server)
        assert forked.proc.poll() is None  # asked for while the server imports: no answer yet, and no error
        while forked.proc.pid is None:  # type: ignore[attr-defined]
            server.answers(block=True)
        pid = forked.proc.pid  # type: ignore[attr-defined]
        code, forked_cpu = _reaped(pid)  # ours to reap: the server's child left it to this process
        started = spawn_worker(env, tmp_path / "started.log")
        code_started, started_cpu = _reaped(started.proc.pid)  # type: ignore[attr-defined]
    finally:
        server.close()
    assert code == code_started == 1, ((tmp_path / "forked.log").read_text(), (tmp_path / "started.log").read_text())
    for log in ("forked.log", "started.log"):  # both got as far as the run's config, and said so in their logs
        assert "config.json" in (tmp_path / log).read_text()
    print(f"forked {forked_cpu:.2f} s of CPU, started {started_cpu:.2f} s")
    assert forked_cpu < 0.3 * started_cpu, (forked_cpu, started_cpu)


def test_a_server_that_is_gone_answers_its_pending_requests_with_a_failure_and_workers_start_on_their_own(tmp_path):
    env = _env(tmp_path / "run")
    (tmp_path / "run").mkdir()
    server = ForkServer.start(env, tmp_path / "forkserver.log")
    pending = spawn_worker(env, tmp_path / "w1.log", server=server)
    server.proc.kill()  # while it imports: the request it took is never answered
    assert pending.proc.wait() == 1 and not server.alive
    fallback = spawn_worker(env, tmp_path / "w2.log", server=server)
    assert type(fallback.proc).__name__ == "Popen"
    assert fallback.proc.wait() == 1 and "config.json" in (tmp_path / "w2.log").read_text()
    server.close()


def test_a_forked_worker_knows_it_is_the_agent_s_child_at_once_when_its_middle_process_left_first(tmp_path):
    # A process whose parent already is the one it waits for: the case where the middle process left before
    # the worker looked (a wait keyed on the parent it saw first waited out its whole timeout there).
    code = (
        "import os, sys, time\n"
        "from training.elastic.worker.forkserver import wait_for_parent\n"
        "t = time.monotonic()\n"
        "ok = wait_for_parent(os.getppid(), 30)\n"
        "print(ok, time.monotonic() - t < 5, wait_for_parent(os.getppid() + 1_000_000, 0.2))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "False"], out


def test_no_forked_worker_waits_to_become_this_process_s_child(tmp_path):
    env = _env(tmp_path / "run")
    (tmp_path / "run").mkdir()
    server = ForkServer.start(env, tmp_path / "forkserver.log")
    try:
        workers = [spawn_worker(env, tmp_path / f"w{i}.log", server=server) for i in range(12)]
        assert [w.proc.wait() for w in workers] == [1] * 12
    finally:
        server.close()
    logs = "".join((tmp_path / f"w{i}.log").read_text() for i in range(12))
    assert "config.json" in logs and "not the agent's child" not in logs
