"""Rooms a reader holds in their head: no class over 300 lines, no function over 80, in the engine and the plugin."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_CLASS, MAX_FUNCTION = 300, 80


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


@pytest.mark.parametrize("package", ["training", "plugins"])
def test_no_class_or_function_is_over_its_limit(package: str) -> None:
    assert oversized(REPO / package) == []


def test_the_check_finds_an_oversized_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    (tmp_path / "big.py").write_text(f"def big() -> None:\n{body}\n\n\ndef small() -> None:\n    pass\n")
    found = oversized(tmp_path)
    assert len(found) == 1 and "big" in found[0] and f"{MAX_FUNCTION + 1} lines" in found[0]
