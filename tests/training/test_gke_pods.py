"""The GKE path run as pods: a rendered JobSet's pods as local processes (``training.gke.pod_emulator``).

Each pod runs the container's own command (``rtrain agent`` through the
entrypoint script) with what GKE gives it: the downward API, the TPU webhook's
``TPU_WORKER_*`` and ``MEGASCALE_*``, its hostname, a pod IP of its own and the
headless Service's DNS names.  A Spot reclaim deletes a slice's pods (SIGTERM,
then SIGKILL after their grace) and the Job makes them again, Pending until the
slice's nodes return; a host error kills a pod at once.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import assert_exact_data, hosts, job_config, wait_for

from training import api
from training.events import EventReader
from training.gke.cluster_state import describe_waiting, jobset_state, pods_waiting
from training.gke.launch import GKELaunch
from training.gke.manifests import render
from training.gke.names import COMPLETION_INDEX_ANNOTATION, JOB_INDEX_LABEL
from training.gke.pod_emulator import EmulatedJobSet, cpu_image_env, process_environ
from training.gke.pod_specs import PodEmulatorError, expand_pods, webhook_env
from training.gke.tpu import TPUSlice
from training.gke.worker_env import is_round_env

TPU = TPUSlice("ct5p-hightpu-4t", "2x2x2")  # 2 hosts of 4 chips a slice
GCS_ENV = (
    "STORAGE_EMULATOR_HOST",
    "TENSORSTORE_GCS_HTTP_URL",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
    "GOOGLE_CLOUD_PROJECT",
)


def _image_env() -> dict[str, str]:
    return cpu_image_env(TPU.chips_per_host, {k: os.environ[k] for k in GCS_ENV if k in os.environ})


def _events(run_uri: str, *types: str) -> list[api.Event]:
    return api.events(run_uri, types or None)


class Events:
    """A run's events as they come, each read once (the one emulator serves the job too: poll it lightly)."""

    def __init__(self, run_uri: str) -> None:
        self.run_uri = run_uri
        self.reader = EventReader()

    def __call__(self, *types: str) -> list[api.Event]:
        return [e for e in self.reader.read(self.run_uri) if not types or e["type"] in types]

    def started(self, round_: int) -> list[api.Event]:
        """The workers of a round that started (one event each, with the TPU values its runtime started with)."""
        return [e for e in self("worker_started") if e.get("attempt") == round_]


def _worker_envs(js: EmulatedJobSet, slice_: int) -> list[dict[str, str]]:
    """The environments the worker processes of a slice's running pods were started with: each agent's fork
    server's, which its workers (standbys too) are forked with, and any worker started on its own."""
    envs = [env for pod in js.running(slice_) for env in process_environ(pod)]
    return [e for e in envs if "RTRAIN_AGENT_PID" in e]


def _pod_logs(js: EmulatedJobSet) -> str:
    logs = sorted((js.workdir / "pods").rglob("*.log"))
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2500:]}" for p in logs)


