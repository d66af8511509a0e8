"""A backend's name is compared in the registry alone: the engine reads a placement's traits instead.

``training/placement_traits.py`` says what the engine needs to know of a placement (hosts on this machine, the
round's TPU settings, the lock's handoff, what the CLI needs), and ``training/backends`` (the registry and its
placements) turns a name into a backend.  Anywhere else, ``== "gke"`` is a branch a new backend would have to find.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAMES = "local|gke|pool"
COMPARED = re.compile(
    rf"""(==|!=)\s*["']({NAMES})["']|["']({NAMES})["']\s*(==|!=)|\bin\s*[(\[{{]\s*["']({NAMES})["']"""
)
# Where a name may be compared: the registry and the traits, and the GKE backend's own modules checking their input.
ALLOWED = {"training/placement_traits.py", "training/backends/__init__.py", "training/backends/spec.py"}
ALLOWED_UNDER = ("training/gke/", "training/backends/gke")
# Modules still comparing a name, with how many times (none: a new one fails the test).
KNOWN: dict[str, int] = {}


def compared() -> dict[str, int]:
    """Each module of the engine, the plugins and the DAGs that compares a backend's name: how many times."""
    out: dict[str, int] = {}
    for top in ("training", "plugins", "dags"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            n = len(COMPARED.findall(path.read_text()))
            if n and rel not in ALLOWED and not rel.startswith(ALLOWED_UNDER):
                out[rel] = n
    return out


def test_no_module_outside_the_registry_compares_a_backend_s_name() -> None:
    assert compared() == KNOWN


def test_the_check_finds_a_name_compared() -> None:
    for line in ('if cfg.placement.backend == "local":', "if 'gke' != name:", 'if backend in ("gke", "x"):'):
        assert COMPARED.search(line), line
    assert not COMPARED.search('tier="local"') and not COMPARED.search("if traits(backend).hosts_here:")


def test_every_backend_a_config_can_name_has_its_traits_and_another_name_is_refused() -> None:
    import pytest

    from training.api import ConfigError, load_config
    from training.backends import PLACEMENTS, names
    from training.placement_traits import TRAITS, traits

    assert set(names()) >= {"local", "gke"} and set(TRAITS) == set(PLACEMENTS)
    assert traits("local").hosts_here and not traits("gke").hosts_here and traits("gke").round_tpu_env
    with pytest.raises(ValueError, match="backend: one of local, gke, not 'slurm'"):
        traits("slurm")
    with pytest.raises(ConfigError, match="not 'slurm'"):
        load_config("tiny", None, {"placement.backend": "slurm"})
