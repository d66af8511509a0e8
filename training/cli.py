"""``rtrain``: the command line of the training engine.

    rtrain prepare  [--source GLOB|gs://...] [--output URI] [--seq-len N]
    rtrain plan     [--preset P] [--config FILE] [key=value ...]
    rtrain train    [--preset P] [--config FILE] [--chaos SPEC ...] [--detach] [key=value ...]
    rtrain status   RUN
    rtrain events   RUN [--type T ...]
    rtrain capacity RUN N
    rtrain validate RUN [--step S | --pending]
    rtrain rollback RUN [--to STEP]
    rtrain prune    RUN [--dry-run]
    rtrain report   RUN
    rtrain bench    [--quick] [--out FILE]

RUN is a run directory URI, or a run name under the configured root.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from training.config import ConfigError, load_config


def _config(args: argparse.Namespace, extra: list[str] | None = None) -> Any:
    overrides = list(args.overrides)
    if getattr(args, "chaos", None):
        overrides.append("chaos=" + json.dumps(args.chaos))
    return load_config(args.preset, args.config, overrides + (extra or []))


def _run_uri(run: str, root: str | None) -> str:
    if "/" in run or run.startswith("gs://"):
        return run
    cfg = load_config(None, None, [f"root={root}"] if root else [])
    return cfg.model_copy(update={"run_name": run}).run_uri


def cmd_prepare(args: argparse.Namespace) -> int:
    from training import data

    cfg = load_config(args.preset, args.config, list(args.overrides))
    out = args.output or cfg.dataset
    manifest = data.prepare(
        args.source,
        out,
        args.seq_len or cfg.seq_len,
        max_bytes=args.max_bytes,
        progress=lambda line: print(f"[prepare] {line}", flush=True),
    )
    splits = manifest["splits"]
    print(
        f"dataset {out}: {splits['train']['records']} train / {splits['validation']['records']} validation records "
        f"of {manifest['seq_len'] + 1} bytes, fingerprint {manifest['fingerprint'][:12]}"
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from training.api import plan

    print(json.dumps(plan(_config(args)), indent=2))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from training.api import launch

    cfg = _config(args)
    res = launch(cfg, detach=args.detach, display=lambda line: print(line, flush=True))
    if args.detach:
        print(json.dumps(res, indent=2))
        return 0
    if res.get("attached"):
        print(f"run {cfg.run_name} already has a live agent (pid {res['agent_pid']}); watch it with `rtrain status`")
        return 0
    return int(res["returncode"])


def cmd_status(args: argparse.Namespace) -> int:
    from training.api import status

    st = status(_run_uri(args.run, args.root))
    if st is None:
        print(f"no status for {args.run}", file=sys.stderr)
        return 1
    print(json.dumps(st, indent=2, sort_keys=True))
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    from training.api import events

    for ev in events(_run_uri(args.run, args.root), tuple(args.type) if args.type else None):
        ev.pop("_key", None)
        print(json.dumps(ev, sort_keys=True))
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    from training.api import set_capacity

    set_capacity(_run_uri(args.run, args.root), args.workers)
    print(f"capacity of {args.run}: {args.workers} hosts")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from training.api import validate, validate_pending

    uri = _run_uri(args.run, args.root)
    results = validate_pending(uri) if args.pending else [validate(uri, args.step)]
    for r in results:
        print(json.dumps(r, sort_keys=True))
    return 0 if all(r["verdict"] == "validated" for r in results) else 1


def cmd_rollback(args: argparse.Namespace) -> int:
    from training.api import rollback

    print(json.dumps(rollback(_run_uri(args.run, args.root), args.to, args.reason), indent=2))
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from training.api import prune

    plan = prune(_run_uri(args.run, args.root), dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"{verb} steps {plan['deleted']} and incomplete {plan['incomplete']} "
        f"({plan['bytes_freed'] / 2**20:.1f} MiB); kept {sorted(plan['kept'])}"
    )
    for step, why in sorted(plan["kept"].items(), key=lambda kv: int(kv[0])):
        print(f"  keep {step}: {', '.join(why)}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from training.lifecycle import format_report, report

    r = report(_run_uri(args.run, args.root))
    print(json.dumps(r, indent=2, default=str) if args.json else format_report(r))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from training import bench

    return bench.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rtrain", description="Elastic JAX training that survives losing hosts.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def config_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--preset", default=None, help="tiny | small | llama3-8b | llama3-70b")
        sp.add_argument("--config", action="append", default=[], help="YAML file (repeatable)")
        sp.add_argument("overrides", nargs="*", help="key=value overrides")

    sp = sub.add_parser("prepare", help="turn text into ArrayRecord shards")
    config_args(sp)
    sp.add_argument("--source", default=None, help="glob or gs://prefix (default: this Python's stdlib sources)")
    sp.add_argument("--output", default=None, help="dataset URI (default: the config's dataset)")
    sp.add_argument("--seq-len", type=int, default=None)
    sp.add_argument("--max-bytes", type=int, default=None, help="cap the input bytes read")
    sp.set_defaults(fn=cmd_prepare)

    sp = sub.add_parser("plan", help="mesh plans and the memory-fit check")
    config_args(sp)
    sp.set_defaults(fn=cmd_plan)

    sp = sub.add_parser("train", help="run (or resume) a training job")
    config_args(sp)
    sp.add_argument("--chaos", action="append", default=[], help="fault to inject, e.g. preempt:worker=1,step=12")
    sp.add_argument("--detach", action="store_true", help="start the agent in the background and return")
    sp.set_defaults(fn=cmd_train)

    for name, fn, hlp in (
        ("status", cmd_status, "the run's status document"),
        ("events", cmd_events, "the run's events"),
    ):
        sp = sub.add_parser(name, help=hlp)
        sp.add_argument("run")
        sp.add_argument("--root", default=None)
        if name == "events":
            sp.add_argument("--type", action="append", default=[])
        sp.set_defaults(fn=fn)

    sp = sub.add_parser("validate", help="judge a checkpoint on the held-out split")
    sp.add_argument("run")
    sp.add_argument("--step", type=int, default=None, help="default: the newest committed")
    sp.add_argument("--pending", action="store_true", help="every committed checkpoint without a verdict")
    sp.add_argument("--root", default=None)
    sp.set_defaults(fn=cmd_validate)

    sp = sub.add_parser("rollback", help="move the resume pointer back to a validated checkpoint")
    sp.add_argument("run")
    sp.add_argument("--to", type=int, default=None, help="default: the newest validated")
    sp.add_argument("--reason", default="manual rollback")
    sp.add_argument("--root", default=None)
    sp.set_defaults(fn=cmd_rollback)

    sp = sub.add_parser("prune", help="apply the retention policy")
    sp.add_argument("run")
    sp.add_argument("--dry-run", action="store_true")
    sp.add_argument("--root", default=None)
    sp.set_defaults(fn=cmd_prune)

    sp = sub.add_parser("report", help="the run's summary: failures, recoveries, verdicts, goodput")
    sp.add_argument("run")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--root", default=None)
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser("capacity", help="set the local slice's capacity (hosts)")
    sp.add_argument("run")
    sp.add_argument("workers", type=int)
    sp.add_argument("--root", default=None)
    sp.set_defaults(fn=cmd_capacity)

    sp = sub.add_parser("bench", help="recovery, checkpoint overhead, cost of resilience, restore throughput")
    sp.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    sp.add_argument("--repeats", type=int, default=3)
    sp.add_argument("--out", default="var/bench/bench.json")
    sp.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from training.api import LaunchError
    from training.lifecycle import LifecycleError
    from training.mesh import PlanError

    try:
        return int(args.fn(args))
    except (ConfigError, PlanError, LaunchError, LifecycleError) as e:
        print(f"rtrain: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
