"""A JobSet's repairs made from inside its own pods (``rtrain repair-slices``): no watch needs to run for them.

Each slice's leader pod runs this beside its agent (the entrypoint starts it; it ends with the
container).  Every ``REPAIR_EVERY_S`` it makes :meth:`KubeJobSets.repair`'s repairs of the pod's
JobSet: failed leader pods a newer pod replaces, slices a grown backoff holds back, followers pinned
to another pool than their leader's.  So a run started with ``--detach``, a triggerer that restarts,
and the gap between two tries of an Airflow task lose nothing while no launcher watches.  Several
slices repairing at once is safe: each delete holds the uid it was seen with.  A slice that no pod
of the JobSet runs on (every slice reclaimed at once) waits for its backoff, or for a watch.

It acts as the pod's Kubernetes service account, which needs the ``rtrain-repairs`` Role and the
node reader's ClusterRole (docs/gke.md, section 5).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from training import procctl
from training.backends.gke_jobsets import KubeJobSets
from training.gke.names import KUBE_API_ENV

log = logging.getLogger("rtrain.repair")
REPAIR_EVERY_S = 15.0
# While the service account may not make a call, a look every this long (a Role granted later is used).
FORBIDDEN_EVERY_S = 300.0


@dataclass(frozen=True)
class OwnJobSet:
    """The JobSet this pod belongs to, from its environment (the downward API's values)."""

    name: str
    namespace: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> OwnJobSet | None:
        name, namespace = environ.get("RTRAIN_SUBDOMAIN", ""), environ.get("RTRAIN_NAMESPACE", "")
        return cls(name, namespace) if name and namespace else None


def api_client(environ: Mapping[str, str]) -> k8s.ApiClient | None:
    """The pod's client of its cluster's API server (``$RTRAIN_KUBE_API``, else in-cluster); None out of one."""
    conf = k8s.Configuration()
    conf.client_side_validation = False  # the server's objects are read as they come (a field left null, a new one)
    if environ.get(KUBE_API_ENV):
        conf.host = environ[KUBE_API_ENV]
    else:
        try:
            k8s_config.load_incluster_config(client_configuration=conf)
        except k8s_config.ConfigException:
            return None
    return k8s.ApiClient(conf)


def repair_once(jobsets: KubeJobSets, own: OwnJobSet, every_s: float = REPAIR_EVERY_S) -> float:
    """One look and its repairs; the wait before the next look (``every_s``, longer while forbidden)."""
    try:
        done = jobsets.repair(own.name, own.namespace)
    except ApiException as e:
        if e.status in (401, 403):
            log.error(
                "repair-slices: the pod's service account may not repair JobSet %s (HTTP %s: %s); grant it the "
                "rtrain-repairs Role (docs/gke.md, section 5): until then only a watching launcher repairs the slices",
                own.name,
                e.status,
                e.reason,
            )
            return max(FORBIDDEN_EVERY_S, every_s)
        log.warning("repair-slices: the API server failed a call (HTTP %s: %s); trying again", e.status, e.reason)
        return every_s
    except OSError as e:  # the API server out of reach for now (urllib3's errors are OSErrors)
        log.warning("repair-slices: cannot reach the API server: %s", e)
        return every_s
    except Exception:  # noqa: BLE001 - an answer it cannot read: said, and looked at again (the agent goes on)
        log.exception("repair-slices: a look at JobSet %s failed", own.name)
        return every_s
    if done:
        log.warning(
            "repair-slices: deleted the failed leader pods %s; made again the Jobs of slices %s",
            [p for p, _ in done.leader_pods],
            [j for j, _ in done.slice_jobs],
        )
    return every_s


def run(environ: Mapping[str, str], stop: threading.Event, every_s: float = REPAIR_EVERY_S) -> int:
    """Repair the pod's JobSet until ``stop`` is set; 0 at once where the pod has no JobSet or no cluster."""
    own = OwnJobSet.from_env(environ)
    client = api_client(environ) if own is not None else None
    if own is None or client is None:
        log.warning("repair-slices: not in a JobSet's pod with a cluster in reach: no repairs from here")
        return 0
    jobsets = KubeJobSets(client)
    wait = random.uniform(0, every_s)  # the slices' leaders started together: their looks spread out
    while not stop.wait(wait):
        wait = repair_once(jobsets, own, every_s)
    return 0


def main(every_s: float = REPAIR_EVERY_S) -> int:
    """``rtrain repair-slices``: repair this pod's JobSet every ``every_s`` until the container ends.

    It ends with the agent it was started beside (its parent) too, wherever no container ends it.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    parent = os.getppid()
    with contextlib.suppress(OSError):
        procctl.prctl(procctl.PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the agent went before the death signal was set
        return 0
    procctl.set_title(f"rtrain repair-slices {os.environ.get('RTRAIN_SUBDOMAIN', '')}".strip(), name="rtrain-repair")
    return run(os.environ, threading.Event(), every_s)
