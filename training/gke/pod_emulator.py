"""A JobSet without Kubernetes: the pods of a rendered JobSet run as local processes, as GKE runs them.

For tests and trials of the GKE path on one machine.  In small, it does what the cluster does: one
pod per (slice, host index), recreated by the Job's ``podFailurePolicy`` and
``backoffLimitPerIndex``; a pod starts only while its slice's nodes are up (else it waits
``Pending``); each container gets its environment (values, downward-API fields, and what GKE's TPU
webhook injects: ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``, ``MEGASCALE_*``), a pod IP of its own
on loopback, the headless Service's names in its own ``/etc/hosts``, the node's hostname, and
directories for its volumes; a deleted pod gets SIGTERM, then SIGKILL once its grace is over.

The container's command runs as written, with this repository's ``rtrain`` for the image's; the
image's environment is what the caller passes (for JAX on CPU: ``JAX_PLATFORMS``, gloo, and as many
CPU devices as the pod asks TPU chips).  Needs ``unshare`` (util-linux) and root or user namespaces.

What decides whether a slice comes back is modelled from the sources, each cited where it is coded:
JobSet's pod webhooks under exclusive placement (v0.12.0), failed pods kept until pod garbage
collection, a Spot reclaim's node shutdown and node deletion (GKE), and the Job controller's
backoffs (Kubernetes).  ``reaper=True`` runs :func:`training.gke.reaper.replaced_leaders` on the pods
each tick, as the backend's watch does on a cluster; ``serve_api=True`` serves the API calls the pods'
own repairs make instead (:mod:`training.gke.emulated_api`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from training.cpu_devices import cpu_process_env
from training.gke.emulated_api import ClusterAPI, EmulatedAPI
from training.gke.job_controller import Index, JobControllers
from training.gke.manifests import GKEManifests
from training.gke.names import (
    COMPLETION_INDEX_ANNOTATION,
    CRITICAL_PODS_GRACE_S,
    EXCLUSIVE_TOPOLOGY_ANNOTATION,
    KUBE_API_ENV,
    NODEPOOL_LABEL,
    POD_FAILURE_BACKOFF_S,
    SPOT_SHUTDOWN_GRACE_S,
    TPU_RESOURCE,
    K8sObject,
    child_job_name,
)
from training.gke.pod_specs import (
    Node,
    Pod,
    PodEmulatorError,
    expand_pod,
    hosts_text,
    job_container,
    kubelet_env,
    pod_ip,
    pod_object,
    rfc3339,
    webhook_env,
)
from training.gke.reaper import held_back_slices, mispinned_slices, replaced_leaders

# Pod garbage collection (pkg/controller/podgc/gc_controller.go): the pods of a node that no longer exists
# are deleted once the node has been gone 40 s (quarantineTime; checked every 20 s, gcCheckPeriod); terminated
# pods on live nodes only past the terminated-pod threshold, which GKE sets to 1,000 pods in a cluster of fewer
# than 100 nodes and 5,000 in a larger one (GKE's docs, concepts/spot-vms; Kubernetes' own default is 12,500):
# never, here.
ORPHAN_GC_S = 40.0
# A Spot reclaim does not delete the node: Compute Engine stops the VM (TERMINATED) and the managed instance
# group makes it again under its name.  The cloud node lifecycle controller (kubernetes/cloud-provider,
# controllers/nodelifecycle: MonitorNodes) deletes a NotReady node only when its instance no longer exists;
# a shut-down instance gets the node.cloudprovider.kubernetes.io/shutdown taint.  So by default a reclaimed
# node stays, NotReady, until return_slice; node_delete_s models an instance that is deleted instead.
# The process that becomes a pod's container: its own /etc/hosts and hostname, then the container's command.
POD_INIT = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


class _Kubelet:
    """The node side of the emulated cluster: nodes, placing and starting pods, ending them."""

    jobset: K8sObject
    job_spec: K8sObject
    slices: int
    hosts: int
    workdir: Path
    image_env: dict[str, str]
    hosts_file: Path
    nodes: dict[str, Node]
    pools: list[str]
    pick_pool: Callable[[list[str]], str]
    indexes: dict[tuple[int, int], Index]
    jobs_made: dict[int, int]
    renew_node_names: bool
    state: str
    deleted: bool
    _made: int
    _placed: int
    _unshare: list[str]

    def _pods(self) -> list[Pod]:
        return [p for idx in self.indexes.values() for p in idx.pods]

    def _pool_names(self, spare: int) -> list[str]:
        """The node pools of the slices' shape: the JobSet's own (its pods' node affinity; more than its slices
        are spares), else one named for each slice and each spare."""
        terms = (self.job_spec["template"]["spec"].get("affinity") or {}).get("nodeAffinity", {})
        required = terms.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
        pools = [v for t in required for e in t["matchExpressions"] if e["key"] == NODEPOOL_LABEL for v in e["values"]]
        wanted = self.slices + spare
        return pools + [f"{self.jobset['metadata']['name']}-pool-{p}" for p in range(len(pools), wanted)]

    def _make_nodes(self, pool: int) -> None:
        """Pool ``pool``'s VMs, ready: under their old names (a pool recreates its VMs so), or new ones."""
        for i in range(self.hosts):
            gen = sum(1 for n in self.nodes.values() if n.slice == pool and n.index == i)
            name = f"node-p{pool}-h{i}" + (f"-{gen}" if self.renew_node_names and gen else "")
            if name in self.nodes and self.nodes[name].ready:
                continue
            self.nodes[name] = Node(name, self.pools[pool], pool, i)

    def _node_for(self, pod: Pod) -> Node | None:
        """A ready, free node for the pod, as the scheduler finds one (pkg/scheduler: NodeAffinity, InterPodAffinity).

        A follower goes to the pool JobSet's webhook pinned it to (its node selector).  A leader under exclusive
        placement carries the webhook's affinities (v0.12.0 ``pod_webhook.go``: ``setExclusiveAffinities``): a
        pool where pods of its own Job run if any do, and none where another Job's pods run (terminated pods do
        not count).  Among the pools left the scheduler's choice is a tie it breaks at random
        (``schedule_one.go``: ``selectHost``): here ``pick_pool``'s.
        """
        wanted = pod.obj["spec"].get("nodeSelector", {}).get(NODEPOOL_LABEL)
        active = [p for p in self._pods() if p.node and p.exit_code is None and not p.removed]
        busy = {p.node for p in active}
        free: dict[str, list[Node]] = {}
        for node in self.nodes.values():
            if node.ready and node.name not in busy and wanted in (None, node.pool):
                free.setdefault(node.pool, []).append(node)
        notes = pod.obj["metadata"]["annotations"]
        if EXCLUSIVE_TOPOLOGY_ANNOTATION in notes and notes.get(COMPLETION_INDEX_ANNOTATION) == "0":
            mine = {self.nodes[p.node].pool for p in active if p.slice == pod.slice}
            others = {self.nodes[p.node].pool for p in active if p.slice != pod.slice}
            free = {k: v for k, v in free.items() if k not in others and (not mine or k in mine)}
        if not free:
            return None
        pool = self.pick_pool(sorted(free))
        return min(free[pool], key=lambda n: n.index)

    def _schedule(self) -> None:
        changed = False
        for _, idx in sorted(self.indexes.items()):
            pod = idx.pods[-1] if idx.pods else None
            if pod is None or pod.node or pod.deleting_since is not None or self.state or self.deleted:
                continue
            node = self._node_for(pod)
            if node is not None:
                self._place(pod, node)
                changed = True
        if changed:
            self._write_hosts()
        for _, idx in sorted(self.indexes.items()):
            pod = idx.pods[-1] if idx.pods else None
            if pod is not None and pod.ip and pod.proc is None and pod.deleting_since is None:
                self._start(pod)

    def _new_pod(self, j: int, i: int) -> Pod:
        self._made += 1
        obj = expand_pod(self.jobset, j, i, f"{self._made:05d}")
        meta = obj["metadata"]
        meta["uid"], meta["creationTimestamp"] = f"pod-{self._made:05d}", rfc3339(time.time())
        job = child_job_name(self.jobset["metadata"]["name"], j)
        meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": job, "uid": self.job_uid(j)}]
        return Pod(name=meta["name"], slice=j, index=i, obj=obj)

    def job_uid(self, j: int) -> str:
        """Slice ``j``'s child Job's uid: one per time the Job was made."""
        return f"job-{j}-{self.jobs_made.get(j, 1)}"

    def _place(self, pod: Pod, node: Node) -> None:
        self._placed += 1
        pod.node = node.name
        pod.ip = pod_ip(self._placed)
        if pod.obj["spec"].get("hostNetwork"):  # the node's address; a node keeps it
            pod.ip = pod_ip(node.slice * self.hosts + node.index, net=2)
        pod.obj["spec"]["nodeName"] = pod.node

    def _env(self, pod: Pod) -> dict[str, str]:
        container = job_container(self.job_spec)
        mounts = container.get("volumeMounts") or []
        volumes = {m["mountPath"]: self._pod_dir(pod, "volumes", m["name"]) for m in mounts}
        return {
            "HOME": str(self._pod_dir(pod)),  # the runtime sets one; the container's is its own directory here
            **self.image_env,
            **webhook_env(self.jobset, pod.slice, pod.index),
            **kubelet_env(pod, container, volumes),
        }

    def _pod_dir(self, pod: Pod, *sub: str) -> Path:
        """The pod's own directory (its working directory and home), or one under it (a volume's)."""
        path = self.workdir.joinpath("pods", pod.name, *sub)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _start(self, pod: Pod) -> None:
        container = job_container(self.job_spec)
        env = self._env(pod)
        cwd = self._pod_dir(pod)
        pod.log = cwd / "container.log"
        argv = [*container.get("command", []), *container.get("args", [])]
        if not argv:
            raise PodEmulatorError("the container has no command")
        with open(pod.log, "ab") as out:
            pod.proc = subprocess.Popen(
                [*self._unshare, "/bin/sh", "-c", POD_INIT, "pod-init", str(self.hosts_file), env["HOSTNAME"], *argv],
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the container: one process group, killed whole
                preexec_fn=_die_with_parent(),
            )

    def _write_hosts(self) -> None:
        """The pods' /etc/hosts, rewritten in place (the pods bind-mount its inode)."""
        placed = [p for p in self._pods() if p.ip and p.exit_code is None]
        rewrite_in_place(self.hosts_file, hosts_text(self.jobset, sorted(placed, key=lambda p: (p.slice, p.index))))

    def _delete_pod(self, pod: Pod, disruption: str, grace_s: float | None) -> None:
        if pod.deleting_since is not None:
            return
        pod.deleting_since = time.time()
        pod.disruption = disruption
        grace = float(pod.obj["spec"].get("terminationGracePeriodSeconds", 30) if grace_s is None else grace_s)
        pod.kill_at = pod.deleting_since + grace
        if pod.proc is not None and pod.exit_code is None:
            with contextlib.suppress(ProcessLookupError):
                pod.proc.send_signal(signal.SIGTERM)  # to the container's first process, as the runtime does


