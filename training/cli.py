"""``rtrain``: the command line of the training engine.

    rtrain prepare  [--source GLOB|FILE|gs://...] [--format F] [--field NAME] [--tokenizer T]
                    [--vocab-size N] [--output URI] [--seq-len N]
    rtrain plan     [--preset P] [--config FILE] [--compiled] [--json] [key=value ...]
    rtrain train    [--preset P] [--config FILE] [--chaos SPEC ...] [--detach] [key=value ...]
    rtrain status   RUN [--json]
    rtrain events   RUN [--type T ...] [--json]
    rtrain capacity RUN N
    rtrain stop     RUN
    rtrain validate RUN [--step S | --pending]
    rtrain rollback RUN [--to STEP]
    rtrain prune    RUN [--dry-run]
    rtrain report   RUN [--json]
    rtrain sample   RUN [--prompt TEXT] [--tokens N] [--step S] [--json]
    rtrain export   RUN [--step N] --format hf|orbax --output DIR
    rtrain config   [--show [--preset P] [key=value ...]]
    rtrain submit   [--preset P] [--config FILE] [--priority P] [--pool-hosts N] [key=value ...]
    rtrain queue    [--root ROOT] [--json]
    rtrain priority RUN P [--root ROOT]
    rtrain cancel   RUN [--root ROOT] [--reason TEXT]
    rtrain agent    RUN --job J --host H        (one host's agent; what a pod runs)
    rtrain bench    [--quick]

RUN is a run name under the configured root (``--root``, default var/runs) or a
run URI (a path or gs://...).  Errors are one line on stderr (``--debug`` for the
traceback); exit codes: 0 ok, 1 the job (or a verdict) failed, 2 usage,
3 config, 4 not found, 5 refused (the run is held by another job), 6 other errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from enum import IntEnum
from typing import Any

from training.config import ConfigError, describe_keys, load_config
from training.events import RunStatus, duration


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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("resilient-training")
    except PackageNotFoundError:
        return "unknown"


def _config(args: argparse.Namespace, extra: list[str] | None = None) -> Any:
    overrides = list(args.overrides)
    if getattr(args, "chaos", None):
        overrides.append("chaos=" + json.dumps(args.chaos))
    return load_config(args.preset, args.config, overrides + (extra or []))


def _run_uri(run: str, root: str | None) -> str:
    """A run name under the root, or a run URI as given (made absolute)."""
    from training.config import absolute

    if "/" in run:  # a path or a URI (gs://...)
        return absolute(run.rstrip("/"))
    cfg = load_config(None, None, [f"root={root}"] if root else [])
    return cfg.model_copy(update={"run_name": run}).run_uri


def _existing_run(args: argparse.Namespace) -> str:
    from training.api import run_exists

    uri = _run_uri(args.run, args.root)
    if not run_exists(uri):
        raise NotFoundError(f"no run {args.run!r} at {uri} (nothing was ever launched there)")
    return uri


def _dump(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


# --- commands -----------------------------------------------------------------------------------


def cmd_prepare(args: argparse.Namespace) -> int:
    from training import data
    from training.config import absolute

    overrides = list(args.overrides)
    if args.tokenizer:
        overrides.append(f"tokenizer={args.tokenizer}")
    if args.vocab_size:
        overrides.append(f"vocab_size={args.vocab_size}")
    if args.seq_len:
        overrides.append(f"seq_len={args.seq_len}")
    # The flags are config overrides, so the default output is the dataset the config trains on.
    cfg = load_config(args.preset, args.config, overrides)
    out = absolute(args.output) if args.output else cfg.dataset
    manifest = data.prepare(
        args.source,
        out,
        cfg.seq_len,
        tokenizer=cfg.tokenizer,
        vocab_size=cfg.vocab_size,
        fmt=None if args.format == "auto" else args.format,
        field=args.field,
        max_bytes=args.max_bytes,
        progress=lambda line: print(f"[prepare] {line}", flush=True),
    )
    splits = manifest["splits"]
    kind = (manifest.get("tokenizer") or {}).get("kind", "bytes")
    print(
        f"dataset {out}: {splits['train']['records']} train / {splits['validation']['records']} validation records "
        f"of {manifest['seq_len'] + 1} tokens, vocab {manifest.get('vocab_size', 256)} ({kind} tokenizer), "
        f"fingerprint {manifest['fingerprint'][:12]}"
    )
    return Exit.OK


def _gke_config(args: argparse.Namespace, gke: Any) -> Any:
    """A ``backend: gke`` run's config: hosts per slice and chips per host from the TPU type and the notice's commit
    fitted to the pods' grace, unless given; then all the JobSet's render would refuse, in one line, before billing."""
    from training.backends import BackendError
    from training.gke import GKEConfigError, check_launch, fit_grace, settings_keys

    given = {o.split("=", 1)[0] for o in args.overrides}
    try:
        extra = ["backend=gke"] + [f"{k}={v}" for k, v in settings_keys(gke).items() if k not in given]
        cfg = _config(args, extra)
        cfg = cfg if "preemption_grace_s" in given else fit_grace(cfg, gke)
        check_launch(cfg, gke)
    except GKEConfigError as e:
        raise BackendError(f"gke: {e}") from None
    return cfg


def cmd_plan(args: argparse.Namespace) -> int:
    from training.api import plan

    if args.gke:
        from training.backends.gke_run import load_settings

        cfg = _gke_config(args, load_settings(args.gke))
    else:
        cfg = _config(args)
    report = plan(cfg, compiled=args.compiled)
    if args.json:
        _dump(report)
        return Exit.OK
    print(f"feasible worker counts: {report['feasible_workers']}")
    for key in ("min_plan", "max_plan"):
        p = report[key]
        print(f"{key.replace('_', ' '):<9} {p['workers']} hosts, {p['devices']} devices, mesh {_mesh(p['shape'])}")
    mem, got = report["memory_gib"], report.get("compiled_memory_gib")
    params = f"{report['params'] / 1e6:.1f}M parameters"
    if report.get("memory_source") == "formula":
        print(f"memory per device at the minimum: {mem['total']:.2f} GiB by the formula ({params})")
    if got:
        backend = "this machine's accelerator" if "cpu_estimate" in got else "CPU backend"
        print(
            f"memory per device at the minimum: {got['total']:.2f} GiB from the compiled step ({backend}, XLA's "
            f"buffer assignment: arguments {got['arguments']:.2f}, temporaries {got['temporaries']:.2f}, "
            f"outputs {got['outputs']:.2f}, aliased {got['alias']:.2f} GiB; {params})"
        )
        if "cpu_estimate" in got:
            err = got["cpu_estimate"] / got["total"] - 1 if got["total"] else 0.0
            print(f"the CPU backend's estimate of the same step: {got['cpu_estimate']:.2f} GiB ({err:+.0%})")
    return Exit.OK


def _mesh(m: dict[str, int] | None) -> str:
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
        info += f"  {st.get('workers', '-')} hosts  mesh {_mesh(st.get('mesh'))}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step or 0, info=info)
        elif step != self.last_step and step is not None:
            print(f"step {step:>6}/{self.steps}  {info}", flush=True)
        self.last_step = step

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def cmd_train(args: argparse.Namespace) -> int:
    from training.api import launch, status
    from training.backends import BackendError, backend

    if args.gke:
        return _train_gke(args)
    cfg = _config(args)
    if cfg.backend != "local":
        raise BackendError(f"backend: a {cfg.backend!r} run needs its settings: rtrain train --gke FILE (docs/gke.md)")
    if args.detach:
        local = backend("local", by="rtrain")
        local.provision(cfg, {})
        handle = local.launch(cfg, {}, attempt=1)
        print(
            f"job {handle['job']} of run {cfg.run_name} {'followed' if handle.get('attached') else 'started'} "
            f"on the local slice ({cfg.run_uri}); follow it with `rtrain status {cfg.run_name}`"
            + ("" if cfg.root.endswith("var/runs") else f" --root {cfg.root}")
        )
        return Exit.OK
    from training.scalars import logdir

    progress = Progress(cfg.steps)
    progress.line(f"run {cfg.run_name} at {cfg.run_uri}: {cfg.min_workers}..{cfg.max_workers} hosts, {cfg.steps} steps")
    progress.line(f"curves: tensorboard --logdir {logdir(cfg.run_uri)}")
    try:
        handle = launch(cfg, detach=False, provision=True, on_line=progress.line, on_status=progress.status)
    finally:
        progress.close()
    st = status(cfg.run_uri) or {}
    rc = int(handle.get("returncode", 1))  # type: ignore[call-overload]
    if rc == 0:
        print(
            f"finished: step {st.get('step')}/{cfg.steps}, loss {st.get('loss')}, {st.get('failures', 0)} failure(s) absorbed"
        )
        return Exit.OK
    if st.get("state") == "stopped":
        print(
            f"rtrain: the job was stopped: {st.get('reason') or 'asked to stop'}; newest committed checkpoint "
            f"{st.get('latest_committed', '-')} (`rtrain train` with the same run_name resumes from it)",
            file=sys.stderr,
        )
        return Exit.STOPPED
    print(f"rtrain: the job failed: {st.get('reason') or 'see the events'}", file=sys.stderr)
    _show_worker_failure(cfg.run_uri)
    return Exit.FAILED


def _train_gke(args: argparse.Namespace) -> int:
    """``rtrain train --gke FILE``: node pools, the JobSet, the job followed, then both deleted (docs/gke.md)."""
    from training.backends.gke_run import GKERun, load_settings

    gke = load_settings(args.gke)
    cfg = _gke_config(args, gke)
    run = GKERun(cfg, gke)
    run.check()  # the config against the TPU shape, the credentials, the project, the cluster: before any billing
    progress = Progress(cfg.steps)
    progress.line(f"run {cfg.run_name} at {cfg.run_uri} on GKE cluster {gke['cluster_name']} ({gke['location']})")
    try:  # node pools made are given back however this ends (not a detached job's, nor one out of touch)
        look = run.drive(progress.line, progress.status, detach=args.detach)
    finally:
        progress.close()
    if look is None:  # detached, or out of touch with a job that may still run (said above)
        return Exit.OK if args.detach else Exit.ERROR
    return gke_exit(look, cfg.steps)


def gke_exit(look: Mapping[str, Any], steps: int) -> int:
    """The exit code of a followed GKE job's last look, said in one line: 0 finished, 7 stopped or cancelled, 1 failed."""
    st = look.get("status") or {}
    if look["state"] == "finished":
        print(f"finished: step {st.get('step')}/{steps}, loss {st.get('loss')}")
        return Exit.OK
    print(f"rtrain: the job {look['state']}: {look.get('reason') or 'see the events'}", file=sys.stderr)
    return Exit.STOPPED if look["state"] in ("stopped", "cancelled") else Exit.FAILED


