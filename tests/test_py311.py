"""The engine and its benchmarks are Python 3.11 source: a TPU VM's image may ship nothing newer.

Python 3.12 stays the project's own (the Makefile's, the Airflow side's); what runs on an accelerator
host (training/, benchmarks/, examples/) must parse on 3.11.  Ruff checks the same (its target is
py311): this test keeps it true whatever the linter's settings.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("training", "benchmarks", "examples")


def _sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py"))


def test_every_engine_module_is_python_3_11_syntax():
    bad = []
    for path in _sources():
        try:
            ast.parse(path.read_text(), str(path), feature_version=(3, 11))
        except SyntaxError as e:
            bad.append(f"{path.relative_to(REPO)}:{e.lineno}: {e.msg}")
    assert not bad, "3.12-only syntax where Python 3.11 must run it:\n" + "\n".join(bad)


def test_a_python_3_11_compiles_every_engine_module():
    """What the parser's feature version does not catch (f-string nesting), a real 3.11 does, where there is one."""
    pyenv = sorted(Path.home().glob(".pyenv/versions/3.11*/bin/python3.11"))
    python = str(pyenv[-1]) if pyenv else shutil.which("python3.11")
    if python is None:
        pytest.skip("no Python 3.11 on this machine")
    script = "import sys\nfor p in sys.argv[1:]:\n    compile(open(p, encoding='utf-8').read(), p, 'exec')\n"
    out = subprocess.run(
        [str(python), "-c", script, *map(str, _sources())], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_linter_and_the_package_admit_python_3_11():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["ruff"]["target-version"] == "py311"
    assert project["project"]["requires-python"].startswith(">=3.11")
