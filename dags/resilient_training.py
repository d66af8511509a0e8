"""The resilient training pipeline: from data to pruned checkpoints, surviving lost hosts.

Two DAGs, one shape (setup, body, teardown):

    resolve_config -> prepare_dataset -> provision_capacity (setup)
      -> training: plan_topology -> launch_job -> watch_job      (retries relaunch the job)
      -> validate -> promote_or_rollback -> promote | rollback_and_resume (bounded)
      -> prune -> report (teardown, ALL_DONE) -> release_capacity (teardown, ALL_DONE)

* ``resilient_training``: triggered by hand (UI form, REST, CLI) with the params below.
* ``resilient_training_continual``: on a schedule, trains ``steps_per_run`` more
  steps of one run from its newest validated checkpoint (catchup off, one run at a time).

Wiring only: what each task does is in ``rtrain_airflow`` (plugins/), and the
engine in ``training/``.  Nothing here imports JAX.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG, CronTriggerTimetable, Param, TaskGroup
from rtrain_airflow.callbacks import alert_callbacks, rollback_alert
from rtrain_airflow.hooks.training import CHAOS_PATTERN, RUN_NAME_PATTERN
from rtrain_airflow.operators.training import (
    RTrainBranchValidationOperator,
    RTrainPlanTopologyOperator,
    RTrainPrepareDatasetOperator,
    RTrainPromoteCheckpointOperator,
    RTrainProvisionCapacityOperator,
    RTrainPruneCheckpointsOperator,
    RTrainReleaseCapacityOperator,
    RTrainReportRunOperator,
    RTrainResolveRunConfigOperator,
    RTrainRollbackAndResumeOperator,
    RTrainStartTrainingJobOperator,
    RTrainValidateCheckpointsOperator,
)
from rtrain_airflow.sensors.training import RTrainTrainingJobSensor

PRESETS = ["tiny", "small", "llama3-8b", "llama3-70b"]  # training/configs/*.yml (checked by the integrity test)
# Seconds between a failed try of a training task and its retry (the relaunch).
RETRY_DELAY = timedelta(seconds=float(os.environ.get("RTRAIN_RETRY_DELAY_S", "30")))
TRAINING_RETRIES = 2

TAGS = ["rtrain", "training", "jax", "elastic"]

DOC = """
### Resilient training

Trains a JAX model elastically on the **local slice** (N simulated hosts on this machine; the
default) or on **GKE** TPU slices (`backend: gke` and the `gke` param), then validates,
promotes or rolls back, prunes, and always releases capacity.

**Reruns** (both resume from the newest committed checkpoint, never from scratch):

* *Clear* the `training` group of a failed run (downstream included): `launch_job` relaunches
  from the newest committed checkpoint (a retry of `watch_job` does the same by itself).
* *Trigger* again with `{"run_name": ..., "resume_from": "latest"}` or `{"resume_from": "40"}`
  (rolls the run back to step 40 first), plus any overrides, e.g. `{"steps": 80, "chaos": []}`.

