"""The embedded default backend: a job's host agents (and their workers) as processes on this machine."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from training import api
from training.api import Config, JobLook, RunStatus
from training.backends.base import ALIVE, LocalHandle, Log, Provisioned, Released, Timeouts
from training.backends.spec import JobSpec


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


def launch(
    cfg: Config,
    *,
    allow_attach: bool = False,
    provision: bool = False,
    by: str | None = None,
    on_line: Callable[[str], None] | None = None,
) -> LocalHandle:
    """Start a job of the run on the local slice, in a process of its own; never starts over, never overwrites.

    ``allow_attach``: when a live job holds the run, follow it instead of refusing (``attached``).
    ``provision``: give the slice its ``max_workers`` hosts, under the run lock (``rtrain train``).
    ``by``: who launches (Airflow, rtrain, the scheduler), for the config's history beside the user, host and pid.
    """
    from training.elastic.local.local_slice import spawn

    begun = api.begin_or_follow(cfg, allow_attach=allow_attach, provision=provision, by=by, on_line=on_line)
    handle = _handle(cfg, begun)
    if not begun["attached"]:
        handle["controller_pid"] = spawn(cfg, begun["job"])
    return handle


def run_here(
    cfg: Config,
    *,
    provision: bool = False,
    by: str | None = None,
    on_line: Callable[[str], None] | None = None,
    on_status: Callable[[RunStatus], None] | None = None,
) -> tuple[LocalHandle, int]:
    """Run a job of the run on the local slice in this process, to its end; its handle and exit code (0: finished).

    Ctrl-C asks the job to stop at a step boundary and waits for it.  Refused (``LaunchRefused``) while
    another job holds the run.
    """
    from training.elastic.local.local_slice import LocalSlice

    begun = api.begin_or_follow(cfg, provision=provision, by=by, on_line=on_line)
    handle = _handle(cfg, begun)
    handle["controller_pid"] = os.getpid()
    slice_ = LocalSlice(cfg, begun["job"], on_line=on_line, on_status=on_status)
    try:
        rc = slice_.run()
    except KeyboardInterrupt:
        slice_.stop("interrupted (Ctrl-C)")
        rc = slice_.run()
    return handle, rc


def _handle(cfg: Config, begun: api.Begun) -> LocalHandle:
    return LocalHandle(
        backend="local",
        run_uri=cfg.run_uri,
        job=begun["job"],
        attached=begun["attached"],
        host=socket.gethostname(),
        launched_at=time.time(),
        events_after=begun["events_after"],
    )


class LocalSliceBackend:
    """The local slice: ``max_workers`` simulated hosts, one host agent each, kept running by the slice process."""

    name = "local"

    def __init__(
        self, log: Log | None = None, by: str = "Airflow", *, provision: bool = False, follow: bool = True
    ) -> None:
        self.log = log
        self.by = by  # who provisions, launches and tears down, in the records: Airflow, rtrain, scheduler
        self.provision_at_launch = provision  # the slice's hosts given at launch, under the run lock (rtrain train)
        self.follow = follow  # a live job that holds the run is followed; False: refused (LaunchRefused)
        # rtrain train in the foreground: the job was followed to its end and its hosts given at launch, so a release
        # lets the slice process leave on its own first and leaves the hosts to the run
        self.settle = provision

    def _say(self, msg: str, *args: Any) -> None:
        if self.log is not None:
            self.log.info(msg, *args)

    def provision(self, job: JobSpec) -> Provisioned:
        """Give the simulated slice its hosts: capacity = max_workers (at launch, under the run lock, when so made)."""
        cfg = job.config
        if self.provision_at_launch:
            return {"backend": self.name, "hosts": cfg.elastic.max_workers, "run_uri": cfg.run_uri}
        api.set_capacity(
            cfg.run_uri, cfg.elastic.max_workers, reason=f"provisioned by {self.by}", source=self.by.lower()
        )
        return {"backend": self.name, "hosts": cfg.elastic.max_workers, "run_uri": cfg.run_uri}

    def launch(self, job: JobSpec, attempt: int) -> LocalHandle:
        """Start a job, or follow the live one (:func:`launch` never starts over, never overwrites)."""
        cfg = job.config
        handle = launch(cfg, allow_attach=self.follow, provision=self.provision_at_launch, by=self.by)
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

    def release(self, job: JobSpec, handles: Sequence[Mapping[str, Any]]) -> Released:
        """Stop the jobs of ``handles`` still running (their leader ends them), kill what is left here, give the hosts back."""
        cfg = job.config

        def running(job_id: str) -> bool:
            look = api.job_state({"run_uri": cfg.run_uri, "job": job_id, "launched_at": time.time()})
            return look["state"] in ALIVE and look["state"] != "pending"

        live = [j for j in {str(h["job"]) for h in handles if h.get("job")} if running(j)]
        for j in live:
            api.stop_job(cfg.run_uri, f"stopped by the {self.by} teardown (job {j})")
        deadline = time.time() + cfg.stop_allowance_s
        while live and time.time() < deadline:
            live = [j for j in live if running(j)]
            time.sleep(0.5)
        pids = {
            int(h["controller_pid"])
            for h in handles
            if h.get("controller_pid")
            and h.get("host") == socket.gethostname()
            and int(h["controller_pid"]) != os.getpid()
        }
        if not self.settle:  # (a teardown also kills what is left of the run's jobs; rtrain train only its own)
            pids |= set(api.local_job_pids(cfg.run_uri))
        while self.settle and any(pid_alive(pid) for pid in pids) and time.time() < deadline + 10:
            time.sleep(0.2)  # the ended job's slice stops its agents and leaves
        stopped: list[int] = []
        for pid in sorted(pids):
            if pid_alive(pid):
                stopped.extend(stop_process_tree(pid))
        if not self.settle:
            api.release_capacity(cfg.run_uri, f"released by the {self.by} teardown", source=self.by.lower())
        return {"backend": self.name, "stopped_pids": stopped, "released": True}