def _show_worker_failure(run_uri: str) -> None:
    """The newest failure's worker error and the end of that worker's log."""
    from training.api import events

    fails = [e for e in events(run_uri, ("failure",)) if e.get("log")]
    if not fails:
        return
    f = fails[-1]
    print(f"last worker failure: {f.get('reason')}", file=sys.stderr)
    try:
        with open(f["log"], "rb") as fh:
            tail = fh.read()[-4000:].decode(errors="replace").splitlines()[-12:]
    except OSError:
        return
    print(f"--- the end of {f['log']}:", file=sys.stderr)
    for line in tail:
        print(f"    {line}", file=sys.stderr)


def cmd_status(args: argparse.Namespace) -> int:
    from training.api import host_processes
    from training.api import repair_status as status
    from training.scalars import logdir

    uri = _run_uri(args.run, args.root)
    st = status(uri)
    if st is None:
        raise NotFoundError(f"no status for run {args.run!r} at {uri} (never launched)")
    processes = host_processes(uri, st.get("job"))
    if args.json:
        _dump({**st, "processes": processes})
        return Exit.OK
    age = time.time() - float(st.get("updated_at", time.time()))
    loss = st.get("loss")
    rows = [
        ("run", f"{uri.rstrip('/').rsplit('/', 1)[-1]} ({uri})"),
        ("state", f"{st.get('state')}" + (f": {st['reason']}" if st.get("reason") else "")),
        (
            "step",
            f"{st.get('step', '-')}/{st.get('steps_total', '-')}"
            + (f"  loss {loss:.4f}" if isinstance(loss, float) else "")
            + (f"  {st['tokens_per_s']:.0f} tok/s" if isinstance(st.get("tokens_per_s"), int | float) else ""),
        ),
        (
            "hosts",
            f"{st.get('workers', '-')} training, mesh {_mesh(st.get('mesh'))}; alive {st.get('hosts_alive', '-')}",
        ),
        ("job", f"{st.get('job', '-')}  leader {st.get('leader', '-')}  round {st.get('round', '-')}"),
        (
            "checkpoint",
            f"newest committed {st.get('latest_committed', '-')}; failures absorbed {st.get('failures', 0)}",
        ),
        ("updated", f"{age:.0f}s ago"),
        ("curves", f"tensorboard --logdir {logdir(uri)}"),
    ]
    for i, (host, p) in enumerate(processes.items()):
        roles = {"agent": p["agent"], "worker": p["worker"], "standby": p["standby"]}
        pids = ", ".join(f"{role} {pid}" for role, pid in roles.items() if pid is not None)
        rows.append(("processes" if i == 0 else "", f"{host} on {p['node']}: {pids} ({p['state']})"))
    queued = _queue_row(uri)
    if queued is not None:
        notes = "; ".join(queued.eta_notes)
        rows.append(("queue", f"priority {queued.priority}, {queued.state}, {queued.assigned} host(s) assigned"))
        rows.append(("eta", f"{duration(queued.eta_s)}" + (f" ({notes})" if notes else "")))
    for k, v in rows:
        print(f"{k:<11} {v}")
    return Exit.OK


