"""No process a test starts outlives the suite: a whole process group is stopped (members that outlive their leader,
as an Airflow scheduler's LocalExecutor workers do, included), and the session fails naming what was left."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from processes import names, started_from, stop_process_group

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parents[1]
# A group's leader that dies on SIGTERM, and a member that ignores it (a worker mid-task): the member's pid first.
GROUP = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    member = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    member.stdout.readline()
    print(member.pid, flush=True)
    time.sleep(120)
    """
)


def _group(cwd: Path) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", GROUP], cwd=cwd, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # dead, waiting for its parent (init) to reap it
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_stopping_a_process_group_takes_the_members_that_outlive_their_leader(tmp_path: Path) -> None:
    proc, member = _group(tmp_path)
    assert {proc.pid, member} <= {p.pid for p in started_from(tmp_path)}, "found by their working directory"
    stop_process_group(proc, grace_s=5)
    assert proc.returncode is not None and _gone(member), "the member that ignored SIGTERM is gone too"
    assert started_from(tmp_path) == []


@pytest.mark.parametrize(
    ("cmdline", "cwd", "named"),
    [
        (["python", "/s/pytest-1"], "/", True),
        (["python", "/s/pytest-1/run/worker.py"], "/", True),
        (["rtrain", "--run=file:///s/pytest-1/run"], "/", True),
        (["python", "-c", "open('/s/pytest-1')"], "/", True),
        ([], "/s/pytest-1", True),
        ([], "/s/pytest-1/h0", True),
        # Another session's directories, whose names begin with this one's.
        (["python", "/s/pytest-12/run/worker.py"], "/", False),
        (["rtrain", "--run=file:///s/pytest-12/run"], "/", False),
        (["python", "/s/pytest-1.x/a", "/s/pytest-1_b"], "/", False),
        ([], "/s/pytest-12", False),
        ([], "/s/pytest-12/h0", False),
    ],
)
def test_a_process_is_named_by_the_base_on_a_path_boundary(cmdline: list[str], cwd: str, named: bool) -> None:
    assert names(cmdline, cwd, Path("/s/pytest-1")) is named


def test_a_process_of_another_directory_whose_name_begins_with_the_base_s_is_not_found(tmp_path: Path) -> None:
    base, other = tmp_path / "pytest-1", tmp_path / "pytest-12"
    other.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(other / "run")], cwd=tmp_path)
    try:
        assert proc.pid not in {p.pid for p in started_from(base)}
        assert proc.pid in {p.pid for p in started_from(other)}
    finally:
        proc.kill()
        proc.wait()


def test_make_airflow_stops_each_component_s_whole_group(tmp_path: Path) -> None:
    """``make airflow``'s script (.ci/airflow_ui.py) on its way out: a scheduler's LocalExecutor workers that
    outlive the scheduler are stopped with it."""
    spec = importlib.util.spec_from_file_location("airflow_ui", REPO / ".ci" / "airflow_ui.py")
    assert spec is not None and spec.loader is not None
    airflow_ui = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(airflow_ui)
    groups = [_group(tmp_path) for _ in range(2)]
    airflow_ui.stop([proc for proc, _ in groups])
    assert all(_gone(member) for _, member in groups)


def test_a_process_a_test_leaves_behind_fails_the_session_and_is_killed(pytester: pytest.Pytester) -> None:
    for name in ("conftest.py", "processes.py"):
        pytester.makepyfile(**{name[:-3]: (REPO / "tests" / name).read_text()})
    pid_file = pytester.path / "left.pid"
    pytester.makepyfile(
        test_leaves=f"""
        import subprocess, sys
        import conftest

        def test_starts_a_server_and_forgets_it(tmp_path):
            conftest.LEFT_GRACE_S = 0.5
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], cwd=tmp_path,
                                    start_new_session=True)
            open({str(pid_file)!r}, "w").write(str(proc.pid))
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    pid = int(pid_file.read_text())
    result.stdout.fnmatch_lines(["*1 process(es) started from * outlived the test session (killed now):*"])
    result.stdout.fnmatch_lines([f"*pid {pid}: *time.sleep(120)*"])
    assert result.ret != 0 and _gone(pid)


def test_a_session_whose_tests_stop_what_they_start_passes(pytester: pytest.Pytester) -> None:
    for name in ("conftest.py", "processes.py"):
        pytester.makepyfile(**{name[:-3]: (REPO / "tests" / name).read_text()})
    pytester.makepyfile(
        test_tidy="""
        import subprocess, sys
        from processes import stop_process_group

        def test_starts_a_server_and_stops_it(tmp_path):
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], cwd=tmp_path,
                                    start_new_session=True)
            stop_process_group(proc, grace_s=1)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()
