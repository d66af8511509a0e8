"""The README is executable: its command blocks run as written, in a temporary copy of the project.

The CLI section's block runs line by line (continuations joined) with bash; `make airflow`
and the REST block run as a user would: Airflow starts, the two curl commands get a token and
trigger a run (PASSWORD is the one `make airflow` printed).  Each command's exit code and output
are checked.  The copy shares this checkout's `.venv` (a symlink) and nothing else.  The bench commands the
README and docs/benchmarks.md show (an hour each, run by the bench's own test) are parsed by rtrain's own parser,
and every `make` target they show is the Makefile's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from processes import started_from

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()

pytestmark = pytest.mark.slow


def bash_block(after_heading: str) -> str:
    """The first ```bash block after a heading."""
    start = README.index(after_heading)
    m = re.search(r"```bash\n(.*?)```", README[start:], re.S)
    assert m, f"no bash block after {after_heading!r}"
    return m.group(1)


def commands(block: str) -> list[str]:
    """One entry per command: continuation lines joined, comments kept (bash ignores them)."""
    out: list[str] = []
    pending = ""
    for line in block.splitlines():
        if not line.strip():
            continue
        pending += line
        if line.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1] + " "
            continue
        out.append(pending)
        pending = ""
    return out


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A copy of the project as a user would have it after `make test` (its .venv shared)."""
    dst = tmp_path_factory.mktemp("readme") / "resilient-training"
    ignore = shutil.ignore_patterns(
        ".venv", "var", "airflow_home", ".git", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"
    )
    shutil.copytree(REPO, dst, ignore=ignore)
    (dst / ".venv").symlink_to(REPO / ".venv")
    # The shared .venv is installed from this checkout: `make` in the copy must not see the copy's
    # install inputs as newer than the install stamp and reinstall the package from the copy.
    for name in ("pyproject.toml", "constraints.txt"):
        os.utime(dst / name, (0, 0))
    yield dst
    import psutil

    # Whatever the README started goes too: a job, Airflow, and its LocalExecutor workers, whose command line is
    # their title (not the copy's path) but whose working directory is the copy.
    for p in started_from(dst):
        with contextlib.suppress(psutil.Error):
            p.kill()


def run(project: Path, cmd: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "RTRAIN_"))}
    return subprocess.run(["bash", "-c", cmd], cwd=project, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_cli_section_runs_as_written(project: Path) -> None:
    cmds = commands(bash_block("## The engine from the command line"))
    names = [c.split()[1] if c.startswith(".venv/bin/rtrain") else c.split()[0] for c in cmds]
    assert names == [
        "prepare",
        "plan",
        "train",
        "status",
        "events",
        "capacity",
        "validate",
        "rollback",
        "prune",
        "report",
        "sample",
        "config",
    ], names
    out: dict[str, subprocess.CompletedProcess[str]] = {}
    for name, cmd in zip(names, cmds, strict=True):
        out[name] = r = run(project, cmd)
        ok = (0, 1) if name == "validate" else (0,)  # 1: a checkpoint was rejected (a verdict, not an error)
        assert r.returncode in ok, f"{cmd}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    assert "dataset " in out["prepare"].stdout and "var/data/stdlib-seq64" in out["prepare"].stdout
    assert "feasible worker counts: [4, 8]" in out["plan"].stdout
    assert "finished: step 40/40" in out["train"].stdout
    assert re.search(r"lost|preempt", out["train"].stdout), "the host loss shows in the train output"
    assert "state       finished" in out["status"].stdout and "step        40/40" in out["status"].stdout
    # The TensorBoard line both print names the run's curves, and they are there.
    tb = f"tensorboard --logdir {project / 'var' / 'runs' / 'r1' / 'tensorboard'}"
    assert tb in out["train"].stdout and tb in out["status"].stdout
    assert list((project / "var" / "runs" / "r1" / "tensorboard" / "train").glob("events.out.tfevents.*"))
    assert "resize" in out["events"].stdout and "-> 2 hosts" in out["events"].stdout
    assert "capacity of r1: 4 hosts" in out["capacity"].stdout
    assert re.search(r"^\s+\d+\s+(validated|rejected)", out["validate"].stdout, re.M)
    assert "resume pointer: step" in out["rollback"].stdout or "no validated checkpoint" in out["rollback"].stderr
    assert "would delete" in out["prune"].stdout
    assert "goodput" in out["report"].stdout and "failures       1" in out["report"].stdout
    # What each save cost the loop, against the least time copying its bytes could take.
    saves = re.search(
        r"^saves\s+(\d+) committed, median per save: training paused ([\d.]+) ms .*at least", out["report"].stdout, re.M
    )
    assert saves and int(saves.group(1)) >= 4, out["report"].stdout
    assert re.search(r"^checkpoint\.checkpoint_every\s+int\s+10\s", out["config"].stdout, re.M)
    assert re.match(r"\[step \d+\] def ", out["sample"].stdout), out["sample"].stdout  # the prompt, continued
    # The README's claim: paths are absolute in the saved config (the relative default root worked).
    saved = json.loads((project / "var" / "runs" / "r1" / "config.json").read_text())
    assert saved["root"] == str(project / "var" / "runs")
    assert run(project, ".venv/bin/rtrain --version").stdout.startswith("rtrain ")


def test_the_service_section_runs_as_written(project: Path) -> None:
    if not (project / "var" / "data" / "stdlib-seq64" / "manifest.json").exists():
        assert run(project, ".venv/bin/rtrain prepare").returncode == 0
    cmds = commands(bash_block("## Training as a service"))
    names = [c.split()[1] for c in cmds]
    assert names == ["submit", "submit", "queue", "priority", "cancel", "cancel"], names
    out = []
    for cmd in cmds:
        r = run(project, cmd)
        assert r.returncode == 0, f"{cmd}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
        out.append(r.stdout)
    assert "submitted run svc-low at priority low (2..4 hosts)" in out[0]
    assert "pool of 4 host(s)" in out[2]
    assert re.search(r"^svc-low\s+low\s+\S+", out[2], re.M) and re.search(r"^svc-high\s+high\s+", out[2], re.M), out[2]
    assert "svc-low: priority urgent" in out[3] and "svc-high: cancelled" in out[4]

    def ended() -> dict[str, str] | None:
        r = run(project, ".venv/bin/rtrain queue --json")
        states = {x["run"]: x["state"] for x in json.loads(r.stdout)["runs"]}
        # A run cancelled before its job ran ends cancelled; one whose job ran, stopped (neither failed).
        return states if set(states.values()) <= {"cancelled", "stopped"} else None

    deadline = time.monotonic() + 180
    while (states := ended()) is None and time.monotonic() < deadline:
        time.sleep(1)
    assert states is not None and set(states) == {"svc-low", "svc-high"}, run(project, ".venv/bin/rtrain queue").stdout


def test_the_fine_tuning_section_runs_as_written(project: Path) -> None:
    """A Hugging Face Llama in (init_from), fine-tuned, validated and exported both ways."""
    cmds = commands(bash_block("### Fine-tune a Hugging Face Llama"))
    assert [c.split()[1] for c in cmds] == ["prepare", "train", "validate", "export", "export"], cmds
    out = []
    for cmd in cmds:
        r = run(project, cmd)
        assert r.returncode == 0, f"{cmd}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
        out.append(r.stdout)
    assert "var/data/stdlib-llama3-tied-seq32" in out[0] and "(huggingface tokenizer)" in out[0], out[0]
    assert "finished: step 20/20" in out[1], out[1][-2000:]
    saved = json.loads((project / "var" / "runs" / "ft1" / "config.json").read_text())
    model = saved["model"]
    assert model["tie_embeddings"] is True and model["vocab_size"] == 320 and model["n_kv_heads"] == 1
    hf = project / "var" / "export" / "ft1"
    assert "step 20 of " in out[3] and sorted(p.name for p in hf.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["eos_token_id"] == 0  # <|end_of_text|>
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 0
    assert (project / "var" / "export" / "ft1-orbax" / "_CHECKPOINT_METADATA").exists()


def test_make_airflow_and_the_rest_example_run_as_written(project: Path) -> None:
    import psutil
    import requests

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "RTRAIN_"))}
    with socket_free(8080):
        proc = subprocess.Popen(
            ["make", "airflow"],
            cwd=project,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    try:
        password, lines = None, []
        deadline = time.monotonic() + 300
        assert proc.stdout is not None
        while time.monotonic() < deadline and password is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"user admin\s+password (\S+)", line)
            password = m.group(1) if m else None
        assert password, "".join(lines[-40:])
        # Every listener of this Airflow is on loopback (no log server on 0.0.0.0).
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        listening = [c.laddr for p in tree for c in _conns(p) if c.status == psutil.CONN_LISTEN]
        assert listening and all(a.ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for a in listening), listening

        block = bash_block("### Airflow on this machine: `make airflow`").replace("PASSWORD", password)
        r = run(project, block, timeout=120)
        assert r.returncode == 0, r.stderr
        created = json.loads(r.stdout)
        assert created["dag_id"] == "resilient_training" and created["conf"]["run_name"] == "ui-1", created
        token = requests.post(
            "http://127.0.0.1:8080/auth/token", json={"username": "admin", "password": password}, timeout=30
        ).json()["access_token"]
        got = requests.get(
            f"http://127.0.0.1:8080/api/v2/dags/resilient_training/dagRuns/{created['dag_run_id']}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        ).json()
        assert got["state"] in ("queued", "running", "success"), got
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _conns(p: Any) -> list[Any]:
    import psutil

    try:
        return list(p.net_connections(kind="inet"))
    except psutil.Error:
        return []


class socket_free:
    """Fail clearly (not confusingly) when the README's port is taken on this machine."""

    def __init__(self, port: int) -> None:
        self.port = port

    def __enter__(self) -> None:
        import socket

        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", self.port)) == 0:
                pytest.fail(f"port {self.port}, the README's, is in use here: `make airflow` needs it")

    def __exit__(self, *exc: object) -> None:
        pass


DOCS = {"README.md": README, "docs/benchmarks.md": (REPO / "docs" / "benchmarks.md").read_text()}


def inline_commands(text: str, prefix: str) -> list[str]:
    """The commands a text shows in `backticks` (outside its fenced blocks) that start with ``prefix``."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    found = (" ".join(m.group(1).split()) for m in re.finditer(r"`([^`]+)`", text))
    return [c for c in found if c.startswith(prefix)]


def test_the_bench_commands_shown_are_the_cli_s() -> None:
    """Each `rtrain bench ...` the README and docs/benchmarks.md show parses as written, naming real figures.

    A full bench takes an hour, so it is not run here: the bench's own test runs its figures.
    """
    import shlex

    from benchmarks.bench import FIGURES
    from training.cli import build_parser

    shown = [(doc, c) for doc, text in DOCS.items() for c in inline_commands(text, "rtrain bench")]
    assert any("--only" in c for _, c in shown) and any(doc == "docs/benchmarks.md" for doc, _ in shown), shown
    for doc, cmd in shown:
        try:
            args = build_parser().parse_args(shlex.split(cmd)[1:])
        except SystemExit:
            pytest.fail(f"{doc}: `{cmd}` is refused by rtrain's parser")
        assert set(args.only) <= set(FIGURES), f"{doc}: `{cmd}` names no figure of {FIGURES}"


def test_every_make_target_shown_exists() -> None:
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    for doc, text in DOCS.items():
        shown = set(re.findall(r"`make ([\w-]+)", text)) | set(re.findall(r"^make ([\w-]+)", text, re.M))
        assert shown and shown <= targets, f"{doc} shows make targets the Makefile lacks: {sorted(shown - targets)}"