def _queue_row(uri: str) -> Any:
    """The run's row of its root's queue (priority, assignment, ETA), when it was submitted there."""
    from training.service.commands import ENDED, view
    from training.service.queue import Queue

    root, _, name = uri.rstrip("/").rpartition("/")
    if not root or not Queue(root).submissions():
        return None
    return next((r for r in view(root).rows if r.run == name and r.state not in ENDED), None)


def cmd_events(args: argparse.Namespace) -> int:
    from datetime import datetime

    from training.api import events
    from training.events import describe

    uri = _existing_run(args)
    for ev in events(uri, tuple(args.type) if args.type else None):
        ev.pop("_key", None)
        if args.json:
            print(json.dumps(ev, sort_keys=True, default=str))
        else:
            when = datetime.fromtimestamp(float(ev["time"])).strftime("%H:%M:%S.%f")[:-3]
            print(f"{when}  {ev['type']:<20} {describe(ev)}")
    return Exit.OK


def cmd_capacity(args: argparse.Namespace) -> int:
    from training.api import set_capacity

    uri = _existing_run(args)
    set_capacity(uri, args.workers)
    print(f"capacity of {args.run}: {args.workers} hosts")
    return Exit.OK


def cmd_stop(args: argparse.Namespace) -> int:
    from training.api import stop_job

    uri = _existing_run(args)
    stop_job(uri, args.reason)
    print(f"asked the job of {args.run} to stop; it ends `stopped` at its next look (resumable with `rtrain train`)")
    return Exit.OK


