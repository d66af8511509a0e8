"""Fixtures for engine tests: a small prepared dataset and a job runner."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    from training import data

    out = tmp_path_factory.mktemp("dataset") / "stdlib"
    data.prepare(None, str(out), 64, max_bytes=300_000)
    return str(out)


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    # One persistent compilation cache for the whole session: later jobs on a
    # mesh seen before skip compilation, as a resumed production job would.
    return str(tmp_path_factory.mktemp("jax-cache"))


@pytest.fixture
def not_a_subreaper_after() -> Iterator[None]:
    """A fork server makes the process that starts it a child subreaper (as it makes an agent): not the test run
    past the test, or the processes later tests orphan would stay its zombies instead of being reaped by init."""
    yield
    from training import procctl

    procctl.prctl(procctl.PR_SET_CHILD_SUBREAPER, 0)
