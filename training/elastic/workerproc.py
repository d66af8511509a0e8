"""A host's worker process: started as a standby, read through its report pipe, killed.

The agent starts one worker at a time ahead of need (a standby that imports JAX, reads the
config and opens the dataset), hands it a round, reads its reports (one JSON object a line on a
pipe of its own) and kills it when the round is over for this host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.config import Config
from training.elastic.rendezvous import Round
from training.elastic.wire import WorkerReport, decode

log = logging.getLogger("rtrain.agent")


@dataclass
class WorkerProc:
    """A worker process: a standby until assigned, then this round's worker."""

    proc: subprocess.Popen[bytes]
    fd: int
    log: Path
    round: int = -1
    rank: int = -1
    buf: bytes = b""
    eof: bool = False
    seen: dict[str, Any] = field(default_factory=dict)  # finished / rescale / guard / corrupt / error / chaos
    plan: Round | None = None  # the round it was assigned

    @property
    def assigned(self) -> bool:
        return self.round >= 0

    def kill(self) -> None:
        """Kill the process (if it still runs), reap it and close its pipes."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        self.proc.wait()
        if not self.eof:
            self.eof = True
            os.close(self.fd)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def read(self, host: str) -> list[WorkerReport]:
        """The whole reports that arrived since the last read (without waiting)."""
        if self.eof:
            return []
        chunks = []
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                os.close(self.fd)
                break
            chunks.append(chunk)
        self.buf += b"".join(chunks)
        *lines, self.buf = self.buf.split(b"\n")
        out = []
        for line in lines:
            if line.strip():
                try:
                    out.append(decode(line))
                except ValueError as e:
                    log.warning("[%s] unreadable report from the worker (%s): %r", host, e, line[:200])
        return out


def spawn_worker(
    cfg: Config, run_uri: str, host: str, job: str, log_path: Path, background: bool = False
) -> WorkerProc:
    """Start a standby worker of ``host`` for ``job``, its output going to ``log_path``.

    ``background``: it warms up at the lowest priority, beside a round training on this host.
    """
    from training.gke.manifests import worker_base_env  # without a round's TPU variables: the round sets them

    r, w = os.pipe()
    env = {
        **worker_base_env(os.environ),
        "RTRAIN_RUN_URI": run_uri,
        "RTRAIN_HOST": host,
        "RTRAIN_JOB": job,
        "RTRAIN_CONTROL_FD": str(w),
        "RTRAIN_AGENT_PID": str(os.getpid()),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONUNBUFFERED": "1",
        "RTRAIN_WARM_BACKGROUND": "1" if background else "0",
    }
    if cfg.backend == "local":
        # The local slice: each simulated host is a JAX process with D CPU devices, gloo collectives.
        env.update(
            {
                "JAX_PLATFORMS": "cpu",
                "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={cfg.devices_per_worker}",
            }
        )
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "training.elastic.worker"],
            env=env,
            pass_fds=(w,),
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    os.close(w)
    os.set_blocking(r, False)
    return WorkerProc(proc, r, log_path)