def cmd_submit(args: argparse.Namespace) -> int:
    from training.service.commands import submit

    cfg = _config(args)
    sub = submit(cfg, args.priority, pool_hosts=args.pool_hosts)
    root = "" if cfg.root.endswith("var/runs") else f" --root {cfg.root}"
    print(
        f"submitted run {sub.run_name} at priority {sub.priority} ({sub.min_hosts}..{sub.max_hosts} hosts); "
        f"follow it with `rtrain queue{root}`"
    )
    return Exit.OK


def _root(args: argparse.Namespace) -> str:
    return str(load_config(None, None, [f"root={args.root}"] if args.root else []).root)


def cmd_queue(args: argparse.Namespace) -> int:
    from training.service.commands import view

    v = view(_root(args))
    if args.json:
        _dump({"root": v.root, "pool": v.pool, "runs": [r.to_dict() for r in v.rows]})
        return Exit.OK
    print(f"pool of {v.pool} host(s) at {v.root}")
    if not v.rows:
        print("no run submitted (`rtrain submit`)")
        return Exit.OK
    print(f"{'RUN':<16} {'PRIORITY':<8} {'STATE':<21} {'HOSTS':>5} {'WANT':>4} {'STEP':>11} {'ETA':>8}")
    for r in v.rows:
        step = f"{r.step}/{r.steps}"
        print(
            f"{r.run:<16} {r.priority:<8} {r.state:<21} {r.hosts:>5} {r.assigned:>4} {step:>11} {duration(r.eta_s):>8}"
        )
        if r.eta_notes and r.eta_s is not None:
            print(f"{'':<16}   eta: {'; '.join(r.eta_notes)}")
        if r.reason:
            print(f"{'':<16}   {r.reason}")
    return Exit.OK


