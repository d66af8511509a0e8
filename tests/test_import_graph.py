"""No import cycle among first-party modules, counting function-local and type-checking imports alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[1]


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (each one a cycle or more)."""
    adjacent = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in adjacent:
        if root in index:
            continue
        work = [(root, iter(adjacent[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(adjacent[child])))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


GRAPH = """
import json, grimp
g = grimp.build_graph("training", "benchmarks", "rtrain_airflow", cache_dir=None, exclude_type_checking_imports=False)
print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))
"""


def test_first_party_modules_import_no_cycle() -> None:
    # In a process of its own: here, the tests' own training/ folder is on the path too.
    env = {**os.environ, "PYTHONPATH": str(REPO / "plugins")}
    out = subprocess.run([sys.executable, "-c", GRAPH], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    graph = grimp.ImportGraph()
    for importer, imported in json.loads(out.stdout).items():
        graph.add_module(importer)
        for m in imported:
            graph.add_import(importer=importer, imported=m)
    assert {
        "training.elastic.host.agent",
        "training.service.scheduler",
        "rtrain_airflow.hooks.training",
        "benchmarks.bench",
    } <= graph.modules
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for m in ("a", "a.b", "a.c", "a.d"):
        graph.add_module(m)
    graph.add_import(importer="a.b", imported="a.c")
    graph.add_import(importer="a.c", imported="a.b")
    graph.add_import(importer="a.c", imported="a.d")
    assert cycles(graph) == [["a.b", "a.c"]]


def api_names_used(paths: list[Path]) -> dict[str, str]:
    """Each name the given files take from ``training.api`` (``from training.api import X``, ``api.X``), with a file."""
    import ast

    used: dict[str, str] = {}
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "training.api":
                used.update({alias.name: str(path) for alias in node.names})
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "api":
                used.setdefault(node.attr, str(path))
    return used


def test_training_api_s_all_is_the_surface_its_callers_use() -> None:
    """What the Airflow side, the CLI and the backends take from ``training.api`` is in its ``__all__``."""
    import training.api

    callers = [*(REPO / "plugins").rglob("*.py"), *(REPO / "dags").rglob("*.py"), *(REPO / "training").glob("cli*.py")]
    callers += [*(REPO / "training" / "backends").rglob("*.py")]
    used = api_names_used(callers)
    assert {"begin_or_follow", "job_state", "plan"} <= set(used), "the scan finds the names the callers use"
    missing = {n: f for n, f in used.items() if n not in training.api.__all__}
    assert not missing, f"used through training.api but not in its __all__: {missing}"
    assert all(hasattr(training.api, n) for n in training.api.__all__)
