"""docs/architecture.md's map names every module of the code, each on a line of its own, and nothing that is gone.

The map is the first code block under "## The layers": one entry a line, indented under the folder it is in
(two spaces a level), a name ending in ``.py`` (a module) or ``/`` (a folder), then what it is.  A name may
carry folders of its own (``plugins/rtrain_airflow/``, ``models/llama.py``).  An ``__init__.py`` is named
when it holds more than a docstring; every other module of ``training/``, ``plugins/``, ``dags/`` and
``benchmarks/`` is named, and every named one exists.  The README's folder table names every top-level folder.
"""

from __future__ import annotations

import ast
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAPPED = ("training", "plugins", "dags", "benchmarks")
ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[\w.]+(?:/[\w.]+)*/?)(?P<rest>.*)$")


@dataclass(frozen=True)
class Entry:
    """One line of the map: the path it names (from the repository's root) and what it says the thing is."""

    path: str
    says: str
    line: int


def map_block(text: str) -> tuple[str, int]:
    """The first fenced block under "## The layers", and the line of the file it starts on."""
    start = text.index("\n## The layers\n")
    m = re.search(r"\n```\n(.*?)\n```", text[start:], re.S)
    assert m, "no code block under '## The layers'"
    return m.group(1), text[: start + m.start(1)].count("\n") + 1


def parse_map(block: str, first_line: int = 1) -> list[Entry]:
    """The map's entries, each with its full path, from its indentation under the folders above it."""
    entries: list[Entry] = []
    folders: list[tuple[int, str]] = []  # (indent, path) of the open folders, innermost last
    for n, line in enumerate(block.splitlines(), start=first_line):
        m = ENTRY.match(line)
        if not line.strip() or not m or not (m["name"].endswith(".py") or m["name"].endswith("/")):
            raise AssertionError(f"docs/architecture.md:{n}: not a map entry (a .py or a folder/ first): {line!r}")
        indent = len(m["indent"])
        while folders and folders[-1][0] >= indent:
            folders.pop()
        if indent and not folders:
            raise AssertionError(f"docs/architecture.md:{n}: indented under no folder: {line!r}")
        path = (folders[-1][1] if folders else "") + m["name"]
        says = m["rest"].strip()
        if m["rest"].startswith(",") or says.split(" ")[0].endswith((".py", ".py:")):
            raise AssertionError(f"docs/architecture.md:{n}: one module a line, not {line.strip()!r}")
        if not says or not m["rest"].startswith(" "):
            raise AssertionError(f"docs/architecture.md:{n}: {m['name']} says nothing of what it is")
        entries.append(Entry(path, says, n))
        if path.endswith("/"):
            folders.append((indent, path))
    return entries


def only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in body)


def modules() -> set[str]:
    """Every module of the mapped folders that the map must name (a bare ``__init__.py`` need not be)."""
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *MAPPED],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found = {p for p in tracked if p.endswith(".py") and (REPO / p).exists()}
    return {p for p in found if not (p.endswith("__init__.py") and only_a_docstring(REPO / p))}


@pytest.fixture(scope="module")
def entries() -> list[Entry]:
    block, line = map_block((REPO / "docs" / "architecture.md").read_text())
    return parse_map(block, line)


def test_the_map_names_every_module(entries: list[Entry]) -> None:
    named = {e.path for e in entries}
    missing = sorted(modules() - named)
    assert not missing, f"modules docs/architecture.md's map does not name (add a line each): {missing}"


def test_every_module_the_map_names_exists(entries: list[Entry]) -> None:
    gone = [f"{e.path} (line {e.line})" for e in entries if not (REPO / e.path).exists()]
    assert not gone, f"the map names what is not there: {gone}"
    twice = sorted({e.path for e in entries if [x.path for x in entries].count(e.path) > 1})
    assert not twice, f"named twice in the map: {twice}"


@pytest.mark.parametrize(
    ("block", "error"),
    [
        ("training/   t\n  a.py, b.py     two things", "one module a line"),
        ("training/   t\n  a.py", "says nothing"),
        ("  a.py   a thing", "indented under no folder"),
        ("training/  the engine\n  see below", "not a map entry"),
    ],
)
def test_a_malformed_map_line_is_named(block: str, error: str) -> None:
    with pytest.raises(AssertionError, match=error):
        parse_map(block)


def test_entries_take_their_folder_from_the_indentation() -> None:
    block = "training/   t\n  a.py   x\n  sub/   s\n    b.py   y\n  c.py   z\nbenchmarks/bench.py   b"
    assert [e.path for e in parse_map(block)] == [
        "training/",
        "training/a.py",
        "training/sub/",
        "training/sub/b.py",
        "training/c.py",
        "benchmarks/bench.py",
    ]


def test_the_readme_s_folder_table_names_every_top_level_folder() -> None:
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("\n## The repository\n") :]
    named = set(re.findall(r"^\|[^|]*?`([.\w-]+)/`", table, re.M)) | set(re.findall(r", `([.\w-]+)/`", table))
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    folders = {p.split("/")[0] for p in tracked if "/" in p}
    assert folders <= named, f"top-level folders the README's table leaves out: {sorted(folders - named)}"