@pytest.mark.slow
@pytest.mark.extended
def test_a_2_slice_jobset_run_as_pods_rides_out_a_spot_reclaim_and_a_lost_host(
    gcs_root: str, tiny_dataset: str, jax_cache: str, tmp_path: Path
) -> None:
    cfg = job_config(
        gcs_root,
        tiny_dataset,
        jax_cache,
        backend="gke",
        run_name="pods",
        # Room after the host error for the Job's 10 s backoff, the pods' start and a checkpoint, so the round
        # without slice 1 grows back before the end: on a quiet machine 96 steps ended on slice 0 first.
        steps=400,
        checkpoint_every=8,
        min_workers=2,
        max_workers=4,
        hosts_per_slice=TPU.hosts,
        devices_per_worker=TPU.chips_per_host,
        # GKE's default Spot grace: the node's 30 s shutdown leaves the pods 15 s, the notice's commit 10 s.
        preemption_grace_s=10,
        heartbeat_timeout_s=40.0,
        lease_s=30.0,
        trace_data_ids=True,
    )
    launch = GKELaunch(image="rtrain:test", spot=True)  # GKE's default Spot grace: 15 s for the pods
    job = api.begin_job(cfg, backend="gke", by="the pod emulator test")
    manifests = render(cfg, TPU, launch, job)
    assert manifests.num_slices == 2 and launch.pod_grace_s == 15

    events = Events(cfg.run_uri)
    # JobSet's webhooks, a reclaim's 30 s node shutdown (15 s for the pods), node deletion and pod GC, the Job's
    # backoffs, all at their defaults; the reaper removes the failed leaders a newer pod replaces.
    with EmulatedJobSet(manifests, tmp_path / "cluster", _image_env()) as js:
        try:
            # Both slices train: every worker was told of the 2 slices, its own slice's hosts, its place.
            # (The reclaim comes before the first checkpoint: the notice's save then waits for no other.)
            wait_for(
                lambda: ((api.status(cfg.run_uri) or {}).get("step") or 0) >= 3, 400, "training on 2 slices", every=1
            )
            [first] = events("launch")
            assert first["workers"] == 4 and first["members"] == ["s0-h0", "s0-h1", "s1-h0", "s1-h1"]
            started = events.started(first["round"])
            assert len(started) == 4 and {e["runtime_env"]["MEGASCALE_NUM_SLICES"] for e in started} == {"2"}
            assert sorted(
                e["runtime_env"]["MEGASCALE_SLICE_ID"] + e["runtime_env"]["TPU_WORKER_ID"] for e in started
            ) == [
                "00",
                "01",
                "10",
                "11",
            ]
            # Started with none of what the webhook gave the pod: each round sets its own.
            # (Processes that set their title overwrite what /proc shows of their environment: those are
            # left out; the round's own values are the worker_started events' runtime_env, checked below.)
            envs = _worker_envs(js, 0) + _worker_envs(js, 1)
            assert not any(is_round_env(k) for e in envs for k in e)

            # A Spot reclaim of slice 1: its pods get SIGTERM (a notice) and 15 s; the job commits and shrinks.
            js.preempt_slice(1)
            wait_for(lambda: len(events("launch")) >= 2, 300, "the round on slice 0", every=5)
            # After the Job's first backoff (10 s: a reclaim counts for the backoff, not the budget) it made the
            # slice's leader again; it waits for nodes, and says so (its follower is made once it is scheduled:
            # JobSet's webhook).  Until then the failed pods are what shows.
            waiting = wait_for(
                lambda: w if "Unschedulable" in (w := describe_waiting(pods_waiting(js.objects()))) else "",
                30,
                "the leader made again, waiting",
            )
            assert "Unschedulable" in waiting and "Insufficient google.com/tpu" in waiting
            # The workers of the 1-slice round have no Multislice value left from the JobSet's webhook.
            second = events("launch")[1]
            wait_for(lambda: len(events.started(second["round"])) == 2, 120, "slice 0's workers", every=5)
            started = events.started(second["round"])
            slice_0 = webhook_env(manifests.jobset, 0, 0)["TPU_WORKER_HOSTNAMES"]
            assert [sorted(e["runtime_env"]) for e in started] == [["TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID"]] * 2
            assert {e["runtime_env"]["TPU_WORKER_HOSTNAMES"] for e in started} == {slice_0}

            # The nodes return: the pods start, their agents join, the group grows back at a checkpoint.
            js.return_slice(1)
            wait_for(lambda: len(events("launch")) >= 3, 400, "the group to grow back", every=5)
            assert not describe_waiting(pods_waiting(js.objects()))

            # A host error on slice 1's live nodes: its leader's pod dies, then its follower's.  The slice leaves;
            # the Job makes both again after its 10 s backoff, and the follower is admitted only because the
            # failed leader was deleted (JobSet's webhook counts it); they rejoin at a checkpoint.
            third = events("launch")[2]
            assert third["workers"] == 4, [(e["workers"], e["reason"]) for e in events("launch")]
            wait_for(lambda: len(events.started(third["round"])) == 4, 120, "the 4 workers", every=5)
            t_kill = time.time()
            js.kill_pod(1, 0)
            js.kill_pod(1, 1)
            wait_for(lambda: jobset_state(js.object()) != "running", 900, "the JobSet's end", every=5)
        except BaseException:
            print(_pod_logs(js))
            raise
        state = jobset_state(js.object())
    print(_pod_logs(js))  # pytest shows it with a failure below; the assertions' own messages stay short
    assert state == "completed", js.failed_jobs

    st = api.status(cfg.run_uri)
    assert st["state"] == "finished" and st["step"] == cfg.optimizer.steps, st
    launches = _events(cfg.run_uri, "launch")
    sizes = [e["workers"] for e in launches]
    # Shrunk to slice 0 by the reclaim, grown back; shrunk again by the host error on slice 1, grown back
    # once the Job made its pods again (after its backoff, the follower past JobSet's webhook).
    story = [
        (e["type"], e.get("workers"), e.get("hosts"), e["reason"]) for e in _events(cfg.run_uri, "launch", "failure")
    ]
    assert sizes == [4, 2, 4, 2, 4], story
    assert launches[1]["members"] == ["s0-h0", "s0-h1"]
    assert [(e["old_workers"], e["new_workers"]) for e in _events(cfg.run_uri, "resize")][:2] == [(4, 2), (2, 4)]

    # The notice: the step the group stopped at was committed within the pods' grace, and resumed exactly.
    notices = _events(cfg.run_uri, "preemption_notice")
    assert notices and all(n["committed"] and 0 < n["seconds"] < cfg.checkpoint.preemption_grace_s for n in notices)
    restores = _events(cfg.run_uri, "restore")
    assert restores[0]["step"] == notices[0]["step"]
    recovered = _events(cfg.run_uri, "recovered")
    assert recovered[0]["kind"] == "notice" and recovered[0]["steps_lost"] == 0
    # Growing is not a failure; the host error is the only one: slice 1's hosts, a resume from a committed step.
    failures = _events(cfg.run_uri, "failure")
    failure = failures[0]
    assert {h for f in failures for h in f["hosts"]} == {"s1-h0", "s1-h1"} and failure["time"] > t_kill, story
    # The pod made again is a new agent: its first beats are life (or its old agent is known gone), so the
    # settle ends at once rather than after the heartbeat timeout.
    assert failure["time"] - failure["detected_at"] < cfg.elastic.heartbeat_timeout_s / 2, story
    after = [r for r in restores if r["time"] > failure["time"]]
    assert after[0]["step"] == failure["resume_step"] and after[0]["step"] in api.committed_steps(cfg.run_uri)
    assert_exact_data(cfg.run_uri, tiny_dataset, cfg)

    # Slice 0's agents stayed up the whole run; slice 1's are the pods the Job made again (the hostnames
    # are the pods', every agent's coordinator is its pod's DNS name on the headless Service).
    records = hosts(cfg.run_uri)
    assert all(records[h].started < t_kill for h in ("s0-h0", "s0-h1"))
    assert records["s1-h0"].started > t_kill and records["s1-h1"].started > t_kill
    for host, rec in records.items():
        j, i = host[1], host[-1]
        assert rec.node == f"{manifests.name}-slice-{j}-{i}"
        assert rec.coordinator == f"{manifests.name}-slice-{j}-{i}.{manifests.name}:{launch.coordinator_port}"


