"""What a backend adds to a run's config and refuses in it before any capacity is provisioned.

A run's conf names its backend and that backend's settings; before the config is built the placement may
decide some of its keys (a TPU type's hosts per slice), and once it is built the backend checks it and fits
what it must (a stop-and-commit no longer than the pods' grace).  Airflow's resolve task and ``rtrain``
ask the registry for a backend's :class:`Preparation`; a backend without one takes the config as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from typing import Any

from training.api import Config


def _as_given(conf: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(conf or {})


def _no_keys(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _as_built(cfg: Config, settings: Mapping[str, Any], priority: str | None, given: Set[str]) -> Config:
    return cfg


@dataclass(frozen=True)
class Preparation:
    """How a backend readies a run's config: its settings from the conf, the keys it decides, its checks.

    ``settings``: the backend's settings from the conf's (defaults filled in).  ``config_keys``: dotted config
    keys the placement decides unless the conf gives them.  ``fit``: the built config checked against the
    settings and fitted where the conf left a key to the placement (``given``: the dotted keys the conf set);
    raises ``BackendError`` naming the key.
    """

    settings: Callable[[Mapping[str, Any] | None], dict[str, Any]] = _as_given
    config_keys: Callable[[Mapping[str, Any]], dict[str, Any]] = _no_keys
    fit: Callable[[Config, Mapping[str, Any], str | None, Set[str]], Config] = _as_built


AS_IS = Preparation()  # a backend whose placement decides nothing in the config