Alerts on failure, retry and rollback: `rtrain_airflow.callbacks`.
"""


def _nullable_int(description: str, minimum: int, maximum: int, section: str) -> Param:
    return Param(
        None, type=["null", "integer"], minimum=minimum, maximum=maximum, description=description, section=section
    )


def _nullable_number(description: str, minimum: float, maximum: float | None, section: str) -> Param:
    schema: dict[str, Any] = {"minimum": minimum}
    if maximum is not None:
        schema["maximum"] = maximum
    return Param(None, type=["null", "number"], description=description, section=section, **schema)


def training_params(continual: bool) -> dict[str, Param]:
    """The trigger form: each field typed, bounded and described.  ``null`` keeps the preset's value."""
    params: dict[str, Param] = {
        "run_name": Param(
            "continual" if continual else "demo",
            type="string",
            pattern=RUN_NAME_PATTERN,
            minLength=1,
            maxLength=63,
            description="Run name: the run's directory under the storage root. Letters, digits, `_.-`; no `..`, no `/`.",
            section="Run",
        ),
        "preset": Param(
            "tiny",
            type="string",
            enum=PRESETS,
            section="Run",
            description="Model and run preset (training/configs): tiny and small run on CPU; the llama3 "
            "presets are for TPU slices (and show the memory-fit refusal locally).",
        ),
        "dataset_source": Param(
            "stdlib",
            type="string",
            minLength=1,
            section="Data",
            description="What to train on: `stdlib` (this Python's standard library sources), a local directory or "
            "glob, or gs://bucket/prefix.",
        ),
        "dataset": Param(
            None,
            type=["null", "string"],
            minLength=1,
            section="Data",
            description="Where the prepared dataset lives (local path or gs://); prepared if missing. "
            "null: var/data/stdlib-seq<seq_len> (one per sequence length).",
        ),
        "dataset_max_bytes": Param(
            None,
            type=["null", "integer"],
            minimum=10_000,
            section="Data",
            description="Read at most this many source bytes (null: all).",
        ),
        "steps_per_run" if continual else "steps": (
            Param(
                20,
                type="integer",
                minimum=1,
                maximum=1_000_000,
                section="Training",
                description="Optimizer steps each scheduled run adds to the newest validated checkpoint.",
            )
            if continual
            else _nullable_int("Total optimizer steps of the run (null: the preset's).", 1, 1_000_000, "Training")
        ),
        "min_workers": _nullable_int("Fewest hosts the job may run on (null: the preset's).", 1, 256, "Training"),
        "max_workers": _nullable_int("Most hosts the job may use (null: the preset's).", 1, 256, "Training"),
        "checkpoint_every": _nullable_int(
            "Save a checkpoint every N steps (null: the preset's).", 1, 100_000, "Checkpoints"
        ),
        "keep_last": _nullable_int(
            "Retention: keep the newest N checkpoints (0: rule off; null: default 3).", 0, 1000, "Checkpoints"
        ),
        "keep_best": _nullable_int(
            "Retention: keep the best N validated checkpoints by loss (0: off; null: 1).", 0, 1000, "Checkpoints"
        ),
        "keep_every": _nullable_int(
            "Retention: keep every K-th step as a milestone (0: off; null: off).", 0, 1_000_000, "Checkpoints"
        ),
        "val_tolerance": _nullable_number(
            "Validation: reject a checkpoint whose loss is worse than the best validated one by more than this "
            "fraction (null: 0.05).",
            0.0,
            10.0,
            "Validation",
        ),
        "val_max_loss": _nullable_number(
            "Validation: reject a loss above this (0: no threshold; null: 0).", 0.0, None, "Validation"
        ),
        "val_min_accuracy": _nullable_number(
            "Validation: reject a token accuracy below this (0: none; null: 0).", 0.0, 1.0, "Validation"
        ),
        "max_rollbacks": _nullable_int(
            "Validation rollbacks (each followed by resumed training) this DAG run may do (null: 2).",
            0,
            10,
            "Validation",
        ),
        "storage_root": Param(
            "var/runs",
            type="string",
            minLength=1,
            section="Storage",
            description="Run root: a local path (relative to the project) or gs://bucket/prefix.",
        ),
        "backend": Param(
            "local",
            type="string",
            enum=["local", "gke"],
            section="Backend",
            description="Where the workers run: `local` (simulated hosts on this machine) or `gke` "
            "(TPU node pools; fill in the `gke` param).",
        ),
        "gke": Param(
            {},
            type="object",
            section="Backend",
            description="backend=gke only: project_id, location, cluster_name, machine_type, tpu_topology, "
            "image, node_pools (one per slice), namespace, spot, node_locations, gcp_conn_id.",
            properties={
                "location": {"type": "string"},
                "cluster_name": {"type": "string"},
                "machine_type": {"type": "string"},
                "tpu_topology": {"type": "string"},
                "image": {"type": "string"},
                "node_pools": {"type": "array", "items": {"type": "string"}},
                "project_id": {"type": "string"},
                "namespace": {"type": "string"},
                "spot": {"type": "boolean"},
                "gcp_conn_id": {"type": "string"},
            },
        ),
        "chaos": Param(
            [],
            type="array",
            items={"type": "string", "pattern": CHAOS_PATTERN},
            section="Chaos",
            description="Fault injection (off when empty), e.g. `preempt:worker=1,step=40`, "
            "`capacity:to=4,step=80`, `crash:worker=0,step=12`, `lr_spike:step=30,factor=50`.",
        ),
        "overrides": Param(
            {},
            type="object",
            section="Advanced",
            description='Any other run-config key (training/config.py), e.g. {"learning_rate": 0.001}; '
            "unknown keys are refused.",
        ),
    }
    if not continual:
        params["resume_from"] = Param(
            "latest",
            type="string",
            pattern=r"^(latest|none|[0-9]+)$",
            section="Run",
            description="`latest`: continue the run from its newest committed checkpoint (new run: from scratch); "
            "`none`: a new run only (an existing one is refused); a step: roll the run back to that "
            "committed step and continue from it.",
        )
    return params


