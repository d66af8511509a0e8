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
3 config, 4 not found, 5 refused (the run is held by another job), 6 other errors,
7 the job was stopped by a person (resumable).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from training.cli_common import (
    Exit,
    NotFoundError,
    Subcommands,
    config,
    config_args,
    dump,
    existing_run,
    mesh,
    no_run,
    readied,
    run_args,
    run_uri,
)
from training.cli_gke import gke_config, gke_exit, train_gke
from training.cli_service import queue_row, service_commands
from training.cloud_errors import Kind, cloud_error
from training.config import ConfigError, describe_keys, format_config, load_config
from training.event_text import duration

# A cloud error's exit code: a setup to fix (credentials, project, permissions) is a config error; a missing bucket
# is not found; a quota, a rate limit or no answer at all may pass.
CLOUD_EXITS = {Kind.SETUP: Exit.CONFIG, Kind.MISSING: Exit.NOT_FOUND, Kind.LATER: Exit.ERROR}

__all__ = ["Exit", "NotFoundError", "build_parser", "gke_exit", "main"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("resilient-training")
    except PackageNotFoundError:
        return "unknown"


# --- commands -----------------------------------------------------------------------------------


def cmd_prepare(args: argparse.Namespace) -> int:
    from training import data
    from training.config import absolute

    overrides = list(args.overrides)
    if args.tokenizer:
        overrides.append(f"data.tokenizer={args.tokenizer}")
    if args.vocab_size:
        overrides.append(f"model.vocab_size={args.vocab_size}")
    if args.seq_len:
        overrides.append(f"model.seq_len={args.seq_len}")
    # The flags are config overrides, so the default output is the dataset the config trains on.
    cfg = load_config(args.preset, args.config, overrides)
    out = absolute(args.output) if args.output else cfg.data.dataset
    manifest = data.prepare(
        args.source,
        out,
        cfg.model.seq_len,
        tokenizer=cfg.data.tokenizer,
        vocab_size=cfg.model.vocab_size,
        fmt=None if args.format == "auto" else args.format,
        field=args.field,
        max_bytes=args.max_bytes,
        progress=lambda line: print(f"[prepare] {line}", flush=True),
    )
    splits = manifest["splits"]
    tok = manifest.get("tokenizer")
    kind = tok["kind"] if tok else "bytes"
    print(
        f"dataset {out}: {splits['train']['records']} train / {splits['validation']['records']} validation records "
        f"of {manifest['seq_len'] + 1} tokens, vocab {manifest.get('vocab_size', 256)} ({kind} tokenizer), "
        f"fingerprint {manifest['fingerprint'][:12]}"
    )
    return Exit.OK


def cmd_plan(args: argparse.Namespace) -> int:
    from training.api import plan

    if args.gke:
        from training.backends.gke_run import load_settings

        cfg = gke_config(args, load_settings(args.gke))
    else:
        cfg = config(args)
    report = plan(cfg, compiled=args.compiled)
    if args.json:
        dump(report)
        return Exit.OK
    print(f"feasible worker counts: {report['feasible_workers']}")
    for key in ("min_plan", "max_plan"):
        p = report[key]
        print(f"{key.replace('_', ' '):<9} {p['workers']} hosts, {p['devices']} devices, mesh {mesh(p['shape'])}")
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
    if "remat" in report:
        print(report["remat"]["reason"])
    return Exit.OK


def cmd_train(args: argparse.Namespace) -> int:
    from training.backends import BackendError
    from training.backends.drive import Say
    from training.cli_train import run_drive, train_here
    from training.placement_traits import traits

    if args.gke:
        return train_gke(args)
    cfg = config(args)
    needs = traits(cfg.placement.backend).cli_needs
    if needs:
        raise BackendError(f"backend: a {cfg.placement.backend!r} run needs {needs}")
    cfg = readied(args, cfg.placement.backend, {})  # (this command passes the backend no settings)
    if not args.detach:
        return train_here(cfg)  # through its backend by the one driver, followed by the engine's watch
    run_drive(cfg, Say(print), detach=True).run(detach=True)
    return Exit.OK


def cmd_status(args: argparse.Namespace) -> int:
    from training.api import host_processes
    from training.api import repair_status as status
    from training.scalars import logdir

    uri = run_uri(args.run, args.root)
    st = status(uri)
    if st is None:
        raise no_run(args.run, uri, "no status: never launched")
    processes = host_processes(uri, st.get("job"))
    if args.json:
        dump({**st, "processes": processes})
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
            f"{st.get('workers', '-')} training, mesh {mesh(st.get('mesh'))}; alive {st.get('hosts_alive', '-')}",
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
    queued = queue_row(uri)
    if queued is not None:
        notes = "; ".join(queued.eta_notes)
        rows.append(("queue", f"priority {queued.priority}, {queued.state}, {queued.assigned} host(s) assigned"))
        rows.append(("eta", f"{duration(queued.eta_s)}" + (f" ({notes})" if notes else "")))
    for k, v in rows:
        print(f"{k:<11} {v}")
    return Exit.OK


def cmd_events(args: argparse.Namespace) -> int:
    from datetime import datetime

    from training.api import events
    from training.event_text import describe

    uri = existing_run(args)
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

    uri = existing_run(args)
    set_capacity(uri, args.workers)
    print(f"capacity of {args.run}: {args.workers} hosts")
    return Exit.OK


def cmd_stop(args: argparse.Namespace) -> int:
    from training.api import stop_job

    uri = existing_run(args)
    stop_job(uri, args.reason)
    print(f"asked the job of {args.run} to stop; it ends `stopped` at its next look (resumable with `rtrain train`)")
    return Exit.OK


def cmd_validate(args: argparse.Namespace) -> int:
    from training.api import validate, validate_pending

    uri = existing_run(args)
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
    cfg = load_run_config(existing_run(args))
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
    out = export(existing_run(args), args.output, args.format, args.step)
    if args.json:
        dump(out)
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

    r = rollback(existing_run(args), args.to, args.reason)
    if args.json:
        dump(r)
    else:
        print(f"resume pointer: step {r['from_step']} -> {r['to_step']}; quarantined {r['quarantined'] or 'nothing'}")
    return Exit.OK


def cmd_prune(args: argparse.Namespace) -> int:
    from training.api import prune

    plan = prune(existing_run(args), dry_run=args.dry_run)
    if args.json:
        dump(plan)
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

    r = report(existing_run(args))
    if args.json:
        dump(r)
    else:
        print(format_report(r))
    return Exit.OK


def cmd_config(args: argparse.Namespace) -> int:
    if args.show:
        cfg = load_config(args.preset, args.config, list(args.overrides))
        if args.json:
            print(cfg.to_json())
        else:
            print(format_config(cfg))
        return Exit.OK
    keys = describe_keys()
    if args.json:
        dump(keys)
        return Exit.OK
    for k in keys:
        print(f"{k['key']:<36} {k['type']:<22} {k['default']:<16} {k['description']}")
    return Exit.OK


def cmd_agent(args: argparse.Namespace) -> int:
    from training.elastic.host.agent import main as agent_main

    argv = [args.run, "--job", args.job, "--host", args.host]
    for flag in ("coordinator_host", "coordinator_port", "bind_host"):
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    return agent_main(argv)


def cmd_repair_slices(args: argparse.Namespace) -> int:
    from training.backends.gke_selfrepair import main as repair_main

    if args.every <= 0:
        raise SystemExit(f"rtrain repair-slices: --every must be above 0, not {args.every}")
    return repair_main(args.every)


def cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks import bench

    return bench.main(args)


# --- the parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rtrain",
        description="Elastic JAX training that survives losing hosts.",
        epilog="Exit codes: 0 ok, 1 job/verdict failed, 2 usage, 3 config, 4 not found, 5 refused, 6 other errors, 7 stopped.",
    )
    p.add_argument("--version", action="version", version=f"rtrain {_version()}")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _job_commands(sub)
    service_commands(sub)
    _lifecycle_commands(sub)
    _host_commands(sub)
    return p


