"""The elastic engine end to end: one host agent per simulated host, real JAX processes, gloo, SIGKILLs.

Each test runs the production design on the local slice: N host agents that
meet in the rendezvous on the run root, a leader holding the run lock's lease,
and a real multi-process JAX program per round.  Hosts are lost by killing
their agent's process group (agent, worker, standby), frozen with SIGSTOP,
and given back through the pool's capacity, as Kubernetes would.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time

import numpy as np
import pytest
from jobs import (
    assert_exact_data,
    hosts,
    job_config,
    kill_host,
    run_job,
    start_job,
    step_ids,
    wait_finished,
    wait_for,
    worker_logs,
)

from training import api
from training.backends import local
from training.elastic.capacity import LocalCapacity
from training.storage import open_store

pytestmark = pytest.mark.slow


def _events(run_uri: str, *types: str) -> list[api.Event]:
    return api.events(run_uri, types or None)


def _final_state(run_uri: str, step: int) -> dict:
    from training.checkpoint.manager import load_state_host

    return load_state_host(run_uri, step)


def _restored_the_newest_committed(run_uri: str, restored: int) -> bool:
    """The restore took the newest committed checkpoint: at least the newest committed before the failure.

    Async saves commit in the background: one still in flight when a process died may be finalised
    by Orbax after the failure, or before it with its worker gone before it could report the commit,
    and the next round rightly restores it.  So the contract is "no older than the newest committed
    before the failure, and committed (finalised on storage, Orbax's rule)", not a step number.
    """
    evs = _events(run_uri)
    i = next(i for i, e in enumerate(evs) if e["type"] == "failure")
    before = max(e["step"] for e in evs[:i] if e["type"] == "checkpoint" and e["committed"])
    return restored >= before and restored in api.committed_steps(run_uri)


def test_a_lost_host_leaves_the_survivors_training_and_its_return_grows_the_group(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="lose-host",
        # Room for the returning host to start and warm up before the job ends: with saves that cost the
        # loop little, the 12 steps after its return at step 16 can pass before it is ready.
        steps=60,
        min_workers=2,
        max_workers=4,
        checkpoint_every=4,
        chaos=["preempt:worker=1,step=11", "capacity:to=4,step=16"],
        trace_data_ids=True,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    st = api.status(cfg.run_uri)
    assert st["state"] == "finished" and st["step"] == 60 and st["workers"] == 4

    # The host was lost (agent and worker): the leader saw it go within a second or two.
    [failure] = _events(cfg.run_uri, "failure")
    [lost] = _events(cfg.run_uri, "host_lost")
    assert failure["hosts"] == [lost["host"]] and "lost" in failure["reason"]
    # Its agent's connection to the leader ended with it: known gone at once, not after a settle.
    assert lost["reason"] == "agent gone" and "(agent gone)" in failure["reason"], (lost, failure)
    # The survivors' workers see a vanished peer within about a second; when the lost host was the leader,
    # its lease has to lapse first (lease_s and the takeover margin) before another agent acts on it.
    from training.checkpoint.lock import DEFAULT_MARGIN_S

    led = _events(cfg.run_uri, "leader")[0]["host"] == lost["host"]
    detect_s = failure["detect_s"]
    assert detect_s is not None and 0 <= detect_s < (
        cfg.elastic.lease_s + DEFAULT_MARGIN_S + cfg.elastic.heartbeat_timeout_s if led else 2.5
    ), (
        led,
        failure,
    )
    # The survivors were already waiting in the next step's collectives for the lost worker when it went
    # (it stopped before that step): such a collective does not fail, so the peer watch told them.
    assert failure["detected_by"] == "peer watch", failure
    # 3 hosts are left, but 16 sequences do not split over 3: the round takes 2; then the host
    # comes back (a new agent joins) and the group grows at a checkpoint boundary.
    assert [e["workers"] for e in _events(cfg.run_uri, "launch")] == [4, 2, 4]
    assert [(e["old_workers"], e["new_workers"]) for e in _events(cfg.run_uri, "resize")] == [(4, 2), (2, 4)]
    restores = _events(cfg.run_uri, "restore")
    assert _restored_the_newest_committed(cfg.run_uri, restores[0]["step"])
    assert restores[0]["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
    rescale = _events(cfg.run_uri, "rescale_requested")[0]
    assert rescale["step"] % 4 == 0 and restores[-1]["step"] == rescale["step"]
    assert len(_events(cfg.run_uri, "failure")) == 1, "growing is not a failure"
    # The survivors' agents stayed up the whole time (started before the loss); the lost host's
    # agent is a new one.
    records = hosts(cfg.run_uri)
    survivors = {h for h in records if h != lost["host"]}
    assert len(survivors) == 3 and all(records[h].started < failure["time"] for h in survivors)
    assert records[lost["host"]].started > failure["time"]
    assert_exact_data(cfg.run_uri, tiny_dataset, cfg)


def test_a_lone_leader_s_restarted_agent_takes_its_predecessor_s_lease_at_once(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="lone-leader",
        steps=400,  # one host steps in about 20 ms: room for the kill well before the end
        min_workers=1,
        max_workers=1,
        checkpoint_every=20,
    )
    handle = start_job(cfg)
    st = wait_for(lambda: (s := api.status(cfg.run_uri)) and (s.get("step") or 0) >= 20 and s, 240, "step 20")
    assert st["state"] == "running" and st["step"] < 200, st
    killed_at = time.time()
    kill_host(cfg.run_uri, "h0")  # its only host's agent and worker: the local slice starts a new agent there
    st = wait_finished(handle)
    assert st["state"] == "finished" and st["step"] == 400, worker_logs(cfg.run_uri)
    # No other agent held a connection to the dead leader. The new one, on the same host, dialled its
    # predecessor's listener: refused, so that agent has exited, and its lease is taken without a lapse.
    [taken] = [e for e in _events(cfg.run_uri, "lock") if e["action"] == "takeover" and e["time"] > killed_at]
    assert taken["holder_exited"] is True and taken["previous_owner"].startswith("agent h0 "), taken
    assert taken["time"] < float(taken["previous_expires_at"]) + cfg.elastic.lease_s, taken
    assert [e["workers"] for e in _events(cfg.run_uri, "launch")] == [1, 1]


def test_losing_the_leader_s_host_another_agent_leads_and_the_run_goes_on(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="lose-leader",
        steps=24,
        min_workers=2,
        max_workers=4,
        checkpoint_every=4,
        trace_data_ids=True,
    )
    handle = start_job(cfg)
    st = wait_for(lambda: (s := api.status(cfg.run_uri)) and (s.get("step") or 0) >= 9 and s, 240, "step 9")
    first_leader = st["leader"]
    # The pool shrinks with the leader's node: that host is the one that goes (not merely "one host fewer",
    # which would let the local slice stop another one first).
    LocalCapacity(open_store(cfg.run_uri), default=cfg.elastic.max_workers).leave(
        first_leader, reason="the leader's node is gone"
    )
    kill_host(cfg.run_uri, first_leader)
    st = wait_finished(handle)
    assert st["state"] == "finished" and st["step"] == 24, worker_logs(cfg.run_uri)

    leaders = _events(cfg.run_uri, "leader")
    assert [e["host"] for e in leaders][0] == first_leader
    assert leaders[-1]["host"] != first_leader and leaders[-1]["reason"] == "took over a running job"
    # The next agent knew the leader's agent had exited (its host-watch connection was closed by the dead
    # process's kernel): it took the lease over without waiting for it to lapse.
    takeovers = [e for e in _events(cfg.run_uri, "lock") if e["action"] == "takeover" and not e.get("handoff")]
    assert takeovers[-1]["holder_exited"] is True, takeovers
    [failure] = _events(cfg.run_uri, "failure")
    assert failure["hosts"] == [first_leader]
    assert "(agent gone)" in failure["reason"], failure
    assert failure["detected_by"] == "peer watch", failure  # the survivors' workers left at once
    assert [e["workers"] for e in _events(cfg.run_uri, "launch")] == [4, 2]
    assert _restored_the_newest_committed(cfg.run_uri, _events(cfg.run_uri, "restore")[0]["step"])
    assert_exact_data(cfg.run_uri, tiny_dataset, cfg)


def test_a_killed_agent_takes_its_worker_along_and_a_frozen_host_is_dropped_after_its_heartbeat(
    tmp_path, tiny_dataset, jax_cache
):
    import psutil

    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="agents",
        steps=30,
        min_workers=2,
        max_workers=4,
        checkpoint_every=4,
        heartbeat_timeout_s=3.0,
        # Rank 1's agent is killed at step 6 (its host stays, so the agent comes back and the group
        # grows again at a checkpoint); rank 2's whole host freezes at step 21: no error anywhere,
        # only a heartbeat that stops.
        chaos=["kill_agent:worker=1,step=6", "freeze:worker=2,step=21"],
        trace_data_ids=True,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    assert api.status(cfg.run_uri)["step"] == 30

    kill, freeze = _events(cfg.run_uri, "chaos")[:2]
    assert (kill["action"], freeze["action"]) == ("kill_agent", "freeze")
    # The killed agent's worker died with it (PR_SET_PDEATHSIG): its pid is gone.
    dead = [e for e in _events(cfg.run_uri, "worker_started") if e["host"] == kill["host"]][0]
    assert not psutil.pid_exists(dead["pid"]) or psutil.Process(dead["pid"]).status() == psutil.STATUS_ZOMBIE
    failures = _events(cfg.run_uri, "failure")
    assert len(failures) == 2
    from training.checkpoint.lock import DEFAULT_MARGIN_S

    led = _events(cfg.run_uri, "leader")[0]["host"] == kill["host"]  # a killed leader's lease lapses first
    detect_s = failures[0]["detect_s"]
    assert detect_s is not None and 0 <= detect_s < (
        cfg.elastic.lease_s + DEFAULT_MARGIN_S + cfg.elastic.heartbeat_timeout_s if led else 2.5
    )
    assert failures[0]["detected_by"] in ("peer watch", "host watch"), failures[0]  # its worker died with it
    # The frozen host raised no error: it is found by its heartbeat, within the timeout (and a poll).
    [frozen] = [e for e in _events(cfg.run_uri, "host_lost") if e["host"] == freeze["host"]]
    assert failures[1]["hosts"] == [freeze["host"]]
    detect_s = failures[1]["detect_s"]
    assert detect_s is not None and detect_s < cfg.elastic.heartbeat_timeout_s + 2.0
    # A frozen process keeps its connections open (its kernel still answers): not the peer watch's to see.
    assert failures[1]["detected_by"] == "heartbeat timeout", failures[1]
    assert frozen["time"] > freeze["time"]
    # The killed agent's host stays: its new agent either rejoins before the recovery round forms (4 again
    # at once) or after it (2, then growing back to 4 at a checkpoint); the frozen host takes the group to 2.
    assert [e["workers"] for e in _events(cfg.run_uri, "launch")] in ([4, 4, 2], [4, 2, 4, 2])
    assert_exact_data(cfg.run_uri, tiny_dataset, cfg)


def test_two_launches_of_one_run_one_trains_the_other_is_refused_naming_the_holder_and_writes_nothing(
    tmp_path, tiny_dataset, jax_cache
):
    cfg = job_config(str(tmp_path), tiny_dataset, jax_cache, run_name="twice", steps=12, min_workers=1, max_workers=1)
    handle = start_job(cfg)
    store = open_store(cfg.run_uri)
    config_before = store.get("config.json")
    history_before = store.list("config-history/")
    wait_for(lambda: (api.status(cfg.run_uri) or {}).get("leader"), 120, "a leader")
    other = cfg.model_copy(update={"learning_rate": 0.5, "chaos": ["crash:worker=0,step=3"]})
    with pytest.raises(api.LaunchRefused, match=rf"run {cfg.run_uri} is locked by 'agent h0 of job {handle['job']}'"):
        local.launch(other)
    # Nothing of the refused launch was written: config, its history, the capacity, the status.
    assert store.get("config.json") == config_before and store.list("config-history/") == history_before
    assert api.status(cfg.run_uri)["job"] == handle["job"]
    st = wait_finished(handle)
    assert st["state"] == "finished" and st["step"] == 12
    assert json.loads(store.get("config.json"))["optimizer"]["learning_rate"] == cfg.optimizer.learning_rate
    assert not _events(cfg.run_uri, "chaos")


@pytest.mark.extended
def test_resume_parity_same_topology_bitwise_and_across_topologies_within_tolerance(tmp_path, tiny_dataset, jax_cache):
    common = dict(steps=20, checkpoint_every=5, min_workers=1, max_workers=2, trace_data_ids=True)
    plain = job_config(str(tmp_path), tiny_dataset, jax_cache, run_name="plain", **common)
    same = job_config(
        str(tmp_path), tiny_dataset, jax_cache, run_name="same", chaos=["crash:worker=1,step=12"], **common
    )
    moved = job_config(
        str(tmp_path), tiny_dataset, jax_cache, run_name="moved", chaos=["preempt:worker=1,step=12"], **common
    )
    for cfg in (plain, same, moved):
        assert run_job(cfg) == 0, worker_logs(cfg.run_uri)

    # The crash kept the host (its agent restarts the worker); the preemption moved the job from 2 hosts to 1.
    assert [e["workers"] for e in _events(same.run_uri, "launch")] == [2, 2]
    assert [e["workers"] for e in _events(moved.run_uri, "launch")] == [2, 1]
    assert _restored_the_newest_committed(same.run_uri, _events(same.run_uri, "restore")[0]["step"])

    a, b, c = (_final_state(cfg.run_uri, 20) for cfg in (plain, same, moved))
    import jax

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y)), "same-topology resume must be bitwise identical"
    # Across topologies the reductions run in another order: equal up to float rounding.
    worst = max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(c["params"]), strict=True)
    )
    assert worst < 1e-4, f"cross-topology resume drifted by {worst}"
    ids = [step_ids(cfg.run_uri) for cfg in (plain, same, moved)]
    assert ids[0] == ids[1] == ids[2], "the examples of every step are the same in all three runs"


def test_kill_during_async_save_restores_previous_committed_checkpoint(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="cut-save",
        steps=15,
        checkpoint_every=5,
        min_workers=2,
        max_workers=2,
        chaos=["kill_during_save:worker=0,step=10"],
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    [chaos] = _events(cfg.run_uri, "chaos")
    assert chaos["action"] == "kill_during_save" and chaos["step"] == 10
    # The blame is the killed process's, not its peer's: worker 1 left at once through the peer watch,
    # and its report (which may come first) names worker 0 as the one that went.
    [failure] = _events(cfg.run_uri, "failure")
    assert failure["worker"] == 0 and failure["returncode"] == -9 and failure["hosts"] == [chaos["host"]], failure
    # The save of step 10 was cut off: the job resumed from 5, never from the partial 10.
    [restore] = _events(cfg.run_uri, "restore")
    assert restore["step"] == 5
    assert api.committed_steps(cfg.run_uri) == [5, 10, 15]
    leftovers = [p for p in (tmp_path / "cut-save" / "checkpoints").iterdir() if not p.name.isdigit()]
    assert not [p for p in leftovers if "tmp" in p.name], f"partial checkpoint left behind: {leftovers}"


@pytest.mark.gcs
@pytest.mark.extended
def test_on_a_gcs_root_the_rendezvous_and_a_recovery_work_too(gcs_root, tiny_dataset, jax_cache):
    cfg = job_config(
        gcs_root,
        tiny_dataset,
        jax_cache,
        run_name="gcs-run",
        steps=12,
        checkpoint_every=4,
        min_workers=1,
        max_workers=2,
        # The GCS emulator serves one request at a time: under a checkpoint's uploads a heartbeat can wait long.
        heartbeat_timeout_s=30.0,
        lease_s=15.0,
        chaos=["preempt:worker=1,step=10"],
    )
    assert run_job(cfg) == 0
    assert cfg.run_uri.startswith("gs://")
    [restore] = _events(cfg.run_uri, "restore")
    # Saving step 8 waited for step 4's commit, so at least step 4 is there to resume from.
    assert _restored_the_newest_committed(cfg.run_uri, restore["step"]) and restore["step"] >= 4
    assert restore["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
    assert api.status(cfg.run_uri)["state"] == "finished"
    assert api.committed_steps(cfg.run_uri) == [4, 8, 12]
    store = open_store(cfg.run_uri)
    assert store.exists("config.json") and store.list("events/") and store.list("rendezvous/rounds/")
    assert sorted(hosts(cfg.run_uri)) == ["h0", "h1"]


@pytest.mark.gcs
def test_a_gcs_dataset_read_in_place_keeps_the_exact_data_position_across_a_lost_host(
    tmp_path, gcs_root, tiny_dataset, jax_cache
):
    """Each host reads its own records of a gs:// dataset in place (no download); a lost host changes nothing."""
    from pathlib import Path

    from training.data import load_manifest

    dataset = f"{gcs_root}/in-place-ds"
    store = open_store(dataset)
    for f in sorted(Path(tiny_dataset).iterdir()):
        if f.is_file() and not f.name.startswith("."):
            store.put(f.name, f.read_bytes())
    downloads = Path.home() / ".cache" / "rtrain" / "datasets" / load_manifest(dataset)["fingerprint"]
    shutil.rmtree(downloads, ignore_errors=True)
    cfg = job_config(
        str(tmp_path),
        dataset,
        jax_cache,
        run_name="gcs-data",
        dataset_reads="direct",
        steps=16,
        checkpoint_every=4,
        min_workers=1,
        max_workers=2,
        chaos=["preempt:worker=1,step=10"],
        trace_data_ids=True,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    assert [e["workers"] for e in _events(cfg.run_uri, "launch")] == [2, 1]
    assert not downloads.exists(), "a host downloaded the dataset"
    assert_exact_data(cfg.run_uri, tiny_dataset, cfg)


@pytest.mark.extended
def test_whole_slices_a_host_lost_takes_its_slice_out_of_the_next_round(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="slices",
        steps=16,
        checkpoint_every=4,
        min_workers=2,
        max_workers=4,
        hosts_per_slice=2,
        chaos=["preempt:worker=3,step=9"],
        trace_data_ids=True,
    )
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    launches = _events(cfg.run_uri, "launch")
    assert [e["workers"] for e in launches] == [4, 2]
    # Slice 1 lost one host: both of its hosts leave the round; slice 0 trains on (ICI inside it).
    assert launches[0]["members"] == ["s0-h0", "s0-h1", "s1-h0", "s1-h1"]
    assert launches[1]["members"] == ["s0-h0", "s0-h1"]
    assert launches[1]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}  # ici fsdp over the slice's 4 devices
    assert_exact_data(cfg.run_uri, tiny_dataset, cfg)


def test_below_minimum_capacity_the_job_waits_keeping_its_lease_then_goes_on(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="wait",
        steps=12,
        checkpoint_every=4,
        min_workers=2,
        max_workers=2,
        capacity_timeout_s=60,
        chaos=["preempt:worker=1,step=6"],
    )
    refused: list[str] = []

    def give_back_a_host() -> None:  # capacity returns while the job waits, as an operator would do it
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = api.status(cfg.run_uri) if (tmp_path / "wait").exists() else None
            if st and st.get("state") == "waiting_for_capacity":
                time.sleep(3 * cfg.elastic.lease_s)  # longer than a lease: the waiting leader must keep it
                try:
                    local.launch(cfg.model_copy(update={"learning_rate": 0.1}))
                except api.LaunchRefused as e:
                    refused.append(str(e))
                api.set_capacity(cfg.run_uri, 2, reason="host repaired")
                return
            time.sleep(0.2)

    helper = threading.Thread(target=give_back_a_host, daemon=True)
    helper.start()
    assert run_job(cfg) == 0, worker_logs(cfg.run_uri)
    helper.join(timeout=5)
    assert refused and "is locked by 'agent" in refused[0], "a waiting job still owns its run"
    [wait] = _events(cfg.run_uri, "waiting_for_capacity")
    assert (wait["available"], wait["min_workers"]) == (1, 2)
    assert [e["workers"] for e in _events(cfg.run_uri, "launch")] == [2, 2]
    assert api.status(cfg.run_uri)["state"] == "finished"
    # While it waited (longer than a lease), nobody took the run from the waiting leader.
    assert not [e for e in _events(cfg.run_uri, "lock") if e["action"] == "takeover" and e["time"] > wait["time"]]


def test_capacity_that_never_returns_fails_the_job_clearly(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="starved",
        steps=12,
        checkpoint_every=4,
        min_workers=2,
        max_workers=2,
        capacity_timeout_s=2,
        chaos=["preempt:worker=1,step=5"],
    )
    assert run_job(cfg) == 1
    st = api.status(cfg.run_uri)
    assert st["state"] == "failed"
    assert st["reason"] == "capacity stayed below min_workers=2 for 2s (available: 1 hosts)"


def test_a_spent_failure_budget_fails_the_job_with_the_worker_s_own_reason(tmp_path, tiny_dataset, jax_cache):
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        jax_cache,
        run_name="budget",
        steps=12,
        checkpoint_every=4,
        min_workers=1,
        max_workers=1,
        max_failures=1,
        chaos=["crash:worker=0,step=3", "crash:worker=0,step=6"],
    )
    assert run_job(cfg) == 1
    st = api.status(cfg.run_uri)
    assert st["state"] == "failed"
    assert st["reason"].startswith(
        "failure budget spent: 2 failures > max_failures=1; last: worker 0 on host h0 killed by signal 9"
    )


