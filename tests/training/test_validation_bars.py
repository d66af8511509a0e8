"""A checkpoint's validation metrics against the checkpoint section's bars (lifecycle.quality_reasons)."""

from __future__ import annotations

import math

from training.checkpoint.lifecycle import quality_reasons
from training.sections import CheckpointSection


def test_metrics_within_every_bar_give_no_reason() -> None:
    ck = CheckpointSection.model_validate({"val_tolerance": 0.1, "val_max_loss": 3.0, "val_min_accuracy": 0.2})
    assert quality_reasons({"loss": 2.1, "accuracy": 0.5}, (10, 2.0), ck) == []


def test_each_bar_missed_is_named_with_its_numbers() -> None:
    ck = CheckpointSection.model_validate({"val_tolerance": 0.1, "val_max_loss": 3.0, "val_min_accuracy": 0.6})
    assert quality_reasons({"loss": 3.5, "accuracy": 0.5}, (10, 2.0), ck) == [
        "loss 3.5000 is worse than the best validated 2.0000 (step 10) by more than 10%",
        "loss 3.5000 > val_max_loss 3.0",
        "accuracy 0.5000 < val_min_accuracy 0.6",
    ]


def test_bars_at_zero_are_off_and_a_first_checkpoint_has_no_best_to_regress_from() -> None:
    ck = CheckpointSection.model_validate({"val_tolerance": 0.1, "val_max_loss": 0.0, "val_min_accuracy": 0.0})
    assert quality_reasons({"loss": 99.0, "accuracy": 0.0}, None, ck) == []


def test_a_non_finite_loss_is_not_compared_with_the_best() -> None:
    ck = CheckpointSection.model_validate({"val_tolerance": 0.1, "val_max_loss": 0.0, "val_min_accuracy": 0.0})
    assert quality_reasons({"loss": math.nan}, (10, 2.0), ck) == []