def _toy_jobset(tmp_path: Path, program: str, **overrides: Any) -> tuple[Any, dict[str, str]]:
    """A 2-host-a-slice JobSet whose pods run ``program`` (a shell script, on PATH as ``rtrain``); its env."""
    base: dict[str, Any] = {"run_name": "toy", "min_workers": 2, "max_workers": 4}
    cfg = job_config(
        "gs://b/r",
        "unused",
        "unused",
        backend="gke",
        hosts_per_slice=2,
        devices_per_worker=4,
        preemption_grace_s=9,
        **{**base, **overrides},
    )
    m = render(cfg, TPU, GKELaunch(image="img:1", spot=True), "j1")
    script = tmp_path / "rtrain"
    # A slice leader's entrypoint starts `rtrain repair-slices` too: the real one where $REPAIRS names it.
    repairs = (
        'if [ "${1:-}" = repair-slices ]; then [ -z "${REPAIRS:-}" ] || exec "$REPAIRS" "$@" --every 0.5; exit 0; fi\n'
    )
    script.write_text("#!/bin/sh\n" + repairs + program)
    script.chmod(0o755)
    return m, {"PATH": f"{tmp_path}:/usr/bin:/bin", "EXIT_DIR": str(tmp_path), "OUT": str(tmp_path)}


