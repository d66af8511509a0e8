"""Layered, validated run configuration.

A config is built in layers:

1. ``configs/base.yml``           every key with its default;
2. ``configs/<preset>.yml``       a model/run preset (``tiny``, ``small``, ``llama3.2-1b`` ...);
3. ``--config FILE`` YAML files   the user's own;
4. ``key=value`` overrides        from the command line, Airflow params, reruns.

The result is one typed object.  Unknown keys and wrong types are errors that
name the key; cross-field rules (ranges, divisibility) are checked here once so
that nothing downstream has to.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from training.cadence import gcs_timing
from training.faults import ChaosError, parse_chaos
from training.layout import run_uri
from training.sections import (
    FLAT,
    SECTIONS,
    CheckpointSection,
    DataSection,
    ElasticSection,
    ModelSection,
    ObservabilitySection,
    OptimizerSection,
    PlacementSection,
)
from training.storage import scheme

CONFIG_DIR = Path(__file__).parent / "configs"
# A run name is one directory name: no "/", no "..", not hidden.  (The DAG's param schema uses the same pattern.)
RUN_NAME_PATTERN = r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
RUN_NAME_RE = re.compile(RUN_NAME_PATTERN)
BUILTIN_TOKENIZERS = ("bytes", "bpe")
TOKEN_TASKS = ("lm", "maxtext")  # the built-in tasks that train on a prepared token dataset (`dataset`)
DEFAULT_DATASET = "var/data/stdlib-seq{seq_len}"  # byte-level; another tokenizer adds its name


class ConfigError(ValueError):
    """A config that cannot be run, with a message that names the key."""


# The sections' keys, with their defaults and descriptions (checkpoint_format's among them), are in
# training/sections.py; the presets (training/configs/*.yml) are written in sections.
class RunKeys(BaseModel):
    """The run's own keys, at the top of the document: its name, where it lives, its preset and its task."""

    run_name: str = Field("demo", description="Run name; the run's directory under `root`. Letters, digits, `_.-`.")
    root: str = Field(
        "var/runs",
        description="Run root URI: a local path (made absolute against the directory the command runs in) or "
        "gs://bucket/prefix.",
    )
    preset: str = Field("tiny", description="Preset the config was built from (informational once resolved).")
    task: str = Field(
        "lm",
        description="What is trained: a built-in task (`lm`: a Llama 3 decoder on a prepared token dataset; "
        "`maxtext`: a MaxText model on it, the `maxtext` extra) or "
        "user code as `package.module:factory` or `path/to/file.py:factory` (factory(cfg, task_args) -> Task).",
    )
    task_args: dict[str, Any] = Field(
        default_factory=dict, description="Free-form arguments for the task, validated by the task itself."
    )


def _flat_property(section: str, name: str) -> property:
    """A flat key of earlier versions read and set through its section (``cfg.d_model`` is ``cfg.model.d_model``)."""

    def get(self: BaseModel) -> Any:
        return getattr(getattr(self, section), name)

    def set_(self: BaseModel, value: Any) -> None:
        setattr(getattr(self, section), name, value)

    return property(get, set_, doc=f"``{section}.{name}``")


# What a section derives from its keys, read flat as well.
DERIVED = {"kv_heads": ("model", "kv_heads"), "head_dim": ("model", "head_dim")}

if TYPE_CHECKING:  # the flat keys are for users' configs and old code, not the engine: a flat read is a type error

    class _FlatKeys:
        pass

else:
    _FLAT_READS = {**{k: v for k, v in FLAT.items() if k not in SECTIONS}, **DERIVED}
    _FlatKeys = type("_FlatKeys", (), {key: _flat_property(*where) for key, where in _FLAT_READS.items()})


