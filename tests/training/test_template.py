"""The local slice's template: agents forked from one process that imported once (real processes, real forks)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from training.elastic.local.template import Template


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def _gone(pid: int, timeout: float) -> bool:
    """Has ``pid`` left the process table (exited and reaped) within ``timeout``?"""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_an_agent_forked_by_the_template_runs_the_agent_s_command_and_is_reaped_by_the_template(tmp_path):
    template = Template("/runs/x", "job-1", _env(), tmp_path / "template.log")
    try:
        logs: list[str] = []
        for argv in (["--help"], [str(tmp_path / "no-run"), "--job", "job-1", "--host", "h0"]):
            log = tmp_path / f"agent-{len(logs)}.log"
            with open(log, "ab") as out:
                agent = template.fork(argv, _env(), out.fileno())
            assert agent is not None, (tmp_path / "template.log").read_text()
            agent.wait()  # through its pidfd: the template is its parent, not this process
            assert not agent.running()
            # The template reaps it (and the fork server it forked at its start, which dies with it).
            assert _gone(agent.pid, 10), f"process {agent.pid} left a zombie"
            logs.append(log.read_text())
    finally:
        template.close()
    assert "usage: rtrain agent" in logs[0]  # the agent's own command line, parsed in the fork
    assert "config.json" in logs[1] and "Traceback" in logs[1], logs[1]  # its error goes to its log


def test_a_template_that_is_gone_forks_nothing_and_the_slice_starts_agents_on_their_own(tmp_path, caplog):
    template = Template("/runs/x", "job-1", _env(), tmp_path / "template.log")
    template.proc.kill()
    template.proc.wait()
    with open(tmp_path / "agent.log", "ab") as out:
        assert template.fork(["--help"], _env(), out.fileno()) is None
    assert not template.alive
    assert "agents start as processes of their own" in caplog.text
    template.close()  # closing a template that is gone is fine