def pipeline(continual: bool) -> None:
    """The tasks of one DAG (called inside its ``with DAG(...)``)."""
    resolve = RTrainResolveRunConfigOperator(task_id="resolve_config", continual=continual, retries=0)
    spec = resolve.output
    prepare = RTrainPrepareDatasetOperator(task_id="prepare_dataset", spec=spec)
    provision = RTrainProvisionCapacityOperator(task_id="provision_capacity", spec=spec)

    # The body.  Retries relaunch the job from its newest committed checkpoint (see RTrainTrainingJobSensor).
    with TaskGroup(
        "training",
        tooltip="plan, launch or re-attach, watch (retries relaunch)",
        default_args={"retries": TRAINING_RETRIES, "retry_delay": RETRY_DELAY},  # type: ignore[arg-type]
    ) as training:
        plan = RTrainPlanTopologyOperator(task_id="plan_topology", spec=spec)
        launch = RTrainStartTrainingJobOperator(task_id="launch_job", spec=spec)
        watch = RTrainTrainingJobSensor(task_id="watch_job", spec=spec, handle=launch.output)
        plan >> launch >> watch

    validate = RTrainValidateCheckpointsOperator(task_id="validate", spec=spec)
    branch = RTrainBranchValidationOperator(
        task_id="promote_or_rollback",
        validation=validate.output,
        promote_task_id="promote",
        rollback_task_id="rollback_and_resume",
    )
    promote = RTrainPromoteCheckpointOperator(task_id="promote", spec=spec)
    rollback = RTrainRollbackAndResumeOperator(
        task_id="rollback_and_resume", spec=spec, retries=TRAINING_RETRIES, on_execute_callback=rollback_alert()
    )
    prune = RTrainPruneCheckpointsOperator(task_id="prune", spec=spec)

    # The teardown: always, whatever failed (ALL_DONE), and not deciding the run's state.
    report = RTrainReportRunOperator(task_id="report", spec_from="resolve_config").as_teardown(setups=provision)
    release = RTrainReleaseCapacityOperator(
        task_id="release_capacity",
        spec_from="resolve_config",
        handle_from=["training.launch_job", "training.watch_job", "rollback_and_resume"],
    ).as_teardown(setups=provision)

    (
        resolve
        >> prepare
        >> provision
        >> training
        >> validate
        >> branch
        >> [promote, rollback]
        >> prune
        >> report
        >> release
    )


DEFAULT_ARGS = {"owner": "rtrain", "retries": 1, "retry_delay": RETRY_DELAY, **alert_callbacks()}

with DAG(
    dag_id="resilient_training",
    description="Elastic JAX training from data to pruned checkpoints; survives lost hosts",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=TAGS,
    default_args=DEFAULT_ARGS,
    params=training_params(continual=False),
    doc_md=DOC,
):
    pipeline(continual=False)

with DAG(
    dag_id="resilient_training_continual",
    description="Continual training: each scheduled run trains on from the newest validated checkpoint",
    schedule=CronTriggerTimetable("0 3 * * *", timezone="UTC"),  # first run at the next 03:00, not at unpause
    catchup=False,
    max_active_runs=1,
    tags=[*TAGS, "continual"],
    default_args=DEFAULT_ARGS,
    params=training_params(continual=True),
    doc_md=DOC,
):
    pipeline(continual=True)