class Config(_FlatKeys, RunKeys):
    """A run's whole configuration: the run's keys and its sections, validated together.

    Code reads a key through its section (``cfg.model.d_model``); the flat names of earlier versions
    (``cfg.d_model``) still read and set the same key.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    model: ModelSection = Field(
        default_factory=lambda: ModelSection.model_validate({}), description=ModelSection.__doc__
    )
    data: DataSection = Field(default_factory=lambda: DataSection.model_validate({}), description=DataSection.__doc__)
    optimizer: OptimizerSection = Field(
        default_factory=lambda: OptimizerSection.model_validate({}), description=OptimizerSection.__doc__
    )
    checkpoint: CheckpointSection = Field(
        default_factory=lambda: CheckpointSection.model_validate({}), description=CheckpointSection.__doc__
    )
    elastic: ElasticSection = Field(
        default_factory=lambda: ElasticSection.model_validate({}), description=ElasticSection.__doc__
    )
    placement: PlacementSection = Field(
        default_factory=lambda: PlacementSection.model_validate({}), description=PlacementSection.__doc__
    )
    observability: ObservabilitySection = Field(
        default_factory=lambda: ObservabilitySection.model_validate({}), description=ObservabilitySection.__doc__
    )

    @model_validator(mode="before")
    @classmethod
    def _in_sections(cls, data: Any) -> Any:
        """A document written with flat keys (or ``section.key`` ones) read into its sections."""
        return nest(data)[0] if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check(self) -> Config:
        if not RUN_NAME_RE.match(self.run_name):
            raise ValueError(
                f"run_name {self.run_name!r}: letters, digits and _.- (up to 63), not starting with one of _.-, no '..'"
            )
        if not self.data.dataset:
            self.data.dataset = default_dataset(self.data.tokenizer, self.model.vocab_size, self.model.seq_len)
        if scheme(self.root).requests:
            self._gcs_timing()
        if self.elastic.min_workers > self.elastic.max_workers:
            raise ValueError(f"min_workers ({self.elastic.min_workers}) > max_workers ({self.elastic.max_workers})")
        if (
            self.elastic.min_workers % self.placement.hosts_per_slice
            or self.elastic.max_workers % self.placement.hosts_per_slice
        ):
            raise ValueError(
                f"min_workers ({self.elastic.min_workers}) and max_workers ({self.elastic.max_workers}) must be whole slices of "
                f"hosts_per_slice={self.placement.hosts_per_slice} hosts"
            )
        if self.elastic.heartbeat_timeout_s < 2 * self.elastic.heartbeat_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.elastic.heartbeat_timeout_s}) must be at least twice heartbeat_s ({self.elastic.heartbeat_s})"
            )
        if self.model.d_model % self.model.n_heads:
            raise ValueError(f"d_model ({self.model.d_model}) must be divisible by n_heads ({self.model.n_heads})")
        if self.model.kv_heads and self.model.n_heads % self.model.kv_heads:
            raise ValueError(f"n_heads ({self.model.n_heads}) must be divisible by n_kv_heads ({self.model.kv_heads})")
        if self.optimizer.global_batch % self.optimizer.grad_accum:
            raise ValueError(
                f"global_batch ({self.optimizer.global_batch}) must be divisible by grad_accum ({self.optimizer.grad_accum})"
            )
        if self.data.tokenizer == "bytes" and self.task == "lm" and self.model.vocab_size < 256:
            raise ValueError(f"vocab_size ({self.model.vocab_size}) is below the byte tokenizer's 256")
        if self.model.init_from and self.task != "lm":
            raise ValueError(f"init_from loads a Hugging Face Llama into the built-in lm task, not task {self.task!r}")
        if self.checkpoint.resume_from not in ("latest", "none") and not self.checkpoint.resume_from.isdigit():
            raise ValueError(
                f"resume_from must be 'latest', 'none' or a step number, got {self.checkpoint.resume_from!r}"
            )
        self._check_chaos()
        return self

    def _gcs_timing(self) -> None:
        """Every look at a gs:// root is an HTTP request: beat, and renew the lease, less often, and beat slower
        as the job grows (unless told otherwise)."""
        timing = gcs_timing(self.elastic.max_workers)
        derived = [
            k for k in ("heartbeat_s", "heartbeat_timeout_s", "lease_s") if k not in self.elastic.model_fields_set
        ]
        told_timeout = "heartbeat_timeout_s" not in derived
        if "heartbeat_s" in derived and told_timeout and self.elastic.heartbeat_timeout_s < 2 * timing.heartbeat_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.elastic.heartbeat_timeout_s}) must be at least twice heartbeat_s: on gs:// "
                f"a job of {self.elastic.max_workers} hosts beats every {timing.heartbeat_s:g} s unless told otherwise"
            )
        for key in derived:
            setattr(self.elastic, key, getattr(timing, key))

    def _check_chaos(self) -> None:
        for spec in self.elastic.chaos:
            try:
                fault = parse_chaos(spec)
            except ChaosError as e:
                raise ValueError(str(e)) from None
            try:
                fault.kind.check_config(fault, self)
            except ChaosError as e:
                raise ValueError(f"chaos {spec!r}: {e}") from None

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with ``update``'s keys (flat, ``section.key`` or whole sections) changed; each section copied,
        so that setting a key of the copy leaves this config as it is."""
        nested, _ = nest(dict(update or {}))
        top: dict[str, Any] = {k: v for k, v in nested.items() if k not in SECTIONS}
        for name in SECTIONS:
            given = nested.get(name)
            top[name] = (
                given if isinstance(given, BaseModel) else getattr(self, name).model_copy(update=given, deep=deep)
            )
        return super().model_copy(update=top, deep=deep)

    @property
    def prepared_tokens(self) -> bool:
        """Whether the task trains on the prepared token dataset at ``dataset`` (the built-in ``lm`` and ``maxtext``)."""
        return self.task in TOKEN_TASKS

    @property
    def run_uri(self) -> str:
        return run_uri(self.root, self.run_name)

    @property
    def stop_allowance_s(self) -> float:
        """Seconds a stop of the job may take before what is left of it is killed: the job's own limit (the round
        stops at a step and commits it within the grace period, else its leader ends it) and a leader change."""
        return self.checkpoint.preemption_grace_s + 3 * self.elastic.lease_s + 5

    def with_absolute_paths(self, base: str | Path | None = None) -> Config:
        """A copy whose local paths are made absolute against ``base`` (default: the current directory); gs:// kept.

        Each path key is read and set through its section, so that a key moved to another section is a type
        error here rather than a path left relative."""
        out = self.model_copy()  # each section copied: setting the copy's keys leaves this config as it is
        out.root = absolute(self.root, base)
        out.data.dataset = absolute(self.data.dataset, base)
        if self.data.tokenizer not in BUILTIN_TOKENIZERS:
            out.data.tokenizer = absolute(self.data.tokenizer, base)
        out.placement.compilation_cache = absolute(self.placement.compilation_cache, base)
        out.checkpoint.local_checkpoint_dir = absolute(self.checkpoint.local_checkpoint_dir, base)
        out.model.init_from = absolute(self.model.init_from, base)
        file, sep, factory = self.task.rpartition(":")
        if sep and file.endswith(".py"):
            out.task = f"{absolute(file, base)}:{factory}"
        return out

    def flat(self) -> dict[str, Any]:
        """Every key as ``section.key`` (the run's own keys bare) -> its JSON value, in the document's order."""
        out: dict[str, Any] = {}
        for key, value in self.model_dump(mode="json").items():
            if key in SECTIONS:
                out |= {f"{key}.{k}": v for k, v in value.items()}
            else:
                out[key] = value
        return out

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


