"""Product code reads the config through its sections (``cfg.model.d_model``), never a flat key (``cfg.d_model``).

The flat names stay for users' configs and code (``training.config._FLAT_READS``; their test is in
test_config_sections.py); the product's own reads go through the section, so that a component can take its
section alone.  The check is an AST walk: an attribute named as a flat key, read on an expression that holds a
Config: a name or ``self.<name>`` annotated ``Config``, ``self`` in Config's own methods, or a name
``cfg``/``config`` (``self.cfg``) not declared as something else (``cfg: OptimizerSection``, ``cfg: LlamaConfig``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from training.config import _FLAT_READS  # type: ignore[attr-defined]  # defined only at run time

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("training", "plugins", "dags", "benchmarks")
CONFIG_NAMES = {"cfg", "config"}
IS_CONFIG = re.compile(r"\bConfig\b")
Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module


def _target_of(node: ast.expr) -> str | None:
    """``cfg`` for a name, ``self.cfg`` for an attribute of self; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return None


def _pairs(node: ast.Assign | ast.AnnAssign) -> list[tuple[str, ast.expr | None, ast.expr | None]]:
    """(target, annotation, value) of an assignment, tuple assignments paired element by element."""
    if isinstance(node, ast.AnnAssign):
        name = _target_of(node.target)
        return [(name, node.annotation, node.value)] if name else []
    out: list[tuple[str, ast.expr | None, ast.expr | None]] = []
    for target in node.targets:
        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
            out += [(n, None, v) for t, v in zip(target.elts, node.value.elts, strict=False) if (n := _target_of(t))]
        elif name := _target_of(target):
            out.append((name, None, node.value))
    return out


class _Types:
    """What each scope declares its names to be: a parameter's or an assignment's annotation, or an alias of
    another name (``cfg = self.cfg``); ``self.x`` is declared by its class."""

    def __init__(self, tree: ast.Module) -> None:
        self.declared: dict[tuple[int, str], ast.expr | _Alias] = {}  # (id(scope), name) -> annotation or aliased expr
        self.parent: dict[int, Scope] = {}
        self._walk(tree, [tree])

    def _walk(self, node: ast.AST, scopes: list[Scope]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scopes
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = [*scopes, child]
                for arg in self._args(child):
                    if arg.annotation is not None:
                        self.declared.setdefault((id(child), arg.arg), arg.annotation)
            if isinstance(child, ast.Assign | ast.AnnAssign):
                self._assign(child, scopes)
            self.parent[id(child)] = scopes[-1]
            self._walk(child, inner)

    @staticmethod
    def _args(fn: ast.AST) -> list[ast.arg]:
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            return []
        return [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]

    def _assign(self, node: ast.Assign | ast.AnnAssign, scopes: list[Scope]) -> None:
        for name, annotation, value in _pairs(node):
            scope = self._class_of(scopes) if name.startswith("self.") else scopes[-1]
            known = annotation if annotation is not None else value
            if scope is not None and known is not None:
                key = name.removeprefix("self.") if isinstance(scope, ast.ClassDef) else name
                self.declared.setdefault(
                    (id(scope), key), known if annotation is not None else _Alias(known, scopes[-1])
                )

    @staticmethod
    def _class_of(scopes: list[Scope]) -> ast.ClassDef | None:
        return next((s for s in reversed(scopes) if isinstance(s, ast.ClassDef)), None)

    def type_of(self, node: ast.expr, scope: Scope | None, depth: int = 0) -> str | None:
        """The annotation ``node`` is declared with, as text, following aliases; None when undeclared."""
        name = _target_of(node)
        if name is None or depth > 5:
            return None
        if name == "self":  # a method of Config itself
            while scope is not None and not isinstance(scope, ast.ClassDef):
                scope = self.parent.get(id(scope))
            return scope.name if scope is not None else None
        if name.startswith("self."):
            while scope is not None and not isinstance(scope, ast.ClassDef):
                scope = self.parent.get(id(scope))
            name = name.removeprefix("self.")
        while scope is not None:
            found = self.declared.get((id(scope), name))
            if isinstance(found, _Alias):
                return self.type_of(found.value, found.scope, depth + 1)
            if found is not None:
                return ast.unparse(found)
            scope = self.parent.get(id(scope))
        return None


@dataclass(frozen=True)
class _Alias:
    """A name assigned another name's value (``cfg = self.cfg``): it has that name's type, read in ``scope``."""

    value: ast.expr
    scope: Scope


def flat_reads(source: str) -> list[tuple[int, str]]:
    """(line, ``expr.key``) of each flat key read or set on a Config in ``source``."""
    tree = ast.parse(source)
    types = _Types(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in _FLAT_READS:
            continue
        name = _target_of(node.value)
        if name is None:
            continue
        declared = types.type_of(node.value, types.parent.get(id(node)))
        named = name.removeprefix("self.") in CONFIG_NAMES
        if (declared is not None and IS_CONFIG.search(declared)) or (named and declared in (None, "Any")):
            found.append((node.lineno, f"{name}.{node.attr}"))
    return sorted(found)


def product_flat_reads() -> list[str]:
    out = []
    for root in PRODUCT:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO)
            out += [f"{rel}:{line}: {read}" for line, read in flat_reads(path.read_text())]
    return out


def test_product_code_reads_no_flat_config_key() -> None:
    reads = product_flat_reads()
    assert not reads, "read these through their section (training.config._FLAT_READS names it):\n" + "\n".join(reads)


def test_the_check_finds_flat_reads_on_a_config_and_none_on_sections() -> None:
    source = """
from training.config import Config
from training.sections import OptimizerSection

def f(cfg: Config, old: Config, opt: OptimizerSection, other) -> None:
    cfg.d_model, old.steps, cfg.model.d_model, opt.steps
    cfg.dataset = "x"

def g(cfg: OptimizerSection, config: Any) -> None:
    cfg.steps, config.seed

def h(args) -> None:
    cfg = load(args)
    cfg.global_batch
    args.seq_len

class Loop:
    def __init__(self, cfg: Config, section: OptimizerSection) -> None:
        self.cfg, self.section = cfg, section

    def run(self) -> None:
        cfg = self.cfg
        cfg.steps, self.cfg.seed, self.section.steps

class Module:
    cfg: LlamaConfig

    def __call__(self) -> None:
        cfg = self.cfg
        cfg.d_model, self.cfg.n_heads, self.steps

class Config:
    def check(self) -> None:
        self.steps, self.model.steps
"""
    assert flat_reads(source) == [
        (6, "cfg.d_model"),
        (6, "old.steps"),
        (7, "cfg.dataset"),
        (10, "config.seed"),
        (14, "cfg.global_batch"),
        (23, "cfg.steps"),
        (23, "self.cfg.seed"),
        (34, "self.steps"),
    ]