def test_every_listener_of_a_job_is_on_loopback_and_nothing_outlives_a_killed_job(tmp_path, tiny_dataset, jax_cache):
    import psutil

    cfg = job_config(str(tmp_path), tiny_dataset, jax_cache, run_name="listen", steps=400, min_workers=2, max_workers=2)
    handle = start_job(cfg)
    wait_for(lambda: ((api.status(cfg.run_uri) or {}).get("step") or 0) >= 3, 240, "training")
    controller = psutil.Process(handle["controller_pid"])
    procs = [controller, *controller.children(recursive=True)]
    assert len(procs) >= 5  # the local slice, 2 agents, their workers (and standbys)
    listening = [c.laddr for p in procs for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening, "the coordinator of jax.distributed listens"

    def loopback(ip: str) -> bool:
        import ipaddress

        addr = ipaddress.ip_address(ip.split("%")[0])
        mapped = getattr(addr, "ipv4_mapped", None)
        return bool((mapped or addr).is_loopback)

    assert all(loopback(addr.ip) for addr in listening), listening
    # Every host of the job is gone at once (the local slice first, so that nothing restarts them):
    # no worker outlives its agent, and the run's status is not left saying "running".
    controller.kill()
    for h in hosts(cfg.run_uri):
        kill_host(cfg.run_uri, h, signal.SIGKILL)
    gone, alive = psutil.wait_procs(procs, timeout=5)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    st = wait_for(lambda: (s := api.repair_status(cfg.run_uri)) and s["state"] == "failed" and s, 60, "the final state")
    assert f"job {handle['job']} is gone" in st["reason"]


@pytest.mark.parametrize(
    ("hosts_", "after"),
    [(2, 1), pytest.param(4, 2, marks=pytest.mark.extended)],  # one process; a sub-mesh of a multi-process round
)
def test_a_recovery_onto_a_size_the_run_never_ran_on_loads_the_step_compiled_ahead(
    hosts_, after, tmp_path, tiny_dataset
):
    # A cache of its own: no other test's program is in it, so the first round compiles from scratch.
    cfg = job_config(
        str(tmp_path),
        tiny_dataset,
        str(tmp_path / "jax-cache"),
        run_name="ahead",
        steps=200,  # the job must not end before the smaller step is compiled (at a low priority)
        min_workers=after,
        max_workers=hosts_,
        checkpoint_every=10,
    )
    handle = start_job(cfg)
    # Process 0 of the first round compiles the smaller step in the background, after its first steps.
    [ahead] = wait_for(lambda: _events(cfg.run_uri, "compiled_ahead"), 300, "the smaller step compiled ahead")
    assert ahead["workers"] == after and ahead["seconds"] > 0
    [first] = _events(cfg.run_uri, "compiled")
    assert first["cache_hit"] is False  # a cache that never saw this program: the check below can fail
    # A host that is not the leader's is lost for good: the next round is smaller, a mesh this run never ran on.
    leader = api.status(cfg.run_uri)["leader"]
    other = next(h for h in hosts(cfg.run_uri) if h != leader)
    LocalCapacity(open_store(cfg.run_uri), default=cfg.elastic.max_workers).leave(other, reason="the node is gone")
    kill_host(cfg.run_uri, other)
    st = wait_finished(handle)
    assert st["state"] == "finished" and st["step"] == 200, worker_logs(cfg.run_uri)
    assert [e["workers"] for e in _events(cfg.run_uri, "launch")] == [hosts_, after]
    first, again = _events(cfg.run_uri, "compiled")
    assert again["cache_hit"] is True, (first, again)
    # The smaller round loaded the step the first one kept whole: no tracing, no lowering, no cache lookup.
    assert first["loaded"] is False and again["loaded"] is True, (first, again)
    # (compiled/<job>/round-<n>/ holds what a round's process 0 passed to the others: not kept steps)
    kept = [k for k in open_store(cfg.run_uri).list("compiled/") if "/round-" not in k]
    assert sorted(k.rsplit("/", 1)[1] for k in kept) == sorted([f"step-{hosts_}.bin", f"step-{after}.bin"])
    assert len({k.split("/")[1] for k in kept}) == 1, "one job's steps"
    [recovered] = _events(cfg.run_uri, "recovered")
    assert recovered["compile_cached"] is True
