"""The shared pool's scheduler process: the service's scheduler, launching each placed run through its backend.

``rtrain submit`` (and a DAG run with a priority) starts it for a storage root, by module name; it
places the root's submitted runs on the pool's hosts and goes once none is left to place.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping
from typing import Any

from training.backends import Context, backend_for
from training.backends.spec import JobSpec, placement
from training.config import Config
from training.service.scheduler import Launched, Scheduler, serve


def launch(cfg: Config, attempt: int) -> Launched:
    """Launch a placed run's job through the backend its config names (a live job of the run is adopted)."""
    job = JobSpec(cfg, placement(cfg.placement.backend))
    handle: Mapping[str, Any] = backend_for(job, Context(by="scheduler")).launch(job, attempt)
    return Launched(str(handle["job"]), int(handle.get("controller_pid") or 0))  # a slice's process, if it has one


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.backends.pool_scheduler")
    p.add_argument("root", help="the storage root whose submitted runs this places")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return serve(Scheduler(args.root, launch))


if __name__ == "__main__":
    sys.exit(main())
