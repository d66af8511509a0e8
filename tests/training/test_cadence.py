"""The control plane's cadence: what a job's agents read and write, how often, and what it costs.

The counts come from the stores' own tally (``RTRAIN_STORE_OPS``), on a local path and on
gs:// (the emulator): a look that finds nothing new is a read by name, never a listing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from training import store_calls
from training.cadence import (
    BILLING,
    HEARTBEAT_WRITES_PER_S,
    billed,
    cadence,
    gcs_timing,
    steady_ops,
)
from training.checkpoint.lock import KEEP_GENERATIONS, LockLost, RunLock
from training.config import ConfigError, load_config
from training.elastic.rendezvous import Rendezvous, Round
from training.storage import Store, open_store
from training.store_calls import OPS_ENV


@pytest.fixture(params=["local", "gcs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return open_store(str(tmp_path / "root"))
    return open_store(request.getfixturevalue("gcs_root"))


@pytest.fixture
def tally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[store_calls.OpTally]:
    """This process's store calls, counted from now on."""
    monkeypatch.setenv(OPS_ENV, str(tmp_path / "ops"))
    monkeypatch.setattr(store_calls, "_TALLY", None)
    t = store_calls._tally()
    assert t is not None
    yield t
    monkeypatch.setattr(store_calls, "_TALLY", None)


def _calls(t: store_calls.OpTally, area: str) -> dict[str, int]:
    return {name.split(" ")[0]: n for name, n in t.counts.items() if name.endswith(f" {area}")}


def test_a_look_for_the_next_round_is_one_read_by_name(store: Store, tally: store_calls.OpTally) -> None:
    rdv = Rendezvous(store)
    for n in (1, 2, 3):
        rdv.open_round(Round(round=n, job="j", gen=1, leader="h0"))
    tally.counts.clear()
    assert [r.round for r in rdv.rounds_after(1)] == [2, 3]
    assert _calls(tally, "rendezvous") == {"get": 3}, "rounds 2 and 3, then 4 not found; no listing"
    tally.counts.clear()
    assert rdv.rounds_after(3) == []
    assert _calls(tally, "rendezvous") == {"get": 1}


def test_a_reader_behind_the_kept_rounds_finds_them_by_listing(store: Store) -> None:
    rdv = Rendezvous(store)
    for n in range(1, 6):
        rdv.open_round(Round(round=n, job="j", gen=1, leader="h0"))
    rdv.forget_rounds_before(4)
    assert rdv.rounds_after(1) == [], "round 2 is gone: the look by name stops there"
    assert [r.round for r in rdv.rounds_listed_after(1)] == [4, 5]


def test_a_look_at_the_lease_reads_by_name_and_follows_the_holder_s_renewals(
    store: Store, tally: store_calls.OpTally
) -> None:
    holder = RunLock(store, "leader", lease_s=60, job="j")
    holder.acquire()
    follower = RunLock(store, "follower", lease_s=60, job="j")
    assert follower.held_by()["owner"] == "leader"  # the first look lists
    tally.counts.clear()
    assert follower.held_by()["owner"] == "leader"
    assert _calls(tally, "lock") == {"get": 2}, "the generation seen, then the next one not found"
    for _ in range(3):
        holder.refresh()
    tally.counts.clear()
    gen, rec = follower.newest()
    assert (gen, rec and rec["action"]) == (holder.gen, "refresh")
    assert _calls(tally, "lock") == {"get": 2 + 3}, "the one seen, the three renewals since, the next"
    for _ in range(KEEP_GENERATIONS + 1):
        holder.refresh()
    tally.counts.clear()
    assert follower.newest()[0] == holder.gen
    assert "list" in _calls(tally, "lock"), "the generation it had seen is gone: it lists once"
    holder.release()
    assert follower.held_by() is None


def test_a_holder_that_renews_after_its_lease_was_taken_leaves_no_stray_generation(store: Store) -> None:
    sleeper = RunLock(store, "sleeper", lease_s=0.2, margin_s=0.0, job="j")
    sleeper.acquire()
    taker = RunLock(store, "taker", lease_s=60, margin_s=0.0, job="k")
    taker.newest()  # a taker watches the lease lapse by its own clock too
    time.sleep(0.3)
    taker.acquire()
    for _ in range(KEEP_GENERATIONS + 2):
        taker.refresh()
    with pytest.raises(LockLost):
        sleeper.refresh()  # writes the generation after its own, long dropped: not the newest
    reader = RunLock(store, "reader", lease_s=60)
    assert reader.held_by()["owner"] == "taker"
    names = [int(k.split("/")[-1][:-5]) for k in store.list("lock/")]
    assert len(names) == KEEP_GENERATIONS and max(names) - min(names) == KEEP_GENERATIONS - 1, names


