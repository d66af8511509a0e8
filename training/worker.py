"""One training process of the multi-controller program (one per host).

Started by the elastic agent (local slice) or by a JobSet pod (GKE) with:

    RTRAIN_RUN_URI        the run's directory (local path or gs://)
    RTRAIN_COORDINATOR    host:port of process 0
    RTRAIN_NUM_PROCESSES  processes in this launch
    RTRAIN_PROCESS_ID     this process
    RTRAIN_ATTEMPT        launch attempt (for event ids)
    RTRAIN_RESUME         latest | none | <step>
    RTRAIN_CHAOS          JSON list of worker-side faults still to fire
    RTRAIN_CONTROL_FD     (local slice) pipe to the agent for reports

The loop below is the whole program, in sections: set-up, restore, compile,
train; each section reports what it did and how long it took.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

T_START = time.time()


class Reporter:
    """Structured reports to the agent: a pipe locally, the event log otherwise."""

    def __init__(self, process_id: int, attempt: int, store: Any) -> None:
        self.pid = process_id
        self.attempt = attempt
        fd = os.environ.get("RTRAIN_CONTROL_FD")
        self.pipe = os.fdopen(int(fd), "w", buffering=1) if fd else None
        self.events = None
        if self.pipe is None and process_id == 0:
            from training.events import EventLog

            self.events = EventLog(store, source=f"worker{process_id}-a{attempt}")

    def send(self, type_: str, *, everyone: bool = False, **fields: Any) -> None:
        if self.pid != 0 and not everyone:
            return
        fields = {"attempt": self.attempt, "process_id": self.pid, **fields}
        if self.pipe is not None:
            self.pipe.write(json.dumps({"type": type_, "time": time.time(), **fields}) + "\n")
            self.pipe.flush()
        elif self.events is not None:
            self.events.emit(type_, **fields)


def _env_int(name: str, default: int | None = None) -> int:
    v = os.environ.get(name)
    if v is None:
        if default is None:
            raise SystemExit(f"{name} is not set")
        return default
    return int(v)


def main() -> int:
    # --- set-up -----------------------------------------------------------------------
    run_uri = os.environ["RTRAIN_RUN_URI"]
    num_processes = _env_int("RTRAIN_NUM_PROCESSES", 1)
    process_id = _env_int("RTRAIN_PROCESS_ID", 0)
    attempt = _env_int("RTRAIN_ATTEMPT", 0)
    coordinator = os.environ.get("RTRAIN_COORDINATOR", "")
    resume = os.environ.get("RTRAIN_RESUME", "latest")
    faults_json = os.environ.get("RTRAIN_CHAOS", "[]")

    from training.chaos import parse_chaos
    from training.config import config_from_json
    from training.storage import open_store

    store = open_store(run_uri)
    cfg = config_from_json(store.get("config.json").decode())
    rep = Reporter(process_id, attempt, store)
    faults = [parse_chaos(s) for s in json.loads(faults_json)]

    import jax

    # The persistent compilation cache makes a relaunch on a mesh seen before skip XLA compilation.
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(cfg.compilation_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if num_processes > 1:
        jax.distributed.initialize(
            coordinator, num_processes, process_id, heartbeat_timeout_seconds=10, initialization_timeout=120
        )
    t_init = time.time()
    rep.send("worker_started", everyone=True, seconds=t_init - T_START)

    from training import data as data_lib
    from training import trainer as tr
    from training.mesh import build_mesh, check_batch, plan_mesh

    plan = plan_mesh(cfg, num_processes)
    check_batch(cfg, plan)
    mesh = build_mesh(plan)
    trainer = tr.Trainer(cfg, mesh)
    mngr = tr.checkpoint_manager(cfg, run_uri)
    manifest = data_lib.load_manifest(cfg.dataset)

    # --- restore ----------------------------------------------------------------------
    # Resume order (written down once): this run's newest committed checkpoint that
    # the ledger does not reject (Orbax lists committed steps only, so a save cut off
    # mid-write is never a candidate; a rollback moves rejected ones out of the way),
    # else an explicit step, else scratch.  The ledger's resume pointer, when it names
    # that step, says how to resume: skip a data window, scale the learning rate.
    from training.ledger import Ledger

    ledger = Ledger(store)
    t0 = time.time()
    step0: int | None
    if resume == "none":
        step0 = None
    elif resume == "latest":
        mngr.reload()
        states = ledger.states()
        committed_steps = list(mngr.all_steps())
        usable = [
            s for s in committed_steps if states.get(s, {}).get("state") not in ("rejected", "quarantined", "pruned")
        ]
        if committed_steps and not usable:
            raise SystemExit(f"every committed checkpoint of {run_uri} is rejected; roll back or start a new run")
        step0 = max(usable) if usable else None
    else:
        step0 = int(resume)
    from training.ledger import pin, unpin

    owner = f"worker{process_id}-a{attempt}-{os.getpid()}"
    # A running job pins the step it reads or writes, so a pruner never deletes it underneath.
    pins: dict[int, str] = {}

    def pin_step(s: int, kind: str) -> None:
        if process_id == 0:
            pins[s] = pin(store, s, owner, kind)  # type: ignore[arg-type]

    def unpin_step(s: int) -> None:
        if s in pins:
            unpin(store, pins.pop(s))

    def committed(s: int) -> None:
        rep.send("checkpoint", step=s, committed=True)
        unpin_step(s)

    if step0 is not None:
        pin_step(step0, "restore")
        state, data_pos = tr.restore(mngr, step0, trainer)
        unpin_step(step0)
        if data_pos.get("dataset") not in (None, manifest["fingerprint"]):
            if cfg.on_dataset_change != "restart":
                raise SystemExit(
                    f"checkpoint {step0} was trained on dataset {data_pos.get('dataset')}, not "
                    f"{manifest['fingerprint']} (on_dataset_change=restart continues on the new data)"
                )
            # Continual training on refreshed data: the model goes on, the data position starts over.
            rep.send("data_refreshed", step=step0, old=data_pos.get("dataset"), new=manifest["fingerprint"])
            data_pos = {"next_batch": 0, "lr_scale": data_pos.get("lr_scale", 1.0)}
        rep.send("restore", step=step0, mesh=plan.shape, workers=num_processes, seconds=time.time() - t0)
    else:
        state = trainer.init()
        data_pos = {"next_batch": 0}
        rep.send("init", step=0, mesh=plan.shape, workers=num_processes, seconds=time.time() - t0)
    step = int(step0 or 0)
    next_batch = int(data_pos["next_batch"])
    lr_scale = float(data_pos.get("lr_scale", 1.0))
    skipped: list[list[int]] = list(data_pos.get("skipped", []))
    ptr = ledger.pointer_record()
    if step0 is not None and ptr is not None and int(ptr["step"]) == step0:
        how = ptr.get("resume") or {}
        skip_to = int(how.get("skip_to_batch", next_batch))
        if skip_to > next_batch:
            skipped.append([next_batch, skip_to])
            next_batch = skip_to
        lr_scale *= float(how.get("lr_scale", 1.0))
        if how:
            rep.send("resumed_with", step=step0, next_batch=next_batch, lr_scale=lr_scale, skipped=skipped)

    # --- compile --------------------------------------------------------------------------
    t0 = time.time()
    trainer.compile()
    rep.send("compiled", step=step, seconds=time.time() - t0)

    batches = data_lib.make_batches(
        cfg.dataset,
        "train",
        seed=cfg.seed,
        global_batch=cfg.global_batch,
        process_index=process_id,
        process_count=num_processes,
        start_batch=next_batch,
    )

    # --- train ----------------------------------------------------------------------------
    tokens_per_step = cfg.global_batch * cfg.seq_len
    pending_save: int | None = None
    t_last = time.time()
    first = True
    recent: list[float] = []  # logged losses for the spike guard's running median
    chaos_lr = 1.0
    while step < cfg.steps:
        for f in faults:
            if f.step == step and f.action in ("preempt", "crash") and f.worker == process_id:
                rep.send("chaos", everyone=True, action=f.action, spec=f.spec, step=step, worker=process_id)
                os.kill(os.getpid(), signal.SIGKILL)
        step_lr = lr_scale * chaos_lr
        for f in faults:
            if f.step == step and f.action == "lr_spike":
                chaos_lr = float(f.get("factor") or 1.0)
                step_lr = lr_scale * chaos_lr
                rep.send("chaos", action=f.action, spec=f.spec, step=step, worker=process_id)
            elif f.step == step and f.action == "nan":
                step_lr = float("nan")
                rep.send("chaos", action=f.action, spec=f.spec, step=step, worker=process_id)

        local = next(batches)
        if cfg.trace_data_ids:
            store.put(
                f"trace/{step:08d}/a{attempt:03d}-p{process_id:03d}.json",
                json.dumps({"ids": [int(i) for i in local["ids"]], "processes": num_processes}).encode(),
            )
        inputs, targets = trainer.global_batch(local)
        state, metrics = trainer.step(state, inputs, targets, step_lr)
        step += 1
        next_batch += 1
        save_now = step % cfg.checkpoint_every == 0 or step == cfg.steps

        if step % cfg.log_every == 0 or step == cfg.steps or first or save_now:
            # A host sync: only on logged and checkpoint steps.  Every process holds the
            # replicated loss, so all of them take the same decision below.
            loss = float(metrics["loss"])
            now = time.time()
            bad = _guard(loss, recent, cfg.spike_factor, cfg.spike_window)
            if bad:
                # big_vision style: fail loudly with the step and the metric; the agent
                # rolls back to the last good checkpoint and skips the batches since.
                # A save still in flight holds a state from before the bad step: let it commit.
                mngr.wait_until_finished()
                if pending_save is not None:
                    committed(pending_save)
                rep.send("guard", step=step, metric="loss", value=loss, reason=bad, next_batch=next_batch)
                return GUARD_EXIT
            recent.append(loss)
            n = 1 if first else cfg.log_every
            rep.send(
                "progress",
                step=step,
                loss=loss,
                grad_norm=float(metrics["grad_norm"]),
                accuracy=float(metrics["accuracy"]),
                tokens_per_s=tokens_per_step * n / max(now - t_last, 1e-9),
                step_time=(now - t_last) / n,
            )
            if first:
                rep.send("resumed", step=step, seconds=now - T_START)
                first = False
            t_last = now

        if pending_save is not None and not mngr.is_saving_in_progress():
            committed(pending_save)
            pending_save = None

        if save_now:
            for f in faults:
                if f.action == "corrupt" and f.step == step:
                    state = trainer.corrupt(state)
                    rep.send("chaos", action=f.action, spec=f.spec, step=step, worker=process_id)
            data_pos = {
                "next_batch": next_batch,
                "examples_consumed": (next_batch - sum(b - a for a, b in skipped)) * cfg.global_batch,
                "global_batch": cfg.global_batch,
                "seed": cfg.seed,
                "dataset": manifest["fingerprint"],
                "lr_scale": lr_scale,
                "skipped": skipped,
            }
            if pending_save is not None:
                mngr.wait_until_finished()
                committed(pending_save)
            t_save = time.time()
            pin_step(step, "save")
            tr.save(mngr, step, state, data_pos, cfg)
            pending_save = step
            rep.send("checkpoint", step=step, committed=False, blocking_s=time.time() - t_save)
            for f in faults:
                if f.action == "kill_during_save" and f.step == step and f.worker == process_id:
                    rep.send("chaos", everyone=True, action=f.action, spec=f.spec, step=step, worker=process_id)
                    os.kill(os.getpid(), signal.SIGKILL)
            stop = step < cfg.steps and _stop_requested(store, attempt, process_id, num_processes)
            if stop:
                mngr.wait_until_finished()
                committed(step)
                rep.send("rescale_requested", step=step, workers=num_processes)
                mngr.close()
                return 0
            t_last = time.time()  # saving time is not step time

    mngr.wait_until_finished()
    if pending_save is not None:
        committed(pending_save)
    mngr.close()
    rep.send("finished", step=step)
    return 0


GUARD_EXIT = 17


def _guard(loss: float, recent: list[float], factor: float, window: int) -> str:
    """Why this loss must not be trained on ('' when it is fine)."""
    import numpy as np

    if not np.isfinite(loss):
        return f"loss is {loss}"
    if factor > 0 and len(recent) >= 3:
        median = float(np.median(recent[-window:]))
        if loss > factor * median:
            return f"loss {loss:.4g} > {factor:g} x running median {median:.4g}"
    return ""


def _stop_requested(store: Any, attempt: int, process_id: int, num_processes: int) -> bool:
    """Did the agent ask this launch to stop at this checkpoint (to scale up)?

    Only process 0 reads the request; its answer is broadcast so that every
    process stops at the same step.
    """
    import numpy as np
    from jax.experimental import multihost_utils

    flag = 0
    if process_id == 0:
        try:
            req = json.loads(store.get("control.json"))
            flag = int(req.get("action") == "stop_at_checkpoint" and req.get("attempt") == attempt)
        except Exception:
            flag = 0
    if num_processes > 1:
        flag = int(multihost_utils.broadcast_one_to_all(np.int32(flag)))
    return bool(flag)


if __name__ == "__main__":
    sys.exit(main())
