"""Which checkpoint steps are committed, as Orbax decides: a listing of them all, and a look at one."""

from __future__ import annotations

import pytest

from training.checkpoint.steps import committed_steps, is_committed
from training.storage import open_store


@pytest.mark.parametrize("where", ["local", "gs"])
def test_one_step_is_judged_as_the_listing_judges_it(where: str, tmp_path, request) -> None:
    run = str(tmp_path / "run") if where == "local" else request.getfixturevalue("gcs_root")
    store = open_store(run)
    if where == "local":  # a renamed directory is committed; a temporary one is a save in flight
        store.put("checkpoints/5/state/data.bin", b"x")
        store.put("checkpoints/10.orbax-checkpoint-tmp-1733/state/data.bin", b"x")
    else:  # on gs:// a commit marker says it
        store.put("checkpoints/5/state/data.bin", b"x")
        store.put("checkpoints/5/commit_success.txt", b"")
        store.put("checkpoints/10/state/data.bin", b"x")
    assert committed_steps(run) == [5]
    assert is_committed(run, 5)
    assert not is_committed(run, 10)  # in flight
    assert not is_committed(run, 7)  # never saved