def _job_commands(sub: Subcommands[argparse.ArgumentParser]) -> None:
    """A job's commands: prepare its data, plan, train, watch and steer it."""
    sp = sub.add_parser("prepare", help="tokenize text, JSONL, Parquet or a saved HF dataset into shards")
    config_args(sp)
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
    config_args(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument(
        "--compiled",
        action="store_true",
        help="also check the compiled train step's per-device memory (compiled for fake CPU devices; can take a minute)",
    )
    sp.add_argument("--gke", default=None, metavar="FILE", help="plan a GKE run: a YAML file of gke settings")
    sp.set_defaults(fn=cmd_plan)

    sp = sub.add_parser("train", help="run (or resume) a training job on the local slice")
    config_args(sp)
    sp.add_argument("--chaos", action="append", default=[], help="fault to inject, e.g. preempt:worker=1,step=12")
    sp.add_argument("--detach", action="store_true", help="start the job in the background and return")
    sp.add_argument("--gke", default=None, metavar="FILE", help="run on GKE: a YAML file of gke settings (docs/gke.md)")
    sp.set_defaults(fn=cmd_train)

    sp = sub.add_parser("status", help="the run's state, step, loss, hosts and mesh")
    run_args(sp)
    sp.set_defaults(fn=cmd_status)

    sp = sub.add_parser("events", help="the run's events, one sentence each")
    run_args(sp)
    sp.add_argument("--type", action="append", default=[], help="only events of this type (repeatable)")
    sp.set_defaults(fn=cmd_events)

    sp = sub.add_parser("capacity", help="set the local slice's number of hosts (take hosts away, give them back)")
    run_args(sp, json_flag=False)
    sp.add_argument("workers", type=int, metavar="N", help="hosts")
    sp.set_defaults(fn=cmd_capacity)

    sp = sub.add_parser("stop", help="stop the run's job (resumable)")
    run_args(sp, json_flag=False)
    sp.add_argument("--reason", default="stopped with rtrain stop", help="recorded as the job's end")
    sp.set_defaults(fn=cmd_stop)


def _lifecycle_commands(sub: Subcommands[argparse.ArgumentParser]) -> None:
    """A run's checkpoints and story: validate, sample, roll back, prune, report; the config."""
    sp = sub.add_parser("validate", help="judge checkpoints on the held-out split")
    run_args(sp)
    sp.add_argument("--step", type=int, default=None, help="default: the newest committed")
    sp.add_argument("--pending", action="store_true", help="every committed checkpoint without a verdict")
    sp.set_defaults(fn=cmd_validate)

    sp = sub.add_parser("sample", help="continue a prompt greedily from a checkpoint (the built-in lm task)")
    run_args(sp)
    sp.add_argument("--prompt", default="", help="the text to continue")
    sp.add_argument("--tokens", type=int, default=64, help="new tokens at most (default 64)")
    sp.add_argument("--step", type=int, default=None, help="default: the newest committed")
    sp.set_defaults(fn=cmd_sample)

    sp = sub.add_parser("export", help="write a step as a Hugging Face directory or a plain Orbax checkpoint")
    run_args(sp)
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
    run_args(sp)
    sp.add_argument("--to", type=int, default=None, help="default: the newest validated")
    sp.add_argument("--reason", default="manual rollback", help="recorded with the rollback")
    sp.set_defaults(fn=cmd_rollback)

    sp = sub.add_parser("prune", help="apply the retention policy")
    run_args(sp)
    sp.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    sp.set_defaults(fn=cmd_prune)

    sp = sub.add_parser("report", help="the run's story: failures, recoveries, verdicts, goodput")
    run_args(sp)
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser("config", help="every config key with its type, default and description")
    config_args(sp)
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

    sp = sub.add_parser(
        "repair-slices",
        help="repair this pod's JobSet from inside it (what each slice's leader pod runs beside its agent)",
    )
    sp.add_argument("--every", type=float, default=15.0, help="seconds between two looks at the JobSet's pods")
    sp.set_defaults(fn=cmd_repair_slices)

    sp = sub.add_parser(
        "bench", help="recovery (also at 1 GiB a process), checkpoint overhead, cost of resilience, restore throughput"
    )
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

    def fail(code: Exit, e: BaseException, line: str | None = None) -> int:
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"rtrain: error: {line or e}", file=sys.stderr)
        return int(code)

    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        print("rtrain: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        cloud = cloud_error(e)  # a Google Cloud or Kubernetes client's error: one line, whatever command met it
        if cloud is not None:
            return fail(CLOUD_EXITS[cloud.kind], e, cloud.line)
        if isinstance(e, ConfigError | PlanError | ResumeError | TaskError | PriorityError | BackendError):
            return fail(Exit.CONFIG, e)
        if isinstance(e, NotFoundError | RunNotFound):
            return fail(Exit.NOT_FOUND, e)
        if isinstance(e, LaunchRefused):
            return fail(Exit.REFUSED, e)
        if isinstance(e, LaunchError | LifecycleError | DatasetError | ValueError | OSError):
            return fail(Exit.ERROR, e)
        raise


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