def own_repairs(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the slices' leader pods running the real ``rtrain repair-slices`` (looking every 0.5 s)."""
    return {**env, "REPAIRS": str(Path(sys.executable).with_name("rtrain"))}


# Who repairs the slices: nobody, the launcher's watch (the emulator does its part), or the pods themselves
# (their `rtrain repair-slices` through the emulated API server, with no watch running).
REPAIRERS = ("none", "watch", "pods")


def _policy_jobset(tmp_path: Path, **overrides: Any) -> tuple[Any, dict[str, str]]:
    """A 2-slice JobSet whose program waits, then exits with the code put in a file."""
    return _toy_jobset(
        tmp_path,
        "trap 'exit 6' TERM\n"  # AgentExit.INTERRUPTED, as the agent on a notice
        'f="$EXIT_DIR/$RTRAIN_SLICE_INDEX-$RTRAIN_HOST_INDEX"\n'
        'while [ ! -e "$f" ]; do sleep 0.1; done\n'
        'code=$(cat "$f"); rm -f "$f"; exit "$code"\n',
        **overrides,
    )


FAST_BACKOFF = (1.0, 4.0)  # the Job's backoff before a failed pod is made again, scaled down from 10 s


def _exit(tmp_path: Path, slice_: int, index: int, code: int) -> None:
    (tmp_path / f".{slice_}-{index}").write_text(str(code))
    (tmp_path / f".{slice_}-{index}").rename(tmp_path / f"{slice_}-{index}")


@pytest.mark.parametrize("final", [3, 5, 7])  # AgentExit.FAILED, SUPERSEDED, STOPPED
def test_the_emulated_jobset_follows_the_jobs_failure_policy(tmp_path: Path, final: int) -> None:
    """A preempted pod is made again without counting; another failure counts; a final code fails the Job at once."""
    m, env = _policy_jobset(tmp_path)
    with EmulatedJobSet(m, tmp_path / "cluster", env, failure_backoff_s=FAST_BACKOFF) as js:
        wait_for(lambda: len(js.running()) == 4, 20, "4 pods running")
        names = {p.name for p in js.running()}
        js.preempt_slice(1, grace_s=2)
        wait_for(lambda: len(js.running()) == 2, 20, "slice 1's pods gone")
        # The leader is made again after the Job's first backoff (a DisruptionTarget is not counted against the
        # budget, but the backoff counts it) and waits for nodes.  Its follower is made again too if it ended
        # while the old leader still ran (JobSet's webhook admits it then: a node's shutdown sets no deletion
        # timestamp); else the webhook refuses it until the new leader is scheduled, and the failed follower
        # is what shows.
        waiting = wait_for(
            lambda: r if "Unschedulable" in (r := [w.reason for w in pods_waiting(js.objects())]) else None,
            10,
            "the leader made again",
        )
        assert waiting in (["Unschedulable", "Failed"], ["Unschedulable", "Unschedulable"]), waiting
        js.return_slice(1)
        wait_for(lambda: len(js.running()) == 4, 30, "slice 1's pods made again")
        assert len({p.name for p in js.running()} - names) == 2  # new pods, not restarted ones
        assert [js.indexes[(1, i)].failures for i in (0, 1)] == [0, 0]  # a DisruptionTarget does not count
        t_exit = time.monotonic()
        _exit(tmp_path, 0, 0, 1)  # an error: counted, the pod made again after the Job's backoff
        wait_for(lambda: js.indexes[(0, 0)].failures == 1 and len(js.running()) == 4, 20, "the pod made again")
        assert time.monotonic() - t_exit >= FAST_BACKOFF[0]
        assert jobset_state(js.object()) == "running"
        _exit(tmp_path, 0, 1, final)  # podFailurePolicy FailJob
        wait_for(lambda: jobset_state(js.object()) == "failed", 20, "the JobSet to fail")
        assert f"exited {final} (podFailurePolicy FailJob)" in js.failed_jobs[0]
        wait_for(lambda: not js.running(), 20, "every pod deleted")


def _names(js: EmulatedJobSet, slice_: int, index: int) -> list[str]:
    """The pods of one index that the API still lists (failed ones too), oldest first."""
    return [p.name for p in js.indexes[(slice_, index)].pods if not p.removed]


@pytest.mark.slow
@pytest.mark.parametrize("repairer", REPAIRERS)
def test_a_slice_whose_leader_pod_failed_on_a_live_node_gets_its_follower_back_only_once_the_failed_leader_goes(
    tmp_path: Path, repairer: str
) -> None:
    """JobSet's webhook counts the failed leader a live node keeps: the follower made again after it is refused
    ("expected 1 leader pod ... but got 2") for good, unless the failed leader is deleted: by the launcher's
    watch, or, with no watch running, by the slice's new leader pod itself."""
    m, env = _policy_jobset(tmp_path)
    env = own_repairs(env) if repairer == "pods" else env
    serve = repairer == "pods"
    reaper = repairer == "watch"
    with EmulatedJobSet(
        m, tmp_path / "cluster", env, failure_backoff_s=FAST_BACKOFF, reaper=reaper, serve_api=serve
    ) as js:
        wait_for(lambda: len(js.running()) == 4, 20, "4 pods running")
        old = js.running(1)
        old_leader = old[0].name
        js.kill_pod(1, 0)  # a host error on slice 1: its leader's pod and then its follower's die, nodes alive
        js.kill_pod(1, 1)
        wait_for(lambda: all(p.phase == "Failed" for p in old), 10, "slice 1's pods failed")
        if repairer != "none":
            wait_for(lambda: len(js.running(1)) == 2, 20, "slice 1's pods made again")
            assert old_leader not in _names(js, 1, 0)  # deleted once its successor existed
            if js.api is not None:  # through the API, by a slice's leader pod (the emulator's own reaper is off)
                assert f"DELETE /api/v1/namespaces/default/pods/{old_leader}" in js.api.calls, js.api.calls
            return
        wait_for(lambda: [r for r in js.refusals if "but got 2" in r], 20, "the follower refused")
        time.sleep(3 * FAST_BACKOFF[1])  # retries, all refused: the failed leader stays (no pod GC on a live node)
        assert [p.index for p in js.running(1)] == [0] and old_leader in _names(js, 1, 0)
        assert len([r for r in js.refusals if "but got 2" in r]) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("reaper", [False, True])
def test_a_slice_back_from_a_spot_reclaim_gets_its_follower_before_pod_gc_only_with_the_reaper(
    tmp_path: Path, reaper: bool
) -> None:
    """After a reclaim the failed pods stay until GKE deletes their nodes and pod GC collects them (scaled here
    to 1 s and 10 s): VMs back before that get their leader, but the follower only once the failed leader goes."""
    m, env = _policy_jobset(tmp_path)
    with EmulatedJobSet(
        m,
        tmp_path / "cluster",
        env,
        failure_backoff_s=FAST_BACKOFF,
        reaper=reaper,
        node_delete_s=1.0,
        orphan_gc_s=10.0,
        renew_node_names=True,  # the VMs come back under new names: their old pods are orphans
    ) as js:
        wait_for(lambda: len(js.running()) == 4, 20, "4 pods running")
        old = [p.name for p in js.running(1)]
        t0 = time.monotonic()
        js.preempt_slice(1, grace_s=0.5)
        wait_for(lambda: len(js.running()) == 2, 20, "slice 1's pods gone")
        js.return_slice(1)  # new VMs (new node names) before the old pods are collected
        wait_for(lambda: len(js.running(1)) == 2, 40, "slice 1 back")
        back = time.monotonic() - t0
        got_2 = [r for r in js.refusals if "but got 2" in r]
        if reaper:
            assert back < 1.0 + 10.0, (back, js.refusals)  # a refusal in the tick before the reaper's is no matter
        else:
            assert back >= 1.0 + 10.0 and got_2, (back, js.refusals)
            assert not set(old) & {o["metadata"]["name"] for o in js.objects()}  # collected with their nodes


def test_an_index_out_of_retries_is_not_made_again_and_fails_its_job_once_the_others_end(tmp_path: Path) -> None:
    m, env = _policy_jobset(tmp_path, max_failures=1)  # backoffLimitPerIndex 1
    with EmulatedJobSet(m, tmp_path / "cluster", env, failure_backoff_s=FAST_BACKOFF) as js:
        wait_for(lambda: len(js.running()) == 4, 20, "4 pods running")
        for n in (1, 2):
            _exit(tmp_path, 0, 0, 1)
            wait_for(functools.partial(lambda n: js.indexes[(0, 0)].failures == n, n), 20, f"failure {n}")
        wait_for(lambda: js.indexes[(0, 0)].failed, 20, "the index failed")
        time.sleep(0.5)
        assert len(js.running()) == 3 and jobset_state(js.object()) == "running"  # the Job goes on
        _exit(tmp_path, 0, 1, 0)  # the slice's last index ends: the Job has a failed index
        wait_for(lambda: jobset_state(js.object()) == "failed", 20, "the JobSet to fail")
        assert "indexes [0] failed" in js.failed_jobs[0]


def test_a_pod_that_ignores_sigterm_is_killed_after_its_grace(tmp_path: Path) -> None:
    program = "trap '' TERM\ntouch \"$OUT/$(hostname)\"\nwhile true; do sleep 0.1; done\n"
    m, env = _toy_jobset(tmp_path, program, max_workers=2)
    with EmulatedJobSet(m, tmp_path / "cluster", env) as js:
        wait_for(lambda: (tmp_path / f"{m.name}-slice-0-0").exists(), 20, "the pod to ignore SIGTERM")
        pod = js.running(0)[0]
        assert pod.index == 0
        t0 = time.monotonic()
        js.preempt_slice(0, grace_s=1.5)
        wait_for(lambda: pod.exit_code is not None, 20, "the pod to be killed")
        assert 1.4 < time.monotonic() - t0 < 5
        assert pod.exit_code == 137  # SIGKILL, as the runtime reports it


def test_every_pod_resolves_the_services_names_to_the_pods_and_has_its_own_hostname(tmp_path: Path) -> None:
    m, env = _toy_jobset(
        tmp_path,
        # A follower is made once its leader is scheduled (JobSet's webhook): its name resolves a moment later.
        'for h in $(echo "$TPU_WORKER_HOSTNAMES" | tr , " "); do until getent hosts "$h" >/dev/null; '
        'do sleep 0.1; done; getent hosts "$h" | cut -f1 -d" "; done '
        '> "$OUT/.$(hostname)" && mv "$OUT/.$(hostname)" "$OUT/$(hostname)"\nexec sleep 60\n',
    )
    with EmulatedJobSet(m, tmp_path / "cluster", env) as js:
        wait_for(lambda: len(js.running()) == 4, 20, "4 pods running")
        ips = {(p.slice, p.index): p.ip for p in js.running()}
        for j, i in ips:
            look = tmp_path / f"{m.name}-slice-{j}-{i}"
            wait_for(look.exists, 10, "the pod's look")
            time.sleep(0.2)
            assert look.read_text().split() == [ips[(j, 0)], ips[(j, 1)]]
    assert len(set(ips.values())) == 4 and all(ip.startswith("127.") for ip in ips.values())
    assert subprocess.run(["getent", "hosts", f"{m.name}-slice-0-0.{m.name}"], check=False).returncode != 0


def test_expand_pods_makes_one_pod_per_host_of_each_slice(tmp_path: Path) -> None:
    m, _ = _toy_jobset(tmp_path, "")
    pods = expand_pods(m.jobset)
    assert [
        (p["metadata"]["labels"][JOB_INDEX_LABEL], p["metadata"]["annotations"][COMPLETION_INDEX_ANNOTATION])
        for p in pods
    ] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert {p["spec"]["hostname"] for p in pods} == {f"{m.name}-slice-{j}-{i}" for j in (0, 1) for i in (0, 1)}
    jobset = {**m.jobset, "spec": {**m.jobset["spec"]}}
    rjob = jobset["spec"]["replicatedJobs"][0]
    jobset["spec"]["replicatedJobs"] = [
        {**rjob, "template": {"spec": {**rjob["template"]["spec"], "completionMode": "NonIndexed"}}}
    ]
    with pytest.raises(PodEmulatorError, match="Indexed"):
        expand_pods(jobset)


OWNER = """
import sys, time
from pathlib import Path
from training.gke.launch import GKELaunch
from training.gke.manifests import render
from training.gke.tpu import TPUSlice
from training.gke.pod_emulator import EmulatedJobSet
from training.config import load_config

tmp = Path(sys.argv[1])
cfg = load_config(preset="tiny", overrides={"backend": "gke", "root": "gs://b/r", "run_name": "orphans",
    "min_workers": 2, "max_workers": 2, "hosts_per_slice": 2, "devices_per_worker": 4, "preemption_grace_s": 9})
m = render(cfg, TPUSlice("ct5p-hightpu-4t", "2x2x2"), GKELaunch(image="img:1"), "j1")
js = EmulatedJobSet(m, tmp / "cluster", {"PATH": f"{tmp}:/usr/bin:/bin"})
js.start()
while len(js.running()) < 2:
    time.sleep(0.1)
(tmp / "pids").write_text(" ".join(str(p.proc.pid) for p in js.running()))
time.sleep(600)
"""


def test_no_pod_outlives_the_process_that_runs_the_emulator(tmp_path: Path) -> None:
    script = tmp_path / "rtrain"
    script.write_text('#!/bin/sh\n[ "${1:-}" != repair-slices ] || exit 0\nexec sleep 600\n')
    script.chmod(0o755)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)])
    try:
        wait_for(lambda: (tmp_path / "pids").exists(), 30, "the pods")
        time.sleep(0.2)
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        assert len(pids) == 2 and all(Path(f"/proc/{p}").exists() for p in pids)
    finally:
        owner.kill()  # SIGKILL: no clean-up of its own runs
        owner.wait()
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 10, "the pods to die with it")
