"""Rooms a reader holds in their head: no module over 800 lines, no class over 300, no function over 80.

The class and function limits hold in the engine, the plugin, the DAGs, the benchmarks and the CI scripts; the
module limit in each of those folders too.  The check keeps room under each limit: it fails at 90% of it
(720, 270, 72 lines), so the next change to a module near its limit is a split along a seam, not a squeeze.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIMITS = {"module": 800, "class": 300, "function": 80}
ROOM = 0.9  # the share of a limit a room may fill
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = (int(ROOM * LIMITS[k]) for k in ("module", "class", "function"))
CHECKED = ["training", "plugins", "dags", "benchmarks", ".ci"]


def oversized(root: Path) -> list[str]:
    """Each class and function under ``root`` longer than its limit, as ``path:line name (lines)`` (path from root)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                limit = MAX_CLASS
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION
            else:
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines, limit {limit})")
    return found


def long_modules(root: Path) -> list[str]:
    """Each module under ``root`` longer than :data:`MAX_MODULE` lines, as ``path (lines)`` (path from root)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE:
            found.append(f"{path.relative_to(root)} ({lines} lines, limit {MAX_MODULE})")
    return found


@pytest.mark.parametrize("package", CHECKED)
def test_no_class_or_function_is_over_its_limit(package: str) -> None:
    assert oversized(REPO / package) == []


@pytest.mark.parametrize("package", CHECKED)
def test_no_module_is_over_its_limit(package: str) -> None:
    assert long_modules(REPO / package) == []


def test_the_checked_folders_hold_python() -> None:
    assert all(any((REPO / folder).rglob("*.py")) for folder in CHECKED)


def test_the_check_finds_an_oversized_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    (tmp_path / "big.py").write_text(f"def big() -> None:\n{body}\n\n\ndef small() -> None:\n    pass\n")
    found = oversized(tmp_path)
    assert len(found) == 1 and "big" in found[0] and f"{MAX_FUNCTION + 1} lines" in found[0]


def test_the_check_finds_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "long.py").write_text("x = 0\n" * (MAX_MODULE + 1))
    (tmp_path / "short.py").write_text("x = 0\n" * MAX_MODULE)
    assert long_modules(tmp_path) == [f"long.py ({MAX_MODULE + 1} lines, limit {MAX_MODULE})"]
