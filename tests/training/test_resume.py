"""Where a job resumes: the resume order as a pure function of the committed steps and the ledger."""

from __future__ import annotations

import pytest

from training.checkpoint.resume import ResumeError, choose_resume


def test_the_newest_committed_step_the_ledger_does_not_hold_unusable() -> None:
    states = {8: {"state": "corrupt"}, 4: {"state": "committed"}}  # corrupt, still in checkpoints/
    assert choose_resume("latest", [4, 8], states, None).step == 4
    assert choose_resume("latest", [], {}, None).step is None
    with pytest.raises(ResumeError, match="unusable"):
        choose_resume("latest", [8], states, None)


def test_a_step_saved_again_after_its_corrupt_one_was_moved_out_is_resumed_from() -> None:
    # Step 8 failed its check and went to quarantine/; a later round saved step 8 again, and Orbax committed
    # it, but its writer died before the ledger recorded the commit: the ledger still says corrupt.
    moved = {8: {"state": "corrupt", "location": "quarantine/8-1"}, 4: {"state": "committed"}}
    decision = choose_resume("latest", [4, 8], moved, None)
    assert decision.step == 8, decision
    assert choose_resume("8", [4, 8], moved, None).step == 8
    assert choose_resume("latest", [4], moved, None).step == 4  # the moved one itself is never a candidate