def cmd_priority(args: argparse.Namespace) -> int:
    from training.service.commands import set_priority

    sub = set_priority(_root(args), args.run, args.priority)
    print(f"run {sub.run_name}: priority {sub.priority} (hosts move at the scheduler's next look)")
    return Exit.OK


def cmd_cancel(args: argparse.Namespace) -> int:
    from training.service.commands import cancel

    sub = cancel(_root(args), args.run, args.reason)
    print(
        f"run {sub.run_name}: cancelled ({sub.cancelled}); a queued run ends `cancelled`, a running job `stopped` "
        "(resumable by a new submit)"
    )
    return Exit.OK


def cmd_validate(args: argparse.Namespace) -> int:
    from training.api import validate, validate_pending

    uri = _existing_run(args)
    results = validate_pending(uri) if args.pending else [validate(uri, args.step)]
    if args.json:
        for r in results:
            print(json.dumps(r, sort_keys=True, default=str))
    else:
        print(format_validations(results))
    return Exit.OK if all(r["verdict"] == "validated" for r in results) else Exit.FAILED


def cmd_sample(args: argparse.Namespace) -> int:
    import logging
    from dataclasses import asdict

    from training.api import load_run_config
    from training.sample import sample

    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's note on reading part of a checkpoint
    cfg = load_run_config(_existing_run(args))
    out = sample(cfg, args.prompt, max_new_tokens=args.tokens, step=args.step)
    if args.json:
        print(json.dumps(asdict(out), sort_keys=True))
    else:
        print(f"[step {out.step}] {out.prompt}{out.completion}")
    return Exit.OK


def cmd_export(args: argparse.Namespace) -> int:
    import logging

    from training.api import export

    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's note on reading part of a checkpoint
    out = export(_existing_run(args), args.output, args.format, args.step)
    if args.json:
        _dump(out)
    else:
        print(f"step {out['step']} of {out['run']} -> {out['output']} ({out['format']}: {', '.join(out['files'])})")
    return Exit.OK


def format_validations(results: Sequence[Mapping[str, Any]]) -> str:
    """One aligned table of verdicts: the loss first, then each metric the task reported, rounded."""
    if not results:
        return "no checkpoint waits for a verdict"
    names = ["loss"] + sorted({k for r in results for k in (r.get("metrics") or {})} - {"loss"})

    def num(v: Any) -> str:
        return "-" if v is None else format(v, ".4g") if isinstance(v, int | float) else str(v)

    lines = [f"{'step':>8}  {'verdict':<10} " + " ".join(f"{n:>11}" for n in names) + "  reason"]
    for r in results:
        m = r.get("metrics") or {}
        cells = " ".join(f"{num(m.get(n)):>11}" for n in names)
        lines.append(f"{r['step']:>8}  {r['verdict']:<10} {cells}  {r.get('reason', '')}".rstrip())
    return "\n".join(lines)


def cmd_rollback(args: argparse.Namespace) -> int:
    from training.api import rollback

    r = rollback(_existing_run(args), args.to, args.reason)
    if args.json:
        _dump(r)
    else:
        print(f"resume pointer: step {r['from_step']} -> {r['to_step']}; quarantined {r['quarantined'] or 'nothing'}")
    return Exit.OK