def nest(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A document's keys read into sections: ``{section: {key: value}}`` from a section's mapping, a
    ``section.key`` or a flat key of earlier versions (whose names it returns too, in the order met).
    Later keys win; an unknown key is kept as it is, for the config to refuse by name."""
    out: dict[str, Any] = {}
    flat: list[str] = []
    for key, value in data.items():
        section, dot, name = key.partition(".")
        if key in SECTIONS and not (key == "optimizer" and isinstance(value, str)):
            if isinstance(value, BaseModel) or not isinstance(value, Mapping):
                out[key] = value
            else:
                into = out.setdefault(key, {})
                into.update(value) if isinstance(into, dict) else out.__setitem__(key, dict(value))
        elif dot and section in SECTIONS:
            _into(out, section)[name] = value
        elif key in FLAT:
            section, name = FLAT[key]
            _into(out, section)[name] = value
            flat.append(key)
        else:
            out[key] = value
    return out, flat


def dotted(key: str) -> str:
    """A key as ``section.key``: a flat key of earlier versions moved to its section, any other as it is."""
    return ".".join(FLAT[key]) if key in FLAT else key


def _into(out: dict[str, Any], section: str) -> dict[str, Any]:
    into = out.get(section)
    if not isinstance(into, dict):
        into = out[section] = {} if into is None else dict(into.model_dump(exclude_unset=True))
    return into


def default_dataset(tokenizer: str, vocab_size: int, seq_len: int) -> str:
    """The dataset a config trains on when it names none: this Python's stdlib, per tokenizer and length."""
    if tokenizer == "bytes":
        return DEFAULT_DATASET.format(seq_len=seq_len)
    if tokenizer == "bpe":
        name = f"bpe{vocab_size}"
    else:
        path = Path(tokenizer)  # a checkpoint's tokenizer.json is named by its directory
        stem = path.parent.name if path.name == "tokenizer.json" and path.parent.name else path.stem
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:40] or "tok"
    return f"var/data/stdlib-{name}-seq{seq_len}"


