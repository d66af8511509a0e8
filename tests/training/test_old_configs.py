"""A run's config.json written by an earlier version still reads: old runs can be resumed, validated and exported."""

from __future__ import annotations

from pathlib import Path

from training.config import config_from_json

DATA = Path(__file__).parent / "data"


def test_a_config_written_before_attention_and_remat_became_choices_still_reads() -> None:
    # Written by the config code of commit cabb165 (the tiny preset, defaults written out as a run stores them).
    text = (DATA / "config-0.1-tiny.json").read_text()
    assert '"attention": "dot_product"' in text and '"activation_checkpointing": false' in text
    cfg = config_from_json(text)
    assert (cfg.model.attention, cfg.model.remat, cfg.run_name) == ("xla", "none", "old")