def cmd_prune(args: argparse.Namespace) -> int:
    from training.api import prune

    plan = prune(_existing_run(args), dry_run=args.dry_run)
    if args.json:
        _dump(plan)
        return Exit.OK
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"{verb} steps {plan['deleted']} and incomplete {plan['incomplete']} "
        f"({plan['bytes_freed'] / 2**20:.1f} MiB); kept {sorted(int(k) for k in plan['kept'])}"
    )
    for step, why in sorted(plan["kept"].items(), key=lambda kv: int(kv[0])):
        print(f"  keep {step}: {', '.join(why)}")
    return Exit.OK


def cmd_report(args: argparse.Namespace) -> int:
    from training.api import format_report, report

    r = report(_existing_run(args))
    if args.json:
        _dump(r)
    else:
        print(format_report(r))
    return Exit.OK


def cmd_config(args: argparse.Namespace) -> int:
    if args.show:
        cfg = load_config(args.preset, args.config, list(args.overrides))
        if args.json:
            print(cfg.to_json())
        else:
            for key, value in cfg.model_dump(mode="json").items():
                print(f"{key:<24} {json.dumps(value)}")
        return Exit.OK
    keys = describe_keys()
    if args.json:
        _dump(keys)
        return Exit.OK
    for k in keys:
        print(f"{k['key']:<24} {k['type']:<22} {k['default']:<16} {k['description']}")
    return Exit.OK


def cmd_agent(args: argparse.Namespace) -> int:
    from training.elastic.agent import main as agent_main

    argv = [args.run, "--job", args.job, "--host", args.host]
    for flag in ("coordinator_host", "coordinator_port", "bind_host"):
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    return agent_main(argv)


def cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks import bench

    return bench.main(args)


# --- the parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rtrain",
        description="Elastic JAX training that survives losing hosts.",
        epilog="Exit codes: 0 ok, 1 job/verdict failed, 2 usage, 3 config, 4 not found, 5 refused, 6 other errors.",
    )
    p.add_argument("--version", action="version", version=f"rtrain {_version()}")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _job_commands(sub)
    _service_commands(sub)
    _lifecycle_commands(sub)
    _host_commands(sub)
    return p


Subcommands = argparse._SubParsersAction  # the parser's subcommands (argparse has no public name for it)


def _config_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--preset", default=None, help="tiny | small | llama3-8b | llama3-70b (default: tiny)")
    sp.add_argument("--config", action="append", default=[], metavar="FILE", help="a YAML file of keys (repeatable)")
    sp.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (see `rtrain config`)")


def _run_args(sp: argparse.ArgumentParser, json_flag: bool = True) -> None:
    sp.add_argument("run", metavar="RUN", help="a run name under --root, or a run URI (path or gs://...)")
    sp.add_argument("--root", default=None, help="the run root RUN is under (default: the config's, var/runs)")
    if json_flag:
        sp.add_argument("--json", action="store_true", help="machine-readable output")