def absolute(path: str, base: str | Path | None = None) -> str:
    """A local path made absolute against ``base`` (default: the current directory); gs:// URIs unchanged."""
    if not path or not scheme(path).filesystem:
        return path
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = Path(base if base is not None else os.getcwd()) / p
    return os.path.normpath(p)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"--config {path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of key: value, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value")
    key, _, raw = item.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has no key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: {raw!r} is not a value ({getattr(e, 'problem', None) or e})") from None
    return key, value


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yml") if p.stem != "base")


def load_config(
    preset: str | None = None,
    files: list[str] | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    base_dir: str | Path | None = None,
) -> Config:
    """Build a Config from the layers; raises ConfigError naming the bad key.

    Each layer may be written in sections (``model: {d_model: 64}``), as ``section.key`` or, as earlier
    versions wrote it, with flat keys (``d_model: 64``): those of a file or a ``key=value`` override give one
    deprecation note (``note_flat_keys``).
    Local paths are made absolute here, once, against ``base_dir`` (default: the
    directory the command runs in), so every process of the run sees the same ones.
    """
    layers, _ = nest(_read_yaml(CONFIG_DIR / "base.yml"))
    ov: dict[str, Any] = {}
    if isinstance(overrides, dict):
        ov = dict(overrides)
    else:
        for item in overrides or []:
            k, v = parse_override(item)
            ov[k] = v
    user: list[tuple[str, dict[str, Any]]] = [(f"--config {f}", _read_yaml(Path(f))) for f in files or []]
    user.append(("dict" if isinstance(overrides, dict) else "key=value overrides", ov))
    preset = next((u["preset"] for _, u in reversed(user) if u.get("preset")), None) or preset
    preset = preset or layers.get("preset", "tiny")
    preset_path = CONFIG_DIR / f"{preset}.yml"
    if not preset_path.exists():
        raise ConfigError(f"preset: unknown preset {preset!r}; known: {', '.join(preset_names())}")
    _merge(layers, nest(_read_yaml(preset_path))[0])
    layers["preset"] = preset
    flat: dict[str, list[str]] = {}
    set_by_user: set[str] = set()
    for where, u in user:
        nested, flat[where] = nest(u)
        set_by_user |= {f"{k}.{n}" for k, v in nested.items() if isinstance(v, dict) for n in v} | set(nested)
        _merge(layers, nested)
    model = layers.setdefault("model", {})
    if model.get("init_from"):
        _merge(layers, checkpoint_keys(absolute(str(model["init_from"]), base_dir), layers, set_by_user))
    cfg = validate_dict(layers).with_absolute_paths(base_dir)
    for where, keys in flat.items():
        if where != "dict":  # a program's dict of overrides (tests, benchmarks, the DAG's hook) is not noted
            note_flat_keys(keys, where)
    return cfg


def _merge(into: dict[str, Any], layer: dict[str, Any]) -> None:
    """A nested layer over ``into``: a section's keys one by one, the run's own keys whole."""
    for key, value in layer.items():
        if key in SECTIONS and isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key].update(value)
        else:
            into[key] = value


