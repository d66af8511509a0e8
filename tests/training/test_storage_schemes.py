"""The storage schemes' registry: a URI's prefix chooses the scheme, its traits and its store; a new one is a class."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from training.config import absolute, load_config
from training.storage import (
    SCHEMES,
    GCSStore,
    LocalStore,
    Scheme,
    StorageScheme,
    Store,
    disturb,
    open_store,
    scheme,
    scheme_of,
    storage_scheme,
)


class Shelf(StorageScheme):
    """``shelf://name/...``: a directory of the test's, named as an object store would be (a scheme of this test)."""

    name = "shelf-for-test"
    prefix = "shelf://"
    base = Path()

    def traits(self, uri: str) -> Scheme:
        return Scheme("shelf", False, True, True, False)

    def open(self, uri: str) -> Store:
        return LocalStore(self.base / uri.removeprefix(self.prefix))

    def unreachable(self, op: str, key: str) -> Exception:
        return ConnectionError(f"shelf unreachable: {op} {key}")


@pytest.fixture
def shelf(tmp_path: Path) -> Iterator[Path]:
    Shelf.base = tmp_path
    storage_scheme(Shelf)
    try:
        yield tmp_path
    finally:
        del SCHEMES[Shelf.name]


def test_the_prefix_chooses_the_scheme_and_a_path_no_scheme_claims_is_local(tmp_path: Path) -> None:
    assert scheme_of("gs://b/p").name == "gs" and scheme_of(str(tmp_path)).name == "file"
    assert scheme_of("relative/dir").name == "file" and scheme_of("gsx://b").name == "file"
    assert (scheme("gs://b/p").requests, scheme("gs://b/p").filesystem) == (True, False)
    assert (scheme(str(tmp_path)).requests, scheme(str(tmp_path)).filesystem) == (False, True)
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    with pytest.raises(ValueError, match="no bucket"):
        GCSStore("gs://")
    with pytest.raises(ValueError, match="registered twice"):
        storage_scheme(type(SCHEMES["gs"]))


def test_a_new_scheme_is_one_class_its_store_its_traits_and_its_errors(shelf: Path) -> None:
    store = open_store("shelf://runs/r1")
    store.put("config.json", b"{}")
    assert (shelf / "runs" / "r1" / "config.json").read_bytes() == b"{}" and store.get("config.json") == b"{}"
    assert scheme("shelf://runs").name == "shelf" and absolute("shelf://runs") == "shelf://runs"
    cfg = load_config("tiny", None, ["root=shelf://runs", "run_name=r1"])
    assert cfg.root == "shelf://runs" and cfg.run_uri == "shelf://runs/r1"
    assert cfg.elastic.heartbeat_s == 1.0, "a scheme whose looks are requests paces the job's beats for it"
    assert str(scheme_of("shelf://runs").unreachable("get", "config.json")) == "shelf unreachable: get config.json"


def test_a_disturbed_root_fails_with_its_scheme_s_own_error(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.put("k", b"v")
    disturb(str(tmp_path), for_s=30.0)
    try:
        with pytest.raises(OSError, match="unreachable"):
            store.get("k")
    finally:
        disturb(str(tmp_path), for_s=0.0)
    assert store.get("k") == b"v"
    assert "unreachable" in str(scheme_of("gs://b").unreachable("get", "k"))