def _job_commands(sub: Subcommands[argparse.ArgumentParser]) -> None:
    """A job's commands: prepare its data, plan, train, watch and steer it."""
    sp = sub.add_parser("prepare", help="tokenize text, JSONL, Parquet or a saved HF dataset into shards")
    _config_args(sp)
    sp.add_argument("--source", default=None, help="glob or gs://prefix (default: this Python's stdlib sources)")
    sp.add_argument("--output", default=None, help="dataset URI (default: the config's dataset)")
    sp.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the config's)")
    sp.add_argument("--max-bytes", type=int, default=None, help="cap the input bytes read")
    sp.add_argument(
        "--format",
        choices=("auto", "text", "jsonl", "parquet", "hf"),
        default="auto",
        help="input format: text files, JSONL, Parquet, a saved Hugging Face dataset (default: detected)",
    )
    sp.add_argument("--field", default=None, metavar="NAME", help="JSONL field / Parquet or HF column (default: text)")
    sp.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="bytes | bpe | a tokenizer.json or SentencePiece .model path (default: the config's)",
    )
    sp.add_argument("--vocab-size", type=int, default=None, help="the BPE's vocabulary size (default: the config's)")
    sp.set_defaults(fn=cmd_prepare)

    sp = sub.add_parser("plan", help="mesh plans and the memory-fit check at the minimum topology")
    _config_args(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument(
        "--compiled",
        action="store_true",
        help="also check the compiled train step's per-device memory (compiled for fake CPU devices; can take a minute)",
    )
    sp.add_argument("--gke", default=None, metavar="FILE", help="plan a GKE run: a YAML file of gke settings")
    sp.set_defaults(fn=cmd_plan)

    sp = sub.add_parser("train", help="run (or resume) a training job on the local slice")
    _config_args(sp)
    sp.add_argument("--chaos", action="append", default=[], help="fault to inject, e.g. preempt:worker=1,step=12")
    sp.add_argument("--detach", action="store_true", help="start the job in the background and return")
    sp.add_argument("--gke", default=None, metavar="FILE", help="run on GKE: a YAML file of gke settings (docs/gke.md)")
    sp.set_defaults(fn=cmd_train)

    sp = sub.add_parser("status", help="the run's state, step, loss, hosts and mesh")
    _run_args(sp)
    sp.set_defaults(fn=cmd_status)

    sp = sub.add_parser("events", help="the run's events, one sentence each")
    _run_args(sp)
    sp.add_argument("--type", action="append", default=[], help="only events of this type (repeatable)")
    sp.set_defaults(fn=cmd_events)

    sp = sub.add_parser("capacity", help="set the local slice's number of hosts (take hosts away, give them back)")
    _run_args(sp, json_flag=False)
    sp.add_argument("workers", type=int, metavar="N", help="hosts")
    sp.set_defaults(fn=cmd_capacity)

    sp = sub.add_parser("stop", help="stop the run's job (resumable)")
    _run_args(sp, json_flag=False)
    sp.add_argument("--reason", default="stopped with rtrain stop", help="recorded as the job's end")
    sp.set_defaults(fn=cmd_stop)


def _service_commands(sub: Subcommands[argparse.ArgumentParser]) -> None:
    """The shared pool's commands: submit, the queue, priorities, cancel."""
    from training.service.policy import PRIORITIES

    levels = " | ".join(PRIORITIES)
    sp = sub.add_parser("submit", help="queue a run on the shared pool at a priority (the scheduler launches it)")
    _config_args(sp)
    sp.add_argument("--priority", default="normal", help=f"{levels} (default: normal)")
    sp.add_argument("--pool-hosts", type=int, default=None, metavar="N", help="set the pool's size (hosts)")
    sp.set_defaults(fn=cmd_submit)

    sp = sub.add_parser("queue", help="every submitted run: priority, state, hosts, step, ETA")
    sp.add_argument("--root", default=None, help="the storage root of the pool (default: the config's, var/runs)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(fn=cmd_queue)

    sp = sub.add_parser("priority", help="change a submitted run's priority (hosts move at once, by notice)")
    sp.add_argument("run", metavar="RUN", help="a submitted run's name")
    sp.add_argument("priority", metavar="PRIORITY", help=levels)
    sp.add_argument("--root", default=None, help="the storage root of the pool (default: the config's, var/runs)")
    sp.set_defaults(fn=cmd_priority)

    sp = sub.add_parser("cancel", help="cancel a submitted run (a running job stops, resumable)")
    sp.add_argument("run", metavar="RUN", help="a submitted run's name")
    sp.add_argument("--root", default=None, help="the storage root of the pool (default: the config's, var/runs)")
    sp.add_argument("--reason", default="cancelled with rtrain cancel", help="recorded as the run's end")
    sp.set_defaults(fn=cmd_cancel)


def _lifecycle_commands(sub: Subcommands[argparse.ArgumentParser]) -> None:
    """A run's checkpoints and story: validate, sample, roll back, prune, report; the config."""
    sp = sub.add_parser("validate", help="judge checkpoints on the held-out split")
    _run_args(sp)
    sp.add_argument("--step", type=int, default=None, help="default: the newest committed")
    sp.add_argument("--pending", action="store_true", help="every committed checkpoint without a verdict")
    sp.set_defaults(fn=cmd_validate)

    sp = sub.add_parser("sample", help="continue a prompt greedily from a checkpoint (the built-in lm task)")
    _run_args(sp)
    sp.add_argument("--prompt", default="", help="the text to continue")
    sp.add_argument("--tokens", type=int, default=64, help="new tokens at most (default 64)")
    sp.add_argument("--step", type=int, default=None, help="default: the newest committed")
    sp.set_defaults(fn=cmd_sample)

    sp = sub.add_parser("export", help="write a step as a Hugging Face directory or a plain Orbax checkpoint")
    _run_args(sp)
    sp.add_argument(
        "--format",
        choices=("hf", "orbax"),
        required=True,
        help="hf: config.json, safetensors, tokenizer.json; orbax: the parameter tree alone (StandardCheckpointer)",
    )
    sp.add_argument("--output", required=True, metavar="DIR", help="a new (or empty) directory, local or gs://")
    sp.add_argument("--step", type=int, default=None, help="default: the newest validated")
    sp.set_defaults(fn=cmd_export)

    sp = sub.add_parser("rollback", help="move the resume pointer back to a validated checkpoint")
    _run_args(sp)
    sp.add_argument("--to", type=int, default=None, help="default: the newest validated")
    sp.add_argument("--reason", default="manual rollback", help="recorded with the rollback")
    sp.set_defaults(fn=cmd_rollback)

    sp = sub.add_parser("prune", help="apply the retention policy")
    _run_args(sp)
    sp.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    sp.set_defaults(fn=cmd_prune)

    sp = sub.add_parser("report", help="the run's story: failures, recoveries, verdicts, goodput")
    _run_args(sp)
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser("config", help="every config key with its type, default and description")
    _config_args(sp)
    sp.add_argument("--show", action="store_true", help="print the resolved config instead")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(fn=cmd_config)


def _host_commands(sub: Subcommands[argparse.ArgumentParser]) -> None:
    """What runs on a host: an agent of a job; and the benchmarks."""
    sp = sub.add_parser("agent", help="one host's agent of a job (what each pod runs)")
    sp.add_argument("run", metavar="RUN_URI")
    sp.add_argument("--job", required=True, help="the job id the launcher handed the run to")
    sp.add_argument("--host", required=True, help="this host's id: h<N>, or s<slice>-h<N>")
    sp.add_argument("--coordinator-host", default=None, help="the address peers reach this host on")
    sp.add_argument("--coordinator-port", type=int, default=None, help="the jax.distributed port (0: a free one)")
    sp.add_argument("--bind-host", default=None, help="the address the coordinator binds")
    sp.set_defaults(fn=cmd_agent)

    sp = sub.add_parser("bench", help="recovery, checkpoint overhead, cost of resilience, restore throughput")
    sp.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    sp.add_argument("--repeats", type=int, default=None, help="repeats of each measurement (default 3; 1 with --quick)")
    sp.add_argument("--out", default="var/bench/bench.json", help="where the JSON goes")
    sp.add_argument("--only", action="append", default=[], help="run only these figures (repeatable)")
    sp.add_argument(
        "--formats-mib", type=int, action="append", default=None, help="the formats figure's state sizes per process"
    )
    sp.set_defaults(fn=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from training.api import LaunchError, LaunchRefused, LifecycleError, RunNotFound
    from training.backends import BackendError
    from training.checkpoint.resume import ResumeError
    from training.data import DatasetError
    from training.mesh import PlanError
    from training.service.policy import PriorityError
    from training.tasks import TaskError

    def fail(code: Exit, e: BaseException) -> int:
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"rtrain: error: {e}", file=sys.stderr)
        return int(code)

    try:
        return int(args.fn(args))
    except (ConfigError, PlanError, ResumeError, TaskError, PriorityError, BackendError) as e:
        return fail(Exit.CONFIG, e)
    except (NotFoundError, RunNotFound) as e:
        return fail(Exit.NOT_FOUND, e)
    except LaunchRefused as e:
        return fail(Exit.REFUSED, e)
    except (LaunchError, LifecycleError, DatasetError, ValueError, OSError) as e:
        return fail(Exit.ERROR, e)
    except KeyboardInterrupt:
        print("rtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
