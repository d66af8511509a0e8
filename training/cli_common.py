"""What the ``rtrain`` commands share: exit codes, the config from the arguments, a run's URI, the progress line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from training.config import dotted, load_config
from training.events import RunStatus

if TYPE_CHECKING:
    from training.config import Config


class Exit(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    CONFIG = 3
    NOT_FOUND = 4
    REFUSED = 5
    ERROR = 6
    STOPPED = 7  # the job was stopped by a person (rtrain stop, a cancel, a teardown): resumable


class NotFoundError(LookupError):
    pass


def config(args: argparse.Namespace, extra: list[str] | None = None) -> Config:
    overrides = list(args.overrides)
    if getattr(args, "chaos", None):
        overrides.append("elastic.chaos=" + json.dumps(args.chaos))
    return load_config(args.preset, args.config, overrides + (extra or []))


def readied(
    args: argparse.Namespace, backend: str, settings: Mapping[str, Any], extra: list[str] | None = None
) -> Config:
    """The config from the arguments as ``backend`` readies it, as Airflow's resolve task does: the keys its
    placement decides from ``settings`` unless given, then its checks and fits (BackendError naming the key)."""
    from training.backends import preparation

    prep = preparation(backend)
    given = {dotted(o.split("=", 1)[0]) for o in args.overrides}
    keys = [f"{k}={v}" for k, v in prep.config_keys(settings).items() if k not in given]
    return prep.fit(config(args, [*(extra or []), *keys]), settings, None, given)


def run_uri(run: str, root: str | None) -> str:
    """A run name under the root, or a run URI as given (made absolute)."""
    from training.config import absolute

    if "/" in run:  # a path or a URI (gs://...)
        return absolute(run.rstrip("/"))
    cfg = load_config(None, None, [f"root={root}"] if root else [])
    return cfg.model_copy(update={"run_name": run}).run_uri


def existing_run(args: argparse.Namespace) -> str:
    from training.api import run_exists

    uri = run_uri(args.run, args.root)
    if not run_exists(uri):
        raise no_run(args.run, uri, "nothing was ever launched there")
    return uri


def no_run(run: str, uri: str, why: str) -> NotFoundError:
    """The error of a run that is not at ``uri``; on ``gs://``, one whose bucket does not exist says so."""
    from training.storage import RootGone, is_gcs, open_store

    if is_gcs(uri):
        try:
            open_store(uri).list("config")  # a listing in a bucket that does not exist is answered 404
        except RootGone:
            bucket = uri[len("gs://") :].split("/", 1)[0]
            return NotFoundError(f"no bucket gs://{bucket}: run {run!r} cannot be at {uri} (gcloud storage ls)")
    return NotFoundError(f"no run {run!r} at {uri} ({why})")


def dump(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def mesh(m: dict[str, int] | None) -> str:
    return " x ".join(f"{k}{v}" for k, v in (m or {}).items()) or "-"


class Progress:
    """The job's progress: a live bar on a terminal (rich), else one plain line per step change."""

    def __init__(self, steps: int) -> None:
        self.tty = sys.stdout.isatty()
        self.steps = steps
        self.last_step: Any = None
        self._bar: Any = None
        if self.tty:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=steps, info="starting")
            self._bar.start()

    def line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def status(self, st: RunStatus) -> None:
        step = st.get("step")
        loss = st.get("loss")
        tps = st.get("tokens_per_s")
        info = (f"{st.get('state')}  loss {loss:.4f}" if isinstance(loss, float) else f"{st.get('state')}") + (
            f"  {tps:.0f} tok/s" if isinstance(tps, int | float) else ""
        )
        info += f"  {st.get('workers', '-')} hosts  mesh {mesh(st.get('mesh'))}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step or 0, info=info)
        elif step != self.last_step and step is not None:
            print(f"step {step:>6}/{self.steps}  {info}", flush=True)
        self.last_step = step

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def root(args: argparse.Namespace) -> str:
    return str(load_config(None, None, [f"root={args.root}"] if args.root else []).root)


Subcommands = argparse._SubParsersAction  # the parser's subcommands (argparse has no public name for it)


def config_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--preset",
        default=None,
        help="tiny | small | llama3.2-1b | llama3.2-3b | llama3.1-8b | llama3.1-70b | llama3-8b | llama3-70b (default: tiny)",
    )
    sp.add_argument("--config", action="append", default=[], metavar="FILE", help="a YAML file of keys (repeatable)")
    sp.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (see `rtrain config`)")


def run_args(sp: argparse.ArgumentParser, json_flag: bool = True) -> None:
    sp.add_argument("run", metavar="RUN", help="a run name under --root, or a run URI (path or gs://...)")
    sp.add_argument("--root", default=None, help="the run root RUN is under (default: the config's, var/runs)")
    if json_flag:
        sp.add_argument("--json", action="store_true", help="machine-readable output")
