"""``rtrain train --gke`` and ``rtrain plan --gke``: a ``backend: gke`` run from a workstation (docs/gke.md)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from training.cli_common import Exit, Progress, readied

if TYPE_CHECKING:
    from training.config import Config
    from training.gke import GKESettings


def gke_config(args: argparse.Namespace, gke: GKESettings) -> Config:
    """A ``backend: gke`` run's config, readied as Airflow's resolve task readies it: hosts per slice and chips per
    host from the TPU type and the notice's commit fitted to the pods' grace, unless given; then all the JobSet's
    render would refuse, in one line, before billing."""
    return readied(args, "gke", gke, ["placement.backend=gke"])


def train_gke(args: argparse.Namespace) -> int:
    """``rtrain train --gke FILE``: node pools, the JobSet, the job followed, then both deleted (docs/gke.md)."""
    from training.backends.gke_run import GKERun, load_settings

    gke = load_settings(args.gke)
    cfg = gke_config(args, gke)
    run = GKERun(cfg, gke)
    run.check()  # the config against the TPU shape, the credentials, the project, the cluster: before any billing
    progress = Progress(cfg.optimizer.steps)
    progress.line(f"run {cfg.run_name} at {cfg.run_uri} on GKE cluster {gke['cluster_name']} ({gke['location']})")
    try:  # node pools made are given back however this ends (not a detached job's, nor one out of touch)
        look = run.drive(progress.line, progress.status, detach=args.detach)
    finally:
        progress.close()
    if look is None:  # detached, or out of touch with a job that may still run (said above)
        return Exit.OK if args.detach else Exit.ERROR
    return gke_exit(look, cfg.optimizer.steps)


def gke_exit(look: Mapping[str, Any], steps: int) -> int:
    """The exit code of a followed GKE job's last look, said in one line: 0 finished, 7 stopped or cancelled, 1 failed."""
    st = look.get("status") or {}
    if look["state"] == "finished":
        print(f"finished: step {st.get('step')}/{steps}, loss {st.get('loss')}")
        return Exit.OK
    print(f"rtrain: the job {look['state']}: {look.get('reason') or 'see the events'}", file=sys.stderr)
    return Exit.STOPPED if look["state"] in ("stopped", "cancelled") else Exit.FAILED