class EmulatedJobSet(_Kubelet, JobControllers, ClusterAPI):
    """A rendered JobSet whose pods run here; its slices' nodes come and go at the caller's word.

    ``spot_shutdown_grace_s`` is the Spot nodes' shutdown grace (GKE's 30 s by default: 15 s for the
    pods); a reclaimed node stays NotReady until the slice returns, or, with ``node_delete_s``, is deleted
    that long after its notice (its instance gone) and its pods are garbage-collected ``orphan_gc_s``
    after that, unless a node of the same name (a VM the pool recreates under its old name) is back first.
    ``reaper``: delete the failed leader pods a newer pod replaces.
    ``failure_backoff_s``: the Job's backoff before a failed pod is made again (first, most), after any failure of
    its index.  ``recreate_held_back``: make again the Job of a slice reclaimed whole whose pods the backoff
    holds back (:func:`training.gke.reaper.held_back_slices`), as the backend's watch does.
    ``spare_pools``: node pools of the shape beyond one a slice; ``pick_pool``: the scheduler's choice among the pools
    a pod may go to; ``repin``: make again the Job of a slice whose follower is pinned to another pool than its
    leader's (:func:`training.gke.reaper.mispinned_slices`), as the backend's watch does.  ``serve_api``: an API
    server on 127.0.0.1 for the pods (``$RTRAIN_KUBE_API``), so that their own repairs reach the cluster.
    """

    def __init__(
        self,
        manifests: GKEManifests,
        workdir: str | Path,
        image_env: Mapping[str, str],
        tick_s: float = 0.2,
        *,
        reaper: bool = True,
        spot_shutdown_grace_s: int = SPOT_SHUTDOWN_GRACE_S[0],
        node_delete_s: float | None = None,
        orphan_gc_s: float = ORPHAN_GC_S,
        renew_node_names: bool = False,
        failure_backoff_s: tuple[float, float] = POD_FAILURE_BACKOFF_S,
        recreate_held_back: bool = True,
        repin: bool = True,
        spare_pools: int = 0,
        pick_pool: Callable[[list[str]], str] = min,
        serve_api: bool = False,
    ) -> None:
        self.m = manifests
        self.jobset = manifests.jobset
        (self.rjob,) = self.jobset["spec"]["replicatedJobs"]
        self.job_spec = self.rjob["template"]["spec"]
        self.slices = int(self.rjob["replicas"])
        self.hosts = int(self.job_spec["completions"])
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.image_env = dict(image_env)
        self.tick_s = tick_s
        self.reaper = reaper
        self.spot_pod_grace_s = spot_shutdown_grace_s - CRITICAL_PODS_GRACE_S
        self.node_delete_s = node_delete_s  # None: a reclaimed node is not deleted (ORPHAN_GC_S's note)
        self.orphan_gc_s = orphan_gc_s
        self.renew_node_names = renew_node_names
        self.failure_backoff_s = failure_backoff_s
        self.recreate_held_back = recreate_held_back
        self.repin = repin
        self.pick_pool = pick_pool
        self.pools = self._pool_names(spare_pools)
        self.nodes: dict[str, Node] = {}
        for p in range(len(self.pools)):
            self._make_nodes(p)
        self.indexes = {(j, i): Index() for j in range(self.slices) for i in range(self.hosts)}
        self.jobs_made = {j: 1 for j in range(self.slices)}
        self.deleting_jobs: set[int] = set()
        self.refusals: list[str] = []  # pod creates JobSet's webhook refused: "<pod>: <why>"
        self.failed_jobs: dict[int, str] = {}
        self.state = ""  # "", "Completed" or "Failed": the JobSet's terminal condition
        self.deleted = False  # the JobSet was deleted: its pods go and none is made again
        self.error: BaseException | None = None  # what stopped the controllers' thread, raised to the caller
        self._made = 0  # pods made (their names' suffix)
        self._placed = 0  # pods given an IP
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jobset-emulator", daemon=True)
        self.hosts_file = self.workdir / "hosts"
        self._unshare = unshare_argv()
        self.api = EmulatedAPI(self) if serve_api else None  # the pods reach it at $RTRAIN_KUBE_API
        if self.api is not None:
            self.image_env[KUBE_API_ENV] = self.api.url

    # --- the caller's view ---------------------------------------------------------------------

    def __enter__(self) -> EmulatedJobSet:
        self.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.delete(grace_s=1 if exc_type is not None else None)  # a failing caller does not wait out the grace

    def start(self) -> None:
        """Create the JobSet: the Job controller makes its pods at its first tick."""
        with self._lock:
            self._write_hosts()
        if self.api is not None:
            self.api.start()
        self._thread.start()

    @property
    def up(self) -> set[int]:
        """The pools (slice j starts on pool j) whose nodes are all ready."""
        return {j for j in range(len(self.pools)) if all(n.ready for n in self.nodes.values() if n.slice == j)}

    def objects(self) -> list[K8sObject]:
        """The pods as API objects (with status), as ``kubectl get pods -o json`` lists them."""
        self._check()
        with self._lock:
            pending = (
                f"0/{len(self.up) * self.hosts} nodes are available: {self.hosts} Insufficient {TPU_RESOURCE} "
                f"({job_container(self.job_spec)['resources']['limits'].get(TPU_RESOURCE, '0')} per pod)"
            )
            container = job_container(self.job_spec)["name"]
            return [pod_object(p, container, pending) for p in self._pods() if not p.removed]

    def object(self) -> K8sObject:
        """The JobSet as an API object, with its terminal condition once it has one."""
        self._check()
        conditions = []
        if self.state:
            conditions.append({"type": self.state, "status": "True", "reason": self.state})
        return {**self.jobset, "status": {"conditions": conditions, "terminalState": self.state or None}}

    def running(self, slice_: int | None = None) -> list[Pod]:
        """The pods whose container runs (of one slice, or of all)."""
        self._check()
        with self._lock:
            return [
                idx.pods[-1]
                for (j, _), idx in sorted(self.indexes.items())
                if idx.pods and idx.pods[-1].phase == "Running" and slice_ in (None, j)
            ]

    def preempt_slice(self, slice_: int, grace_s: float | None = None) -> None:
        """A Spot reclaim of pool ``slice_`` (slice j starts on pool j): its nodes shut down (each pod on them gets
        SIGTERM, then SIGKILL after what the shutdown leaves it: ``grace_s``, by default the Spot grace less the
        system's 15 s, at most its own grace), and stay NotReady (deleted ``node_delete_s`` later, if set)."""
        with self._lock:
            now = time.time()
            down = set()
            for node in self.nodes.values():
                if node.slice == slice_ and node.ready:
                    node.ready = False
                    node.delete_at = None if self.node_delete_s is None else now + self.node_delete_s
                    down.add(node.name)
            grace = self.spot_pod_grace_s if grace_s is None else grace_s
            for pod in self._pods():
                if pod.node in down and pod.exit_code is None and pod.deleting_since is None:
                    own = float(pod.obj["spec"].get("terminationGracePeriodSeconds", 30))
                    self._delete_pod(pod, "the node was preempted (Spot)", min(own, grace))

    def return_slice(self, slice_: int) -> None:
        """Pool ``slice_``'s VMs are back (the pool makes them again): new, ready nodes; waiting pods are placed."""
        with self._lock:
            self._make_nodes(slice_)

    def kill_pod(self, slice_: int, index: int) -> None:
        """A host error: the pod's processes die at once (no grace, no disruption): it counts as a failure."""
        with self._lock:
            pod = self.indexes[(slice_, index)].pods[-1]
            if pod.proc is not None and pod.exit_code is None:
                _killpg(pod.proc.pid, signal.SIGKILL)

    def delete(self, grace_s: float | None = None) -> None:
        """Delete the JobSet: every pod is deleted (SIGTERM, SIGKILL after the grace) and waited for."""
        with self._lock:
            self.deleted = True
            for pod in self._pods():
                self._delete_pod(pod, "", grace_s)
            last_kill = max([p.kill_at or 0.0 for p in self._pods()] + [time.time()])
        while time.time() < last_kill + 5 and self._live():
            with self._lock:
                self._reap(time.time())
            time.sleep(0.1)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._lock:
            for pod in self._live():
                assert pod.proc is not None
                _killpg(pod.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._ended(pod, pod.proc.wait(timeout=10))
        if self.api is not None:
            self.api.close()

    def _live(self) -> list[Pod]:
        """The pods whose container has not ended."""
        return [p for p in self._pods() if p.proc is not None and p.exit_code is None]

    # --- the controllers -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except BaseException as e:  # noqa: BLE001 - raised to the caller at its next look
                self.error = e
                return
            self._stop.wait(self.tick_s)

    def _check(self) -> None:
        if self.error is not None:
            raise PodEmulatorError(f"the emulated cluster stopped: {self.error!r}") from self.error

    def _tick(self) -> None:
        with self._lock:
            now = time.time()
            self._reap(now)
            self._collect(now)
            self._jobset_controller(now)
            for (j, i), idx in sorted(self.indexes.items()):
                self._job_controller(j, i, idx, now)
            self._watch(now)
            self._schedule()

    def _watch(self, now: float) -> None:
        """The backend's watch between two looks at the pods: ``reaper`` and ``recreate_held_back``'s repairs."""
        listed = [pod_object(p, "", "") for p in self._pods() if not p.removed]
        if self.reaper:
            stale = set(replaced_leaders(listed))
            for pod in self._pods():
                pod.removed = pod.removed or pod.name in stale  # terminal: gone once the Job has counted it
        if self.recreate_held_back:
            for j in held_back_slices(listed, now, self.failure_backoff_s):
                self.delete_job(j)
        if self.repin:
            for j in mispinned_slices(listed, {n.name: n.pool for n in self.nodes.values()}):
                self.delete_job(j)

    def _reap(self, now: float) -> None:
        """The kubelet's part: note the containers that ended, kill those whose grace is over."""
        for pod in self._live():
            assert pod.proc is not None
            code = pod.proc.poll()
            if code is not None:
                self._ended(pod, code)
            elif pod.kill_at is not None and now >= pod.kill_at:
                _killpg(pod.proc.pid, signal.SIGKILL)

    def _collect(self, now: float) -> None:
        """Node deletion after a reclaim, and pod garbage collection of the pods of deleted nodes."""
        for node in self.nodes.values():
            if node.delete_at is not None and node.deleted_at is None and now >= node.delete_at:
                node.deleted_at = now
        for pod in self._pods():
            gone = self.nodes[pod.node].deleted_at if pod.node in self.nodes else None
            if pod.removed or gone is None or now < gone + self.orphan_gc_s:
                continue
            if pod.proc is not None and pod.exit_code is None:
                _killpg(pod.proc.pid, signal.SIGKILL)
                self._ended(pod, pod.proc.wait(timeout=10))
            pod.removed = True

    def _ended(self, pod: Pod, code: int) -> None:
        """The container's first process ended: the rest of the container goes with it."""
        pod.exit_code = 128 - code if code < 0 else code  # a signal as the runtime reports it (137 = SIGKILL)
        pod.ended = time.time()
        assert pod.proc is not None
        _killpg(pod.proc.pid, signal.SIGKILL)


def rewrite_in_place(path: Path, data: bytes) -> None:
    """One write over the old text, padded so the file never shrinks: no reader sees it empty."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        old_size = os.fstat(fd).st_size
        if len(data) < old_size:
            data += b"#" * (old_size - len(data) - 1) + b"\n"
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def unshare_argv() -> list[str]:
    """The command that gives a pod its own mount and UTS namespaces here (checked to work)."""
    exe = shutil.which("unshare")
    if exe is None:
        raise PodEmulatorError("the pod emulator needs unshare (util-linux) for each pod's /etc/hosts and hostname")
    argv = [exe, "--mount", "--uts"]
    if os.geteuid() != 0:
        argv.append("--map-root-user")
    probe = subprocess.run([*argv, "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        raise PodEmulatorError(f"unshare cannot make a pod's namespaces here: {probe.stderr.strip()}")
    return argv


def process_environ(pod: Pod) -> list[dict[str, str]]:
    """The environment of each process of the pod other than its container's first (the workers)."""
    if pod.proc is None:
        return []
    out = []
    for pid in _group_pids(pod.proc.pid):
        if pid == pod.proc.pid:
            continue
        with contextlib.suppress(OSError):
            raw = Path(f"/proc/{pid}/environ").read_bytes()
            out.append(dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv))
    return out


def cpu_image_env(chips_per_host: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """An image's environment for JAX on CPU: each pod's TPU chips become as many CPU devices, gloo between pods."""
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        **cpu_process_env(chips_per_host, {}),
        "PYTHONUNBUFFERED": "1",
        **(extra or {}),
    }


def _group_pids(pgid: int) -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                    yield int(entry.name)


@functools.cache
def _die_with_parent() -> Callable[[], object]:
    """What a child runs before exec: SIGKILL when the emulator's process goes, so no pod outlives it.

    Looked up in the parent: between fork and exec the child must not import (another thread may
    hold the import lock).
    """
    from training import procctl

    return procctl.bound(procctl.PR_SET_PDEATHSIG, signal.SIGKILL)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
