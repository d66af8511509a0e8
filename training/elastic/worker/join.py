"""A worker joining its round: ``jax.distributed``, the peer watch, the round's mesh, trainer and checkpoint
manager (and the task, where the standby could not build it).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from training.elastic.wire import ReportType
from training.elastic.worker.cpu_slice import TransportThreads
from training.elastic.worker.link import Assignment, Reporter, watch_peers

if TYPE_CHECKING:
    from training.checkpoint.manager import FailFastManager
    from training.config import Config
    from training.elastic.worker.taskbuild import Built
    from training.trainer import Trainer

JOIN_S = 120  # how long a process of a round has to join it (jax.distributed), from its set-up on


def wait_until_listening(address: str, timeout: float) -> bool:
    """Wait until something accepts connections at ``host:port`` (process 0's coordination service); False if
    nothing did in ``timeout`` s.

    A process that calls ``jax.distributed.initialize`` before process 0 listens is refused, and its client
    tries again only after gRPC's reconnect backoff (about a second): the whole round then starts that much
    later.  Dialling until the port answers, then initialising, joins within milliseconds of process 0.
    """
    import socket

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return True
        except OSError:  # refused, or the name does not resolve yet
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)


def set_up(
    cfg: Config, run: str, a: Assignment, rep: Reporter, built: Built | None, t_assigned: float
) -> tuple[Trainer, FailFastManager, Built]:
    """Join the round (``jax.distributed``, the peer watch) and build its mesh, trainer and checkpoint manager;
    the task too, if the standby left it (``built`` None: it reaches for JAX's backend); those and the task.

    On a CPU slice, the collectives' transport threads (started with the backend) get the lowest priority.
    """
    import jax

    from training import trainer as tr
    from training.checkpoint import manager as ckpt
    from training.elastic.worker import taskbuild
    from training.mesh import build_mesh, check_batch, plan_mesh

    os.environ.update(dict(a.env))  # e.g. MEGASCALE_* for TPU multislice: read when the backend starts, below
    transport = None
    if a.processes > 1:
        # JAX's own preemption notifier would take SIGTERM from our handler (Notice): the notice reaches the
        # whole group through the next step's flags instead, with no extra synchronisation per step.
        jax.config.update("jax_enable_preemption_service", False)
        deadline = time.monotonic() + JOIN_S  # one deadline for dialling process 0 and joining through it
        if a.rank != 0:
            wait_until_listening(a.coordinator, timeout=JOIN_S)
        jax.distributed.initialize(
            a.coordinator,
            a.processes,
            a.rank,
            coordinator_bind_address=a.bind or None,  # process 0 listens on this host's address only
            heartbeat_timeout_seconds=10,
            initialization_timeout=max(1, round(deadline - time.monotonic())),
            # The round says every process's place: JAX must not probe the cluster for it (in a pod it would
            # ask the Kubernetes API, which needs a service account token and pod-reading rights).
            cluster_detection_method="deactivate",
        )
        watch_peers(a, rep)
        transport = TransportThreads()  # before the backend starts (build_mesh): gloo's threads come with it
    if taskbuild.lift_fence():  # something reached for the backend in the standby: the task is built again
        built = None
    from training.gke.worker_env import is_round_env

    rep.send(
        ReportType.WORKER_STARTED,
        everyone=True,
        seconds=time.time() - t_assigned,
        host=os.environ.get("RTRAIN_HOST"),
        pid=os.getpid(),
        # The TPU identity and Multislice values the runtime started with (this round's, none left of another).
        runtime_env={k: v for k, v in sorted(os.environ.items()) if is_round_env(k)},
    )
    plan = plan_mesh(cfg.placement, a.processes)
    check_batch(cfg.optimizer, cfg.checkpoint, plan)
    mesh = build_mesh(plan)
    if transport is not None and mesh.devices.flat[0].platform == "cpu":  # another platform's threads are its own
        transport.lower()
    if built is None:  # the task reached for JAX's backend in the standby: now that the round has joined, it may
        t0 = time.perf_counter()
        built = taskbuild.build(cfg)
        print(
            f"round {a.round} process {a.rank}: the task reached for JAX in the standby: built after the join, "
            f"in {time.perf_counter() - t0:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    return tr.Trainer(cfg.optimizer, mesh, built.task), ckpt.checkpoint_manager(cfg, run), built