def test_the_tally_reaches_its_file_within_a_second_for_any_process(tmp_path: Path) -> None:
    sink = tmp_path / "ops"
    code = (
        "import time\n"
        "from training.storage import open_store\n"
        f"s = open_store({str(tmp_path / 'root')!r})\n"
        "s.put('rendezvous/hosts/h0.json', b'{}')\n"
        "time.sleep(1.1)\n"
        "s.get('rendezvous/hosts/h0.json')\n"
        "s.list('events/')\n"
        "import os; os._exit(0)\n"  # no word at the end: what is older than a second is there
    )
    env = {**os.environ, OPS_ENV: str(sink)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
    (f,) = sink.glob("*.json")
    doc = json.loads(f.read_text())
    assert doc["counts"]["put rendezvous"] == 1 and doc["counts"]["get rendezvous"] == 1
    assert doc["role"] == "-c"


def test_gcs_jobs_beat_slower_as_they_grow_and_keep_the_write_rate() -> None:
    small, big = gcs_timing(2), gcs_timing(256)
    assert (small.heartbeat_s, small.heartbeat_timeout_s) == (1.0, 10.0)
    assert big.heartbeat_s == 256 / HEARTBEAT_WRITES_PER_S and big.heartbeat_timeout_s == 10 * big.heartbeat_s
    for hosts in (2, 64, 65, 256, 1024):
        assert hosts / gcs_timing(hosts).heartbeat_s <= HEARTBEAT_WRITES_PER_S
    cfg = load_config("tiny", None, {"root": "gs://b/runs", "min_workers": 2, "max_workers": 256})
    assert (cfg.elastic.heartbeat_s, cfg.elastic.heartbeat_timeout_s) == (4.0, 40.0)
    told = load_config("tiny", None, {"root": "gs://b/runs", "max_workers": 256, "heartbeat_s": 2.0})
    assert told.elastic.heartbeat_s == 2.0, "a value the user gave is kept"
    local = load_config("tiny", None, {"max_workers": 256})
    assert local.elastic.heartbeat_s == 0.5, "a local root is not billed"
    with pytest.raises((ConfigError, ValueError), match="a job of 256 hosts beats every 4 s unless told otherwise"):
        load_config("tiny", None, {"root": "gs://b/runs", "max_workers": 256, "heartbeat_timeout_s": 5.0})


def test_no_object_is_written_more_than_once_a_second_on_gcs() -> None:
    for hosts in (1, 2, 64, 256):
        t = gcs_timing(hosts)
        c = cadence(hosts, True, t.heartbeat_s, t.lease_s)
        assert c.step_beat_s >= 1.0 and c.heartbeat_s >= 1.0 and c.status_s >= 1.0 and c.lease_s / 4 >= 1.0
        assert hosts / c.hosts_read_s <= 256 or c.hosts_read_s == 0.25


def test_the_model_s_per_host_rate_falls_as_the_job_grows() -> None:
    rates = []
    for hosts in (2, 8, 64, 256):
        t = gcs_timing(hosts)
        rates.append(steady_ops(cadence(hosts, True, t.heartbeat_s, t.lease_s)))
    assert all(a.class_a > b.class_a for a, b in zip(rates, rates[1:], strict=False))
    assert rates[-1].class_a < 40, "a 256-host job's hosts each make fewer than 40 class A requests a minute"
    # A host beats, and looks for a round and at the lease by name: its own part, whatever the size.
    t = gcs_timing(256)
    own = 60 / t.heartbeat_s + 2 * 60 / t.heartbeat_s * BILLING["get"][1]
    assert rates[-1].class_a >= 60 / t.heartbeat_s and rates[-1].class_b >= own


def test_billing_counts_requests_by_class() -> None:
    r = billed({"put": 3, "create": 2, "get": 5, "list": 1, "delete": 4})
    assert (r.class_a, r.class_b) == (3 + 2 + 1, 2 + 5)


def test_the_documented_budget_is_the_model_s() -> None:
    from benchmarks.control_plane import budget

    doc = (Path(__file__).resolve().parents[2] / "docs" / "gke.md").read_text()
    for hosts, b in budget().items():
        line = (
            f"| {hosts} | {b['heartbeat_s']:.0f} s | {b['heartbeat_timeout_s']:.0f} s | {b['class_a']:.1f} | "
            f"{b['class_b']:.1f} | {b['class_a_per_day'] / 1e6:.2f} M |"
        )
        assert line in doc, f"docs/gke.md lacks the budget row {line}"


def test_an_agent_whose_worker_trains_looks_less_often_only_where_looks_are_billed() -> None:
    local, gcs = cadence(2, False, 0.5, 8.0), cadence(2, True, 1.0, 8.0)
    assert local.busy_poll_s == local.poll_s, "a local root is not billed: it looks as often as ever"
    assert gcs.busy_poll_s > gcs.poll_s
    assert (
        steady_ops(gcs).class_b
        < steady_ops(cadence(2, True, 1.0, 8.0).__class__(**{**gcs.__dict__, "busy_poll_s": gcs.poll_s})).class_b
    )
