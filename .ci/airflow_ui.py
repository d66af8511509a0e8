"""`make airflow`: the Airflow UI on 127.0.0.1 for this project (SQLite, ./airflow_home).

What `airflow standalone` runs, started here one by one so that every listener is on
loopback: the API server on 127.0.0.1, and the scheduler and the triggerer without their
log servers (which bind every interface; with all components on one machine the API
server reads the task logs from ./airflow_home directly).  Low parallelism (the default
would fork 32 workers on a laptop), no example DAGs, this repository's dags/ and plugins/,
our DAGs unpaused; prints the admin password and a REST call that triggers a run with
conf.  Ctrl-C stops it all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from demo import HOME, airflow_env  # noqa: E402

BIN = Path(sys.executable).parent
DAGS = ("resilient_training", "resilient_training_continual")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=int(os.environ.get("AIRFLOW_PORT", "8080")))
    args = ap.parse_args()
    HOME.mkdir(exist_ok=True)
    env = {
        **airflow_env(),
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(args.port),
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{args.port}",
    }
    subprocess.run(
        [str(BIN / "airflow"), "db", "migrate"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    (HOME / "logs").mkdir(parents=True, exist_ok=True)
    log = open(HOME / "logs" / "standalone.log", "ab")
    components = (
        ["api-server", "--host", "127.0.0.1", "--port", str(args.port), "--workers", "1"],
        ["scheduler", "--skip-serve-logs"],
        ["triggerer", "--skip-serve-logs"],
        ["dag-processor"],
    )
    procs = [
        subprocess.Popen(
            [str(BIN / "airflow"), *cmd],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for cmd in components
    ]
    base = f"http://127.0.0.1:{args.port}"
    print(f"starting Airflow on {base} (log: airflow_home/logs/standalone.log) ...", flush=True)

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        return serve(procs, base, env)
    except KeyboardInterrupt:
        return 0
    finally:
        stop(procs)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop every component's whole process group: a SIGTERM to all at once, then a SIGKILL to what is left of each
    group (the scheduler's LocalExecutor workers may outlive the scheduler itself)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def serve(procs: list[subprocess.Popen[bytes]], base: str, env: dict[str, str]) -> int:
    deadline = time.time() + 180
    while True:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            print(f"an Airflow component exited with {dead[0].returncode}; see airflow_home/logs/standalone.log")
            return 1
        try:
            with urllib.request.urlopen(f"{base}/api/v2/monitor/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.time() > deadline:
            print("the API server did not come up within 180 s")
            return 1
        time.sleep(1)
    # The DAG processor serializes our DAGs within a few seconds; then unpause them.
    for _ in range(60):
        done = [
            subprocess.run([str(BIN / "airflow"), "dags", "unpause", d], env=env, capture_output=True).returncode == 0
            for d in DAGS
        ]
        if all(done):
            break
        time.sleep(2)
    pw_file = HOME / "simple_auth_manager_passwords.json.generated"
    password = json.loads(pw_file.read_text()).get("admin") if pw_file.exists() else "(see the log)"
    conf = {
        "run_name": "ui-1",
        "preset": "tiny",
        "steps": 40,
        "max_workers": 2,
        "chaos": ["preempt:worker=1,step=15", "capacity:to=2,step=30"],
    }
    print(
        f"""
Airflow UI   {base}    user admin   password {password}
DAGs         {", ".join(DAGS)} (unpaused; the continual one first runs at its next 03:00 UTC)

Trigger a run with conf through the REST API:
  TOKEN=$(curl -s -X POST {base}/auth/token -H 'Content-Type: application/json' \\
      -d '{{"username": "admin", "password": "{password}"}}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["access_token"])')
  curl -s -X POST {base}/api/v2/dags/resilient_training/dagRuns -H "Authorization: Bearer $TOKEN" \\
      -H 'Content-Type: application/json' -d '{json.dumps({"logical_date": None, "conf": conf})}'

Ctrl-C stops Airflow.""",
        flush=True,
    )
    while all(p.poll() is None for p in procs):
        time.sleep(1)
    print("an Airflow component stopped; see airflow_home/logs/standalone.log")
    return 1


if __name__ == "__main__":
    sys.exit(main())
