"""`make demo`: the resilient_training DAG end to end on the embedded default, then its story.

What it does, on a fresh machine (after `make`'s install step):

1. an Airflow home inside the project (./airflow_home, SQLite, ignored by git) and `airflow db migrate`;
2. `airflow dags test resilient_training` with the demo conf: the `small` preset on the local slice
   (up to 4 simulated hosts), run root var/runs, dataset var/data/stdlib, and a chaos schedule:
   one host lost mid-run, capacity back later; the DAG run is recorded in Airflow's DB, so
   `make airflow` shows it afterwards;
3. a summary: steps, failures, each recovery with its time, meshes before and after,
   validation verdicts, rollbacks, checkpoints kept and pruned, goodput.

By default the chaos schedule also injects a regression (a learning-rate spike at step 105, with the
in-job loss guard off) so that validation rejects the newest checkpoints and the rollback branch
runs: roll back to the newest validated checkpoint, train on, validate, promote.

Options: --steps N, --run-name NAME, --preset tiny|small, --max-workers N, --no-regression (only the
host loss and the capacity coming back), --no-chaos.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HOME = REPO / "airflow_home"
BIN = Path(sys.executable).parent


def airflow_env() -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # airflow standalone starts `airflow ...`
        "AIRFLOW_HOME": str(HOME),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "RTRAIN_ALERTS_FILE": str(HOME / "alerts.jsonl"),
        "RTRAIN_RETRY_DELAY_S": os.environ.get("RTRAIN_RETRY_DELAY_S", "10"),
        "PYTHONUNBUFFERED": "1",
    }


def say(msg: str = "") -> None:
    print(msg, flush=True)


LOG_LINE = re.compile(r"^\S+Z \[\s*(\w+)\s*\] (.*?)(?: \[[\w.]+\]( \S+=\S+)*)?$")


def interesting(line: str) -> str | None:
    """The lines of `airflow dags test` worth showing live (the full log is kept in a file)."""
    m = LOG_LINE.match(line.rstrip())
    text = m.group(2) if m else line.rstrip()
    if "[DAG TEST] starting task_id=" in text:
        return "task  " + text.split("task_id=")[1].split()[0]
    if text.startswith("[rtrain]") and "progress" not in text:
        return "      " + text[len("[rtrain] ") :]
    if text.startswith("[rtrain-alert]"):
        alert = json.loads(text[len("[rtrain-alert] ") :])
        return f"ALERT {alert['kind']}: {alert['task_id']} (try {alert['try_number']}): {alert['reason'][:160]}"
    if text.startswith("Marking run"):
        return "dag   " + ("run succeeded" if "successful" in text else "run failed")
    if text.startswith("Plan refused") or "invalid conf" in text:
        return "      " + text
    return None


def watch_progress(run_uri: Path, stop: threading.Event) -> None:
    """Print the job's step, loss and mesh from its status document now and then."""
    last = None
    while not stop.wait(10):
        try:
            st = json.loads((run_uri / "status.json").read_text())
        except (OSError, ValueError):
            continue
        key = (st.get("state"), st.get("step"), st.get("workers"))
        if key != last and st.get("step"):
            last = key
            mesh = "x".join(f"{k}{v}" for k, v in (st.get("mesh") or {}).items())
            loss = f"{st['loss']:.3f}" if isinstance(st.get("loss"), float) else "-"
            say(
                f"      job {st.get('state')}: step {st.get('step')}/{st.get('steps_total')} loss {loss} "
                f"on {st.get('workers')} hosts ({mesh})"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-name", default=time.strftime("demo-%Y%m%d-%H%M%S"))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--max-workers", type=int, default=4)
    ap.add_argument("--no-chaos", action="store_true")
    ap.add_argument("--no-regression", action="store_true")
    args = ap.parse_args()

    t0 = time.time()
    HOME.mkdir(exist_ok=True)
    env = airflow_env()
    say(f"== Airflow home {HOME} (SQLite); migrating the metadata DB")
    subprocess.run(
        [str(BIN / "airflow"), "db", "migrate"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    conf = dag_conf(args)
    chaos = conf["chaos"]
    run_uri = REPO / "var" / "runs" / args.run_name
    say(
        f"== DAG resilient_training, run {args.run_name}: preset {args.preset}, up to {args.max_workers} "
        f"simulated hosts, chaos {chaos or 'off'}"
    )
    if chaos:
        say(
            "   host 1 is lost at step 41 (4 -> 2 hosts), capacity is back at step 80 (-> 4 hosts)"
            + (
                "; a learning-rate spike from step 105 makes checkpoints 125 and 150 worse, for validation to catch"
                if not args.no_regression
                else ""
            )
        )
    say(f"   conf: {json.dumps(conf)}")
    log_path = HOME / "logs" / f"{args.run_name}.dags-test.log"
    rc, dag_wall = dags_test(conf, env, log_path, run_uri)
    say(f"== airflow dags test exited with {rc} after {dag_wall:.0f}s (full log: {log_path.relative_to(REPO)})")
    return summary(run_uri, args.run_name, dag_wall, time.time() - t0, env)


def dag_conf(args: argparse.Namespace) -> dict[str, Any]:
    """The DAG run's conf: the demo's preset, dataset, hosts and retention, and its faults (``chaos``)."""
    # The host is lost one step after a local copy (step 40): its survivors go on from that copy.
    chaos = [] if args.no_chaos else ["preempt:worker=1,step=41", "capacity:to=4,step=80"]
    overrides: dict[str, Any] = {"log_every": 5}
    if chaos and not args.no_regression:
        chaos.append("lr_spike:step=105,factor=60")
        overrides["spike_factor"] = 0  # let the regression reach validation (the in-job guard would catch it)
    conf = {
        "run_name": args.run_name,
        "preset": args.preset,
        "storage_root": "var/runs",
        "dataset_source": "stdlib",
        # The preset's tokenizer (a BPE trained on the corpus at prepare time) over 8 MB of the stdlib: plenty
        # for the demo's steps, and its own path, so a full preparation at the default path is never in the way.
        "dataset": f"var/data/demo-{args.preset}-8mb",
        "dataset_max_bytes": 8_000_000,
        "steps": args.steps,
        "max_workers": args.max_workers,
        "keep_last": 2,
        "keep_best": 1,
        # The local tier: every 5 steps each host also keeps a copy in host memory (tmpfs), so the lost
        # host costs the steps since the newest local copy, not since the last persistent checkpoint.
        "local_checkpoint_every": 5,
        "chaos": chaos,
        "overrides": overrides,
    }
    return conf


def dags_test(conf: dict[str, Any], env: dict[str, str], log_path: Path, run_uri: Path) -> tuple[int, float]:
    """``airflow dags test`` of the DAG with ``conf``, its lines logged and the telling ones shown; (exit code, wall s)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    threading.Thread(target=watch_progress, args=(run_uri, stop), daemon=True).start()
    t_dag = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(BIN / "airflow"), "dags", "test", "resilient_training", "-c", json.dumps(conf)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            shown = interesting(line)
            if shown:
                say(f"[{time.time() - t_dag:6.1f}s] {shown}")
        rc = proc.wait()
    stop.set()
    dag_wall = time.time() - t_dag
    return rc, dag_wall


def summary(run_uri: Path, run_name: str, dag_wall: float, total: float, env: dict[str, str]) -> int:
    os.environ.update(env)
    sys.path.insert(0, str(REPO / "plugins"))
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    from training import api
    from training.checkpoint.lifecycle import format_report

    with create_session() as s:
        dr = s.query(DagRun).filter(DagRun.dag_id == "resilient_training").order_by(DagRun.id.desc()).first()
        tis = s.query(TaskInstance).filter(TaskInstance.dag_id == dr.dag_id, TaskInstance.run_id == dr.run_id).all()
        states = {ti.task_id: (getattr(ti.state, "value", ti.state), ti.try_number) for ti in tis}
        row = (
            s.query(XComModel)
            .filter(
                XComModel.dag_id == dr.dag_id,
                XComModel.run_id == dr.run_id,
                XComModel.task_id == "training.watch_job",
                XComModel.key == "return_value",
            )
            .one_or_none()
        )
        watch = XComModel.deserialize_value(row) if row is not None else {}
        dag_state = getattr(dr.state, "value", dr.state)
        run_id = dr.run_id

    say("")
    say("=" * 100)
    say(f"DAG run   resilient_training / {run_id}: {dag_state} in {dag_wall:.0f}s ({total:.0f}s with set-up)")
    order = [
        "resolve_config",
        "prepare_dataset",
        "provision_capacity",
        "training.plan_topology",
        "training.launch_job",
        "training.watch_job",
        "validate",
        "promote_or_rollback",
        "promote",
        "rollback_and_resume",
        "prune",
        "report",
        "release_capacity",
    ]
    say(
        "tasks     "
        + "  ".join(
            f"{t.split('.')[-1]}={states.get(t, ('-', 0))[0]}"
            + (f"(x{states[t][1]})" if states.get(t, (0, 0))[1] > 1 else "")
            for t in order
        )
    )
    if not (run_uri / "config.json").exists():
        say("the run never started; see the log above")
        return 1
    report = api.report(str(run_uri))
    say(format_report(report))
    for rec in (watch or {}).get("recoveries") or []:
        say(
            f"airflow   saw recovery: {rec['cause']} -> training again at step {rec['resumed_step']} "
            f"{rec['recovery_s']:.1f}s after the fault"
        )
    alerts_file = Path(env["RTRAIN_ALERTS_FILE"])
    alerts = [json.loads(x) for x in alerts_file.read_text().splitlines()] if alerts_file.exists() else []
    mine = [a for a in alerts if a.get("run_id") == run_id]
    say(f"alerts    {len(mine)}" + "".join(f"\n  {a['kind']:<9}{a['task_id']}: {a['reason'][:120]}" for a in mine))
    say("=" * 100)
    say(f"Look at it in the UI: `make airflow`, then DAG resilient_training, run {run_id}.")
    return 0 if dag_state == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
