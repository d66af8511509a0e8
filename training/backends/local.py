"""The embedded default backend: a job's host agents (and their workers) as processes on this machine."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Mapping
from typing import Any

from training import api
from training.api import Config, JobHandle, JobLook
from training.backends.base import ALIVE, Log, Provisioned, Released, Timeouts


def pid_alive(pid: int | None) -> bool:
    """Whether a local process runs (a zombie does not: it is reaped here when it is our child)."""
    if not pid:
        return False
    pid = int(pid)
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # our own child (a launch from this process): reap it
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        import psutil

        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except Exception:  # noqa: BLE001 - NoSuchProcess, AccessDenied: treat as gone only when it is gone
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


def stop_process_tree(pid: int) -> list[int]:
    """SIGKILL a process and everything under it (the local slice, its agents and their workers)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        children = parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    killed = []
    for proc in [parent, *children]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc.pid)
    for proc in [parent, *children]:
        pid_alive(proc.pid)  # reap ours
    psutil.wait_procs([parent, *children], timeout=10)
    return killed


class LocalSliceBackend:
    """The local slice: ``max_workers`` simulated hosts, one host agent each, kept running by the slice process."""

    name = "local"

    def __init__(self, log: Log | None = None, by: str = "Airflow") -> None:
        self.log = log
        self.by = by  # who provisions and tears down, in the records: Airflow, rtrain

    def _say(self, msg: str, *args: Any) -> None:
        if self.log is not None:
            self.log.info(msg, *args)

    def provision(self, cfg: Config, spec: Mapping[str, Any]) -> Provisioned:
        """Give the simulated slice its hosts: capacity = max_workers."""
        api.set_capacity(cfg.run_uri, cfg.max_workers, reason=f"provisioned by {self.by}", source=self.by.lower())
        return {"backend": self.name, "hosts": cfg.max_workers, "run_uri": cfg.run_uri}

    def launch(self, cfg: Config, spec: Mapping[str, Any], attempt: int) -> JobHandle:
        """Start a job, or follow the live one (``training.api.launch`` never starts over, never overwrites)."""
        handle = api.launch(cfg, detach=True, allow_attach=True)
        self._say(
            "%s job %s of %s",
            "Following the live" if handle.get("attached") else "Started",
            handle["job"],
            cfg.run_name,
        )
        return handle

    def poll(self, handle: Mapping[str, Any], timeouts: Timeouts, now: float | None = None) -> JobLook:
        """One look at the job; state is one of ALIVE, finished, failed.

        A job whose hosts are all gone is recorded failed (``training.api.repair_status``); one whose
        leader holds the lease but has not written its status for ``stale_after_s`` is failed here.
        """
        look = api.job_state(handle, timeouts.get("start_timeout_s", 300.0))
        st = look.get("status") or {}
        now = time.time() if now is None else now
        age = now - float(st.get("updated_at", now))
        if look["state"] in ALIVE and look["state"] != "pending" and age > timeouts.get("stale_after_s", 900.0):
            return {**look, "state": "failed", "reason": f"no status update for {age:.0f}s while {look['state']}"}
        return look

    def stop(self, handle: Mapping[str, Any], reason: str) -> None:
        """Ask the job's leader to end the job at a step boundary."""
        api.stop_job(str(handle["run_uri"]), reason)

    def release(self, cfg: Config, spec: Mapping[str, Any], handles: list[Mapping[str, Any]]) -> Released:
        """Stop the jobs of ``handles`` still running (their leader ends them), kill what is left here, give the hosts back."""

        def running(job: str) -> bool:
            look = api.job_state({"run_uri": cfg.run_uri, "job": job, "launched_at": time.time()})
            return look["state"] in ALIVE and look["state"] != "pending"

        live = [job for job in {str(h["job"]) for h in handles if h.get("job")} if running(job)]
        for job in live:
            api.stop_job(cfg.run_uri, f"stopped by the {self.by} teardown (job {job})")
        deadline = time.time() + 3 * cfg.lease_s + 5
        while live and time.time() < deadline:
            live = [job for job in live if running(job)]
            time.sleep(0.5)
        pids = {
            int(h["controller_pid"])
            for h in handles
            if h.get("controller_pid")
            and h.get("host") == socket.gethostname()
            and int(h["controller_pid"]) != os.getpid()
        }
        pids |= set(api.local_job_pids(cfg.run_uri))
        stopped: list[int] = []
        for pid in sorted(pids):
            if pid_alive(pid):
                stopped.extend(stop_process_tree(pid))
        api.release_capacity(cfg.run_uri, f"released by the {self.by} teardown", source=self.by.lower())
        return {"backend": self.name, "stopped_pids": stopped, "released": True}
