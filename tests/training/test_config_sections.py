"""The config in sections: YAML and overrides by section, flat keys of earlier versions still read (with one note)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from training.config import (
    ConfigError,
    config_from_json,
    describe_keys,
    format_config,
    key_schema,
    load_config,
    validate_dict,
)
from training.sections import FLAT, SECTIONS, ModelSection, OptimizerSection

DATA = Path(__file__).parent / "data"
SECTIONED = """
run_name: sec
model:
  d_model: 128
  n_heads: 8
optimizer:
  name: lion
  steps: 9
elastic:
  max_workers: 4
"""
FLAT_YAML = "run_name: sec\nd_model: 128\nn_heads: 8\noptimizer: lion\nsteps: 9\nmax_workers: 4\n"


def test_a_yaml_in_sections_and_one_in_flat_keys_give_the_same_config(tmp_path: Path) -> None:
    (tmp_path / "sec.yml").write_text(SECTIONED)
    (tmp_path / "flat.yml").write_text(FLAT_YAML)
    sec = load_config("tiny", [str(tmp_path / "sec.yml")])
    flat = load_config("tiny", [str(tmp_path / "flat.yml")])
    assert sec == flat
    assert (sec.model.d_model, sec.optimizer.name, sec.optimizer.steps, sec.elastic.max_workers) == (128, "lion", 9, 4)
    assert sec.model.n_layers == 2, "a section given in part keeps the preset's other keys"


def test_section_key_overrides_win_over_the_layers_below() -> None:
    cfg = load_config("small", None, ["model.d_model=256", "optimizer.learning_rate=1e-4", "elastic.chaos=[]"])
    assert (cfg.model.d_model, cfg.optimizer.learning_rate, cfg.model.n_layers) == (256, 1e-4, 4)
    assert cfg.d_model == 256, "the flat name reads the same key"  # type: ignore[attr-defined]


def test_flat_overrides_are_noted_once_naming_their_sections(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="training.config"):
        for _ in range(3):
            cfg = load_config("tiny", None, ["steps=11", "min_workers=2", "max_workers=2"])
    notes = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert cfg.optimizer.steps == 11 and cfg.elastic.min_workers == 2
    assert notes == [
        "config: flat keys are deprecated, write them in their sections (key=value overrides: steps -> "
        "optimizer.steps, min_workers -> elastic.min_workers, max_workers -> elastic.max_workers)"
    ]


def test_keys_in_sections_give_no_note(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="training.config"):
        load_config("tiny", None, ["optimizer.steps=12"])
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.nope=1", "model.nope: unknown key"),
        ("nosection.x=1", "nosection.x: unknown key"),
        ("model.d_model=abc", "model.d_model:"),
        ("d_model=abc", "model.d_model:"),
        ("optimizer.name=adam", "optimizer.name:"),
    ],
)
def test_a_bad_key_in_a_section_is_refused_naming_section_and_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", None, [override])


def test_a_copy_with_flat_or_section_keys_leaves_the_original_as_it_was() -> None:
    cfg = load_config("tiny")
    copy = cfg.model_copy(update={"steps": 99, "model.d_model": 32, "checkpoint": {"keep_last": 7}})
    assert (copy.optimizer.steps, copy.model.d_model, copy.checkpoint.keep_last) == (99, 32, 7)
    copy.optimizer.learning_rate = 0.5
    copy.seed = 3  # type: ignore[attr-defined]  # a flat set: the key in its section
    assert (cfg.optimizer.steps, cfg.model.d_model, cfg.optimizer.learning_rate, cfg.optimizer.seed) == (
        40,
        64,
        3e-3,
        0,
    )
    assert copy.optimizer.seed == 3
    with pytest.raises(ValueError, match="steps"):
        copy.steps = "many"  # type: ignore[attr-defined]


def test_local_paths_are_made_absolute_in_their_sections_and_the_original_is_kept(tmp_path: Path) -> None:
    relative = {
        "root": "runs",
        "data": {"dataset": "toks", "tokenizer": "tok/tokenizer.json"},
        "placement": {"compilation_cache": "cache"},
        "checkpoint": {"local_checkpoint_dir": "local"},
        "model": {"init_from": "hf/llama"},
    }
    cfg = validate_dict(relative)
    out = cfg.with_absolute_paths(tmp_path)
    got = (
        out.root,
        out.data.dataset,
        out.data.tokenizer,
        out.placement.compilation_cache,
        out.checkpoint.local_checkpoint_dir,
        out.model.init_from,
    )
    assert got == tuple(str(tmp_path / p) for p in ("runs", "toks", "tok/tokenizer.json", "cache", "local", "hf/llama"))
    assert (cfg.root, cfg.data.dataset, cfg.placement.compilation_cache, cfg.model.init_from) == (
        "runs",
        "toks",
        "cache",
        "hf/llama",
    )
    task = validate_dict({"task": "mine/task.py:make"}).with_absolute_paths(tmp_path).task
    assert task == f"{tmp_path / 'mine/task.py'}:make"
    kept = validate_dict({"root": "gs://b/runs", "data": {"tokenizer": "bpe", "dataset": "gs://b/toks"}})
    kept = kept.with_absolute_paths(tmp_path)
    assert (kept.root, kept.data.tokenizer, kept.data.dataset, kept.checkpoint.local_checkpoint_dir) == (
        "gs://b/runs",
        "bpe",
        "gs://b/toks",
        "",
    )


def test_the_stored_form_is_in_sections_and_reads_back_equal() -> None:
    cfg = load_config("small", None, ["run_name=x"])
    stored = json.loads(cfg.to_json())
    assert set(SECTIONS) <= set(stored) and stored["model"]["d_model"] == 128 and "d_model" not in stored
    assert config_from_json(cfg.to_json()) == cfg


def test_an_old_flat_config_json_reads_into_the_same_sections(caplog: pytest.LogCaptureFixture) -> None:
    text = (DATA / "config-0.1-tiny.json").read_text()
    old = json.loads(text)
    with caplog.at_level(logging.WARNING, logger="training.config"):
        cfg = config_from_json(text)
        config_from_json(text)
    for key, (section, name) in FLAT.items():
        if key in old and key not in ("attention", "activation_checkpointing", "checkpoint_format"):
            assert getattr(getattr(cfg, section), name) == old[key], key
    assert (cfg.optimizer.name, cfg.model.attention, cfg.model.remat) == (old["optimizer"], "xla", "none")
    assert (old["checkpoint_format"], cfg.checkpoint.checkpoint_format) == ("lean", "auto")  # lean is retired
    assert len([r for r in caplog.records if "config.json of an earlier version" in r.getMessage()]) <= 1


def test_the_shown_config_and_the_key_list_are_in_sections() -> None:
    shown = format_config(load_config("tiny"))
    assert "\nmodel:\n  vocab_size" in shown and "\noptimizer:\n  steps" in shown and "\nplacement:\n" in shown
    keys = [k["key"] for k in describe_keys()]
    assert "model.d_model" in keys and "optimizer.name" in keys and "run_name" in keys and "d_model" not in keys
    assert len(keys) == len(FLAT) - 1 + 5  # every key of a section (less the legacy one) and the run's own five


def test_a_key_s_schema_is_its_section_field_s_by_either_name() -> None:
    assert key_schema("elastic.max_workers") == key_schema("max_workers")
    assert key_schema("optimizer") == OptimizerSection.model_json_schema()["properties"]["name"]
    assert key_schema("model.remat") == ModelSection.model_json_schema()["properties"]["remat"]
    with pytest.raises(KeyError):
        key_schema("no_such_key")


def test_a_flat_read_in_the_code_is_a_type_error(tmp_path: Path) -> None:
    """The flat names are for users' configs and old code: the type checker knows only the sections, so a flat
    read (``cfg.learning_rate``) cannot slip back into the engine unseen."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    code = tmp_path / "reads.py"
    code.write_text(
        "from training.config import Config\n\n\n"
        "def flat(cfg: Config) -> float:\n    return cfg.learning_rate\n\n\n"
        "def sectioned(cfg: Config) -> float:\n    return cfg.optimizer.learning_rate\n"
    )
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(repo / "pyproject.toml"),
            "--follow-imports=silent",
            str(code),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    errors = [line for line in checked.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and 'reads.py:5: error: "Config" has no attribute "learning_rate"' in errors[0], (
        checked.stdout
    )
