"""The run root: every object name under ``<root>/<run_name>/``, in one place.

This is the contract between the layers (the CLI, the host agents, the
workers, the Airflow plugin): any process, any retry, any machine can pick a
run up from these names alone.  ``docs/architecture.md`` describes each one.
A local directory and ``gs://bucket/prefix`` hold the same names.
"""

from __future__ import annotations

import os

from training.storage import join, scheme

CONFIG = "config.json"  # the resolved, validated config (replaced whole, under the run lock)
CONFIG_HISTORY = "config-history/"  # each version of it, write-once, with who wrote it
STATUS = "status.json"  # the current state, for sensors and the CLI (one writer: the leader)
EVENTS = "events/"  # typed write-once JSON records
CHECKPOINTS = "checkpoints"  # Orbax steps: checkpoints/<step>/{state,data,config}
QUARANTINE = "quarantine/"  # checkpoints moved out of the resume path (rolled back, corrupt)
LEDGER_STEPS = "ledger/steps/"  # each checkpoint's state changes
LEDGER_POINTER = "ledger/pointer/"  # the resume pointer's moves
LEDGER_PINS = "ledger/pins/"  # steps a running job reads or writes
LOCK = "lock/"  # the run lock: one object per lease generation
RENDEZVOUS = "rendezvous/"  # the host agents' meeting point
RDV_HOSTS = RENDEZVOUS + "hosts/"  # <host>.json: each agent's heartbeat (replaced whole)
RDV_ROUNDS = RENDEZVOUS + "rounds/"  # <round>.json: the leader's plan for each round (write-once)
RDV_REPORTS = RENDEZVOUS + "reports/"  # <round>/<host>.json: how each host's worker ended (write-once)
RDV_ROUNDS_BEFORE = RENDEZVOUS + "rounds-before"  # the newest round number of the run's earlier jobs: counts go on
RDV_RESERVE = RENDEZVOUS + "reserve"  # local roots: space held back for a job's last words on a full disk
RDV_EVENT_RESERVE = RENDEZVOUS + "reserve-event"  # local roots: the blocks a full disk's final event is written in
CAPACITY = "capacity.json"  # the local slice's host count (the stand-in for a node pool's size)
CONTROL = "control.json"  # the leader's request to the workers: stop at the next checkpoint
STOP = "stop.json"  # a person's stop of the job (rtrain stop, a cancel, a teardown): its reason, until the next launch
TRACE = "trace/"  # per-step example ids (trace_data_ids=true)
COMPILED = "compiled/"  # <job>/step-<workers>.bin: a job's compiled steps, loaded by its later rounds of that size
AIRFLOW = "airflow/"  # what each DAG run's first launch did
LOGS = "logs"  # local roots: agent and worker logs


def run_uri(root: str, run_name: str) -> str:
    """``<root>/<run_name>`` for a local root or a ``gs://`` root."""
    return join(root, run_name)


def checkpoints_uri(run: str) -> str:
    """Where Orbax keeps a run's steps."""
    return join(run, CHECKPOINTS)


def step_uri(run: str, step: int) -> str:
    return join(run, CHECKPOINTS, str(step))


def logs_base(run_uri: str, run_name: str) -> str:
    """Where a run's agent and worker logs go on this machine: beside the run on a local root, else ``var/logs``."""
    return join(run_uri, LOGS) if scheme(run_uri).filesystem else os.path.join("var", "logs", run_name)
