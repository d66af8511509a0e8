"""The chaos suite: randomized fault schedules over many seeds, each checked for what must always hold.

Every schedule runs a real job (3 simulated hosts, min 1) with faults drawn from
a seed: worker crashes, lost hosts (preempt), kills during a save, killed agents,
frozen hosts (SIGSTOP), capacity coming back, a corrupted newest checkpoint, a run
root that one host cannot reach for longer than the lease while another's is slow, and
on some seeds a run root on a small disk that fills up, every host gone at once (then
back), the leader's agent alone frozen past its lease (then thawed), or the job's clocks
running 20 s behind the harness's, which reads the status as Airflow's sensor does
(libfaketime).  Each is checked for:

* an end: the final step reached, or a final state with its reason;
* exact data: every step consumed exactly its global batch (when it finished);
* no orphans: nothing of the job runs once it has ended;
* one owner at a time: no takeover of a live lease; rounds strictly ordered;
* a true status: ``status.json`` says how it ended, as the events do.

``make chaos`` runs ``RTRAIN_CHAOS_SEEDS`` seeds (default 3 in ``make test-all``);
each result is appended to ``var/chaos/results.jsonl``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import hosts, job_config, start_job, step_ids, wait_finished

from training import api

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.extended]

REPO = Path(__file__).resolve().parents[2]
SEEDS = int(os.environ.get("RTRAIN_CHAOS_SEEDS", "3"))
STEPS = 24
EVERY = 4
HOSTS = 3
SKEW_S = 20  # how far the job's clocks run behind the harness's on the skewed seeds


def schedule(seed: int) -> dict[str, Any]:
    """The faults of one seed: chaos specs fired by the job itself, and what the harness does from outside."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(3, STEPS - 6), 3))
    kinds = ["crash", "preempt", "kill_during_save", "kill_agent", "freeze"]
    chaos = []
    for step in steps:
        kind = rng.choice(kinds)
        worker = rng.randrange(2)  # ranks 0 and 1 exist in every round of 2 or 3 hosts
        if kind == "kill_during_save":
            step = max(EVERY, step - step % EVERY)
        chaos.append(f"{kind}:worker={worker},step={step}")
    if seed % 5 == 0:  # the run root fails one host for longer than the lease, and is slow for another
        chaos.append(f"storage_outage:worker={rng.randrange(2)},step={rng.randrange(3, STEPS - 8)},for_s=4")
        chaos.append(
            f"storage_latency:worker={rng.randrange(2)},step={rng.randrange(3, STEPS - 8)},for_s=5,latency_s=0.3"
        )
    if any(c.startswith(("preempt", "freeze")) for c in chaos):
        chaos.append(f"capacity:to={HOSTS},step={steps[-1] + 2}")  # hosts come back
    return {
        "chaos": chaos,
        "corrupt_newest": rng.random() < 0.5,  # flip a byte in the newest checkpoint, then crash a worker
        "full_disk": seed % 5 == 2,  # every fifth seed (2, 7, ...): the run root's disk fills up
        "all_lost": seed % 5 == 4,  # every host gone at once (capacity 0), then back
        "frozen_leader": seed % 5 == 1,  # the leader's agent alone SIGSTOPped beyond its lease, then SIGCONT
        "skewed_clock": seed % 5 == 3,  # the job's processes' clocks run SKEW_S behind the harness's
    }


