"""``rtrain submit``, ``queue``, ``priority`` and ``cancel``: the shared pool's commands."""

from __future__ import annotations

import argparse
from typing import Any

from training.cli_common import Exit, Subcommands, config, config_args, dump, root
from training.event_text import duration


def queue_row(uri: str) -> Any:
    """The run's row of its root's queue (priority, assignment, ETA), when it was submitted there."""
    from training.service.commands import ENDED, view
    from training.service.queue import Queue

    root, _, name = uri.rstrip("/").rpartition("/")
    if not root or not Queue(root).submissions():
        return None
    return next((r for r in view(root).rows if r.run == name and r.state not in ENDED), None)


def cmd_submit(args: argparse.Namespace) -> int:
    from training.service.commands import submit

    cfg = config(args)
    sub = submit(cfg, args.priority, pool_hosts=args.pool_hosts)
    root = "" if cfg.root.endswith("var/runs") else f" --root {cfg.root}"
    print(
        f"submitted run {sub.run_name} at priority {sub.priority} ({sub.min_hosts}..{sub.max_hosts} hosts); "
        f"follow it with `rtrain queue{root}`"
    )
    return Exit.OK


def cmd_queue(args: argparse.Namespace) -> int:
    from training.service.commands import view

    v = view(root(args))
    if args.json:
        dump({"root": v.root, "pool": v.pool, "runs": [r.to_dict() for r in v.rows]})
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

    sub = set_priority(root(args), args.run, args.priority)
    print(f"run {sub.run_name}: priority {sub.priority} (hosts move at the scheduler's next look)")
    return Exit.OK


def cmd_cancel(args: argparse.Namespace) -> int:
    from training.service.commands import cancel

    sub = cancel(root(args), args.run, args.reason)
    print(
        f"run {sub.run_name}: cancelled ({sub.cancelled}); a queued run ends `cancelled`, a running job `stopped` "
        "(resumable by a new submit)"
    )
    return Exit.OK


def service_commands(sub: Subcommands[argparse.ArgumentParser]) -> None:
    """The shared pool's commands: submit, the queue, priorities, cancel."""
    from training.service.policy import PRIORITIES

    levels = " | ".join(PRIORITIES)
    sp = sub.add_parser("submit", help="queue a run on the shared pool at a priority (the scheduler launches it)")
    config_args(sp)
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
