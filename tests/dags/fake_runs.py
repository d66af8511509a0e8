"""A finished run root written by hand, for the UI tests: the files a real run leaves, no JAX.

The story of ``write_run`` (40 steps, ``log_every`` 1, times spread over about a minute):

* job 1, round 0 on 4 hosts; checkpoint 10; host h1 preempted at step 15 (failure);
  round 1 on 3 hosts (a resize), restored from 10: steps 11-15 are trained again (a recovery);
  checkpoints 20 and 30; the job finishes at step 30;
* validation: 10 and 20 validated, 30 rejected (a loss spike) -> rollback 30 -> 20;
* job 2 on 4 hosts resumes from 20: steps 21-30 again, checkpoints 30 and 40, finishes at 40;
* 30 and 40 validated, 40 promoted.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.events import Event

STEPS = 40
STEP_TIME = 0.5


def _loss(step: int, spike: bool = False) -> float:
    return round(5.6 * math.exp(-step / 25.0) + 1.2 + (2.5 if spike else 0.0), 4)


class _Writer:
    def __init__(self, uri: str, t0: float) -> None:
        from training.storage import open_store

        self.store = open_store(uri)
        self.t = t0

    def emit(self, type_: str, dt: float = 0.1, source: str = "h0-agent", **fields: Any) -> Event:
        from training.events import make_event

        self.t += dt
        ev = make_event(type_, source, self.t, **fields)
        key = f"events/{int(self.t * 1e9):020d}-{source}-{uuid.uuid4().hex[:8]}.json"
        self.store.create(key, json.dumps(ev, sort_keys=True).encode())
        return ev

    def steps(self, first: int, last: int, workers: int, spike_from: int | None = None) -> None:
        for step in range(first, last + 1):
            spike = spike_from is not None and step >= spike_from
            self.emit(
                "progress",
                dt=STEP_TIME,
                step=step,
                loss=_loss(step, spike),
                step_time=STEP_TIME,
                tokens_per_s=2048 * workers / STEP_TIME,
                grad_norm=1.0,
                accuracy=0.3,
            )
            if step == first:
                self.emit("resumed", dt=0.01, step=step, seconds=0.4)


def mesh(workers: int) -> dict[str, int]:
    return {"data": workers, "fsdp": 1, "tensor": 1}


def write_run(root: Path | str, name: str, *, t0: float | None = None, state: str = "finished") -> str:
    """A run root ``<root>/<name>`` with config, events, ledger and status; returns its URI."""
    import time

    from rtrain_airflow.hooks.training import RTrainHook

    from training.checkpoint.ledger import Ledger
    from training.events import write_status

    uri = f"{Path(root)}/{name}"
    cfg = RTrainHook().build_config({"run_name": name, "root": str(root), "steps": STEPS, "checkpoint_every": 10})
    w = _Writer(uri, t0 if t0 is not None else time.time() - 600)
    w.store.put("config.json", cfg.to_json().encode())
    ledger = Ledger(w.store)

    # Job 1.
    w.emit("config", by="test", job="j1", changed=[])
    w.emit("leader", host="h0", job="j1")
    w.emit(
        "launch", dt=0.5, attempt=0, round=0, workers=4, mesh=mesh(4), members=["h0", "h1", "h2", "h3"], resume="latest"
    )
    w.emit("init", dt=1.0, step=0, mesh=mesh(4))
    w.emit("compiled", dt=2.0, step=0, seconds=2.0)
    w.steps(1, 15, 4)
    ledger.record(10, "committed")
    w.emit("checkpoint", step=10, committed=True)
    w.emit("chaos", action="preempt", worker=1, step=15, spec="preempt:worker=1,step=15")
    fault = w.t
    w.emit("host_lost", dt=1.0, host="h1", reason="no heartbeat", round=0)
    w.emit(
        "failure",
        dt=0.2,
        attempt=0,
        round=0,
        reason="host h1 lost: no heartbeat",
        hosts=["h1"],
        detect_s=1.2,
        fault_at=fault,
    )
    w.emit("resize", dt=0.5, old_workers=4, new_workers=3, old_mesh=mesh(4), new_mesh=mesh(3), round=1)
    w.emit("launch", dt=0.1, attempt=1, round=1, workers=3, mesh=mesh(3), members=["h0", "h2", "h3"], resume="10")
    w.emit("restore", dt=3.0, step=10, mesh=mesh(3), seconds=1.5)
    w.steps(11, 30, 3, spike_from=27)
    for step in (20, 30):
        ledger.record(step, "committed")
    w.emit("checkpoint", step=30, committed=True)
    w.emit("finished", dt=0.5, step=30, failures=1, seconds=40.0)

    # Validation and the rollback (the DAG's validate and rollback_and_resume tasks).
    for step, verdict in ((10, "validated"), (20, "validated"), (30, "rejected")):
        metrics = {"loss": _loss(step, spike=step == 30), "perplexity": 40.0, "accuracy": 0.3}
        if verdict == "validated":
            ledger.record(step, "validated", metrics=metrics)
        else:
            ledger.record(step, "rejected", metrics=metrics, reason="loss worse than the best validated by 60%")
        w.emit(
            "validation",
            dt=1.0,
            source="lifecycle",
            step=step,
            verdict=verdict,
            metrics=metrics,
            reason="" if verdict == "validated" else "loss worse than the best validated by 60%",
        )
    ledger.record(30, "quarantined", reason="validation rollback")
    ledger.set_pointer(20, "validation rollback")
    w.emit(
        "rollback",
        source="lifecycle",
        from_step=30,
        to_step=20,
        reason="step 30 rejected",
        quarantined=[30],
        kind="validation",
    )

    # Job 2.
    w.emit("leader", dt=2.0, host="h0", job="j2")
    w.emit("launch", dt=0.5, attempt=0, round=0, workers=4, mesh=mesh(4), members=["h0", "h1", "h2", "h3"], resume="20")
    w.emit("restore", dt=2.0, step=20, mesh=mesh(4), seconds=1.0)
    w.steps(21, STEPS, 4)
    for step in (30, 40):
        ledger.record(step, "committed")
        w.emit("checkpoint", step=step, committed=True)
    if state == "finished":
        w.emit("finished", dt=0.5, step=STEPS, failures=0, seconds=12.0)
        for step in (30, 40):
            metrics = {"loss": _loss(step), "perplexity": 20.0, "accuracy": 0.35}
            ledger.record(step, "validated", metrics=metrics)
            w.emit("validation", dt=1.0, source="lifecycle", step=step, verdict="validated", metrics=metrics, reason="")
        ledger.record(40, "promoted")
        w.emit("validation", dt=0.5, source="lifecycle", step=40, verdict="promoted", metrics=metrics)
    write_status(
        w.store,
        state=state,
        step=STEPS,
        steps_total=STEPS,
        loss=_loss(STEPS),
        failures=0,
        job="j2",
        workers=4,
        run_uri=uri,
        latest_committed=40,
    )
    return uri


def write_submission(root: Path | str, name: str, priority: str, ended: str = "") -> None:
    """A run submitted to the root's pool of 4 hosts (2..4 hosts, 100 steps): queued, or ``ended`` as given."""
    import time

    from training.service.queue import Placement, Queue, Submission

    q = Queue(str(root))
    q.set_pool(4)
    q.put_submission(
        Submission(
            run_name=name,
            run_uri=f"{root}/{name}",
            priority=priority,
            min_hosts=2,
            max_hosts=4,
            hosts_per_slice=1,
            steps=100,
            config="{}",
            submitted_at=time.time(),
        )
    )
    q.put_placement(Placement(run_name=name, job="j1" if ended else "", ended=ended))