def _corrupt_newest_then_crash(run_uri: str, stop: threading.Event, out: dict[str, Any]) -> None:
    """From outside: damage the newest committed checkpoint, then take a host down so that a restore reads it."""
    while not stop.is_set():
        st = api.status(run_uri) or {}
        newest = st.get("latest_committed")
        if newest and newest >= 2 * EVERY and st.get("state") == "running":
            step_dir = Path(run_uri) / "checkpoints" / str(newest)  # its largest file is array data
            files = [p for p in step_dir.rglob("*") if p.is_file()] if step_dir.exists() else []
            if files:
                victim = max(files, key=lambda p: p.stat().st_size)
                raw = bytearray(victim.read_bytes())
                raw[len(raw) // 2] ^= 0x01
                victim.write_bytes(bytes(raw))
                out["corrupted"], out["corrupted_at"] = newest, time.time()
                rank0 = next((h for h, r in hosts(run_uri).items() if r.rank == 0 and r.state == "training"), None)
                if rank0:
                    worker = [p for p in _children(hosts(run_uri)[rank0].pid)]
                    for p in worker:
                        p.kill()  # the worker only: the host stays, its agent restarts it
                return
        stop.wait(0.3)


def _children(pid: int) -> list[Any]:
    import psutil

    try:
        return list(psutil.Process(pid).children())
    except psutil.NoSuchProcess:
        return []


def _fill_disk(mnt: Path, run_uri: str, stop: threading.Event) -> None:
    while not stop.is_set():
        if ((api.status(run_uri) or {}).get("latest_committed") or 0) >= 2 * EVERY:
            with open(mnt / "filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    return
        stop.wait(0.3)


def _lose_every_host_then_return(run_uri: str, stop: threading.Event, out: dict[str, Any]) -> None:
    """From outside: the pool drops to no host at all; the job must say it waits, then go on when they return."""
    while not stop.is_set():
        st = api.status(run_uri) or {}
        if (st.get("step") or 0) >= 2 * EVERY and st.get("state") == "running":
            api.set_capacity(run_uri, 0, reason="chaos: every host gone")
            out["all_lost_at"] = time.time()
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline:
                if (api.status(run_uri) or {}).get("state") in ("waiting_for_capacity", "failed", "finished"):
                    out["all_lost_state"] = (api.status(run_uri) or {}).get("state")
                    break
                stop.wait(0.2)
            stop.wait(3.0)
            api.set_capacity(run_uri, HOSTS, reason="chaos: hosts back")
            return
        stop.wait(0.2)


def _freeze_the_leader_agent(run_uri: str, lease_s: float, stop: threading.Event, out: dict[str, Any]) -> None:
    """From outside: SIGSTOP the leading agent alone past its lease, then SIGCONT it: fencing keeps it quiet."""
    while not stop.is_set():
        st = api.status(run_uri) or {}
        leader = st.get("leader")
        if (st.get("step") or 0) >= EVERY and st.get("state") == "running" and leader in hosts(run_uri):
            pid = hosts(run_uri)[leader].pid
            os.kill(pid, signal.SIGSTOP)
            out["frozen_leader"], out["frozen_pid"] = leader, pid
            stop.wait(lease_s + 3.0)
            os.kill(pid, signal.SIGCONT)
            return
        stop.wait(0.2)


def _check_one_owner_at_a_time(run_uri: str, margin_s: float, frozen_pid: int | None) -> None:
    takeovers = [e for e in api.events(run_uri, ("lock",)) if e.get("action") == "takeover"]
    for e in takeovers:
        if e.get("holder_exited"):
            # Taken at once from a holder whose process had exited: never from the frozen one (alive, stopped).
            assert e.get("previous_pid") != frozen_pid, f"a frozen holder's lease was taken as if it had exited: {e}"
        elif not e.get("handoff"):
            assert e["time"] >= float(e["previous_expires_at"]) + margin_s - 0.05, f"a live lease was taken over: {e}"
    launches = api.events(run_uri, ("launch",))
    rounds = [e["round"] for e in launches if e["round"] is not None]
    assert len(rounds) == len(launches), f"a launch without its round: {launches}"
    assert rounds == sorted(set(rounds)), f"rounds out of order or twice: {rounds}"


def _check_nothing_runs(run_uri: str) -> None:
    import psutil

    deadline = time.monotonic() + 20
    while True:
        left = []
        for p in psutil.process_iter(["cmdline", "status"]):
            try:
                if run_uri in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.Error:
                continue
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"processes of the job outlived it: {[p.pid for p in left]}"


@pytest.mark.parametrize("seed", range(SEEDS))
def test_a_random_fault_schedule_ends_cleanly_with_exact_data(
    seed: int, tmp_path, tiny_dataset, jax_cache, monkeypatch
) -> None:
    from training.checkpoint.lock import DEFAULT_MARGIN_S
    from training.data import global_batch_ids

    plan = schedule(seed)
    if plan["skewed_clock"]:  # the job's processes (the local slice, its agents, their workers) inherit it
        import libfaketime

        _, preload = libfaketime.get_reload_information()
        for key, value in {**preload, "FAKETIME": f"-{SKEW_S}s"}.items():
            monkeypatch.setenv(key, value)
    root, mnt = tmp_path, None
    if plan["full_disk"]:
        mnt = tmp_path / "disk"
        mnt.mkdir()
        if subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], capture_output=True
        ).returncode:
            plan["full_disk"] = False  # no tmpfs here (not root): this seed runs without the full disk
            mnt = None
        else:
            root = mnt
    cfg = job_config(
        str(root),
        tiny_dataset,
        jax_cache,
        run_name=f"chaos-{seed}",
        steps=STEPS,
        checkpoint_every=EVERY,
        min_workers=1,
        max_workers=HOSTS,
        global_batch=12,
        heartbeat_timeout_s=3.0,
        max_failures=8,
        capacity_timeout_s=20,
        chaos=plan["chaos"],
        trace_data_ids=True,
    )
    stop = threading.Event()
    seen: dict[str, Any] = {}
    helpers = []
    if plan["corrupt_newest"]:
        helpers.append(threading.Thread(target=_corrupt_newest_then_crash, args=(cfg.run_uri, stop, seen), daemon=True))
    if plan["full_disk"] and mnt is not None:
        helpers.append(threading.Thread(target=_fill_disk, args=(mnt, cfg.run_uri, stop), daemon=True))
    if plan["all_lost"]:
        helpers.append(
            threading.Thread(target=_lose_every_host_then_return, args=(cfg.run_uri, stop, seen), daemon=True)
        )
    if plan["frozen_leader"]:
        helpers.append(
            threading.Thread(
                target=_freeze_the_leader_agent, args=(cfg.run_uri, cfg.elastic.lease_s, stop, seen), daemon=True
            )
        )
    t0 = time.time()
    try:
        handle = start_job(cfg)
        for h in helpers:
            h.start()
        st = wait_finished(handle, timeout=420)
        stop.set()
        # An end, and a status that tells it as the events do.
        final = [e for e in api.events(cfg.run_uri, ("finished", "failed"))]
        assert st["state"] in ("finished", "failed") and final and final[-1]["type"] == st["state"], st
        if st["state"] == "failed":
            assert st.get("reason"), "a failed job says why"
        else:
            assert st["step"] == STEPS
            ids = step_ids(cfg.run_uri)
            assert sorted(ids) == list(range(STEPS))
            for step, got in ids.items():
                want = global_batch_ids(
                    tiny_dataset, seed=cfg.optimizer.seed, global_batch=cfg.optimizer.global_batch, batch_index=step
                )
                assert got == sorted(int(i) for i in want), f"step {step}: wrong examples"
        if plan["full_disk"]:
            assert st["state"] == "failed" and "No space left on device" in st["reason"], st
        if st["state"] == "finished":  # the outside faults of the plan did happen
            assert not plan["all_lost"] or seen.get("all_lost_at"), "every host was taken away"
            assert not plan["frozen_leader"] or seen.get("frozen_leader"), "the leader's agent was frozen"
        if seen.get("all_lost_at"):
            waits = [e for e in api.events(cfg.run_uri, ("waiting_for_capacity",)) if e["time"] >= seen["all_lost_at"]]
            assert waits or seen.get("all_lost_state") in ("failed", "finished"), "no host left: the run said it waits"
        if seen.get("corrupted"):
            corrupt = api.events(cfg.run_uri, ("checkpoint_corrupt",))
            # Restores after the damage (the job's event times are on its clock: SKEW_S behind when skewed).
            damaged_at = seen["corrupted_at"] - (SKEW_S if plan["skewed_clock"] else 0)
            restored = [e["step"] for e in api.events(cfg.run_uri, ("restore",)) if e["time"] >= damaged_at]
            assert any(e["step"] == seen["corrupted"] for e in corrupt) or seen["corrupted"] not in restored, (
                "a damaged checkpoint was restored"
            )
        _check_one_owner_at_a_time(cfg.run_uri, DEFAULT_MARGIN_S, seen.get("frozen_pid"))
        _check_nothing_runs(cfg.run_uri)
        outcome = {
            "seed": seed,
            "plan": plan,
            "state": st["state"],
            "reason": st.get("reason", ""),
            "failures": st.get("failures"),
            "seconds": round(time.time() - t0, 1),
            "survived": True,
            "outside": {k: v for k, v in seen.items()},
        }
    except BaseException as e:
        outcome = {"seed": seed, "plan": plan, "survived": False, "error": f"{type(e).__name__}: {e}"[:500]}
        import shutil

        logs = Path(cfg.run_uri) / "logs"
        if logs.exists():  # kept for the post-mortem (the run root may be on a disk about to go)
            shutil.copytree(logs, REPO / "var" / "chaos" / f"logs-{seed}-{int(t0)}", dirs_exist_ok=True)
        raise
    finally:
        stop.set()
        out = REPO / "var" / "chaos"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(outcome, default=str) + "\n")
        if mnt is not None:
            import psutil

            for p in psutil.process_iter(["cmdline"]):
                if str(mnt) in " ".join(p.info["cmdline"] or []):
                    p.kill()
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
