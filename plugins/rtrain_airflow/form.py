"""The trigger form's fields that are run-config keys, made from the config's own fields.

Each such field takes its type, bounds and help from ``training.config.Config`` and says what an empty
value gives in each preset; the DAG adds only a title and a section.  So a new form field for a config key
is one line in the DAG.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from airflow.sdk import Param

from rtrain_airflow.hooks.training import preset_values
from training import api

MARKDOWN = ("`", "**", "](")
# JSON-schema keys of a config field that the form's field keeps (its checks).
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "enum")


def text(help_text: str) -> dict[str, Any]:
    """The field's help: ``description_md`` (rendered by the form) when the text has markdown, else ``description``.

    The form shows ``description`` as it is when there is one, and only otherwise renders ``description_md``.
    """
    return {"description_md": help_text} if any(m in help_text for m in MARKDOWN) else {"description": help_text}


def shown(value: Any) -> str:
    """A preset's value as the help text says it (0 and empty: off)."""
    return "off" if value in (0, [], "") else str(value)


def when_empty(key: str, presets: Sequence[str]) -> str:
    """What an empty field means: the preset's value, one per preset when they differ (read from the presets' YAML)."""
    values = preset_values(key, presets)
    if len({repr(v) for v in values.values()}) == 1:
        return f"Empty: {shown(next(iter(values.values())))}."
    return "Empty: the preset's (" + ", ".join(f"{p} {shown(v)}" for p, v in values.items()) + ")."


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def range_text(field: dict[str, Any]) -> str:
    """A config field's bounds in words ("1 to 1,000,000.", "At least 0."), or nothing."""
    lo = field.get("minimum", field.get("exclusiveMinimum"))
    hi = field.get("maximum", field.get("exclusiveMaximum"))
    above, below = "exclusiveMinimum" in field, "exclusiveMaximum" in field
    if lo is not None and hi is not None and not above and not below:
        return f"{_number(lo)} to {_number(hi)}."
    low = f"{'above' if above else 'at least'} {_number(lo)}" if lo is not None else ""
    high = f"{'below' if below else 'at most'} {_number(hi)}" if hi is not None else ""
    text = ", ".join(t for t in (low, high) if t)
    return f"{text[:1].upper()}{text[1:]}." if text else ""


@cache
def config_field(key: str) -> dict[str, Any]:
    """The JSON schema of config key ``key``, ``section.key`` (a ``KeyError`` that names it when the config has no
    such key)."""
    try:
        return api.key_schema(key)
    except KeyError:
        raise KeyError(f"the run config has no key {key!r}") from None


def config_param(key: str, title: str, section: str, presets: Sequence[str]) -> Param:
    """The form field of config key ``key``: empty (null) keeps the preset's value; its type, bounds and help
    are the config field's."""
    field = config_field(key)
    help_text = " ".join(s for s in (field.get("description", ""), range_text(field), when_empty(key, presets)) if s)
    bounds = {k: field[k] for k in BOUNDS if k in field}
    if "enum" in bounds:
        bounds["enum"] = [None, *bounds["enum"]]
    return Param(
        None,
        type=["null", field["type"]],
        title=title,
        section=section,
        **text(help_text),
        **bounds,
    )