_NOTED: set[str] = set()
log = logging.getLogger(__name__)


def note_flat_keys(keys: list[str], where: str) -> None:
    """One line saying that ``keys`` (flat keys of earlier versions, read from ``where``) have a section now.

    Logged once per process and source (a warning of ``training.config``: on stderr for ``rtrain``, in the
    task's log for Airflow)."""
    if not keys:
        return
    moved = ", ".join(f"{k} -> {'.'.join(FLAT[k])}" if k in FLAT else k for k in dict.fromkeys(keys))
    line = f"config: flat keys are deprecated, write them in their sections ({where}: {moved})"
    if line not in _NOTED:
        _NOTED.add(line)
        log.warning("%s", line)


def checkpoint_keys(uri: str, layers: dict[str, Any], user: set[str]) -> dict[str, Any]:
    """The keys a Hugging Face checkpoint sets (its model's shapes, its tokenizer), nested, checked against the
    ``section.key``s the user set."""
    from training.hf import HFError, checkpoint_keys

    try:
        found = checkpoint_keys(uri)
    except HFError as e:
        raise ConfigError(f"init_from: {e}") from None
    model = layers.get("model", {})
    for key, value in found.model.items():
        mine = model.get(key)
        if key == "n_kv_heads" and mine == 0:
            mine = model.get("n_heads")
        if f"model.{key}" in user and mine != value:
            raise ConfigError(f"init_from: {uri} has {key}={value!r}, the config sets {key}={mine!r}")
    keys: dict[str, Any] = {"model": dict(found.model)}
    if found.tokenizer and "data.tokenizer" not in user:
        keys["data"] = {"tokenizer": found.tokenizer}
    return keys


def validate_dict(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                msgs.append(f"{loc}: unknown key")
            elif loc:
                msgs.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
            else:  # a cross-field rule: its message names the keys (the input is the whole config)
                msgs.append(str(err["msg"]).removeprefix("Value error, "))
        raise ConfigError("invalid config: " + "; ".join(msgs)) from None


def describe_keys() -> list[dict[str, str]]:
    """Every config key as ``section.key`` (the run's own keys bare) with its type, default and description."""
    out = []
    fields = [(name, field) for name, field in RunKeys.model_fields.items()]
    fields += [(f"{sec}.{name}", f) for sec, section in SECTIONS.items() for name, f in section.model_fields.items()]
    for name, field in fields:
        ann = field.annotation
        typ = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
        out.append(
            {
                "key": name,
                "type": typ,
                "default": repr(field.get_default(call_default_factory=True)),
                "description": field.description or "",
            }
        )
    return out


def key_schema(key: str) -> dict[str, Any]:
    """The JSON schema of one key (``section.key``, a flat key of earlier versions or a run key); KeyError if none."""
    section, name = FLAT.get(key) or (key.partition(".")[0], key.partition(".")[2])
    model: type[BaseModel] = SECTIONS[section] if section in SECTIONS else RunKeys
    props = model.model_json_schema()["properties"]
    return dict(props[name if section in SECTIONS else key])


def format_config(cfg: Config) -> str:
    """A resolved config as ``rtrain config --show`` prints it: the run's keys, then each section's."""
    lines = []
    for key, value in cfg.model_dump(mode="json").items():
        if key not in SECTIONS:
            lines.append(f"{key:<26} {json.dumps(value)}")
    for key in SECTIONS:
        lines.append(f"{key}:")
        lines += [f"  {k:<24} {json.dumps(v)}" for k, v in getattr(cfg, key).model_dump(mode="json").items()]
    return "\n".join(lines)


def config_from_json(text: str) -> Config:
    """A config from its JSON form (a run's stored config.json): in sections, or flat as an earlier version wrote
    it (noted once per process; the run's next launch stores it in sections)."""
    data = json.loads(text)
    if isinstance(data, dict):
        nested, flat = nest(data)
        note_flat_keys(flat[:3] + (["..."] if len(flat) > 3 else []), "a run's config.json of an earlier version")
        data = nested
    return validate_dict(data) if isinstance(data, dict) else Config.model_validate(data)
