"""The resilient training pipeline: from data to pruned checkpoints, surviving lost hosts.

Two DAGs, one shape (setup, body, teardown):

    resolve_config -> prepare_dataset -> provision_capacity (setup)
      -> training: plan_topology -> launch_job -> watch_job      (retries relaunch the job)
      -> validate -> promote_or_rollback -> promote | rollback_and_resume (bounded)
      -> prune -> report (teardown, ALL_DONE) -> release_capacity (teardown, ALL_DONE)
      promote | rollback_and_resume -> export (optional: a Hugging Face or plain Orbax copy) -> report

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
from rtrain_airflow.form import config_param, text, when_empty
from rtrain_airflow.hooks.training import CHAOS_EXAMPLES, CHAOS_RULES, PRIORITY_LEVELS, RUN_NAME_RULES, backend_names
from rtrain_airflow.operators.training import (
    RESOLVE_TASK_ID,
    RTrainBranchValidationOperator,
    RTrainExportCheckpointOperator,
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

PRESETS = [
    "tiny",
    "small",
    "llama3.2-1b",
    "llama3.2-3b",
    "llama3.1-8b",
    "llama3.1-70b",
    "llama3-8b",
    "llama3-70b",
]  # training/configs/*.yml (checked by the integrity test)
# Seconds between a failed try of a training task and its retry (the relaunch).
RETRY_DELAY = timedelta(seconds=float(os.environ.get("RTRAIN_RETRY_DELAY_S", "30")))
TRAINING_RETRIES = 2
# Runs of the triggered DAG at once (each its own run_name): with a priority they share the root's pool of hosts.
MAX_ACTIVE_RUNS = 4

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

**Stopping** (`rtrain stop`, `rtrain cancel`, the Training view's *Stop the run*): the job ends `stopped`,
not failed; `watch_job` is skipped (no retry), validation, promotion and pruning are skipped, the teardown
runs and the DAG run succeeds. Trigger again with the same `run_name` to resume it.

**The form**: a field left empty keeps the preset's value (each field says what that is, preset by
preset); an empty fault list, `gke` or `overrides` field means off.

Alerts on failure, retry and rollback: `rtrain_airflow.callbacks`.
"""


# The form's sections, in its order ("Config overrides", not "Advanced": Airflow's own "Advanced Options"
# section follows ours on the trigger page).
SECTIONS = (
    "Run",
    "Task",
    "Data",
    "Training",
    "Checkpoints",
    "Validation",
    "Storage",
    "Backend",
    "Chaos",
    "Config overrides",
)
# Form fields that are run-config keys: (form section, config key as section.key, title).  Type, bounds and help
# come from the config; the param is named by the key in its section (its name in a DAG run's conf).
CONFIG_FIELDS = (
    ("Training", "elastic.min_workers", "Fewest hosts"),
    ("Training", "elastic.max_workers", "Most hosts"),
    ("Checkpoints", "checkpoint.checkpoint_every", "Checkpoint every N steps"),
    ("Checkpoints", "checkpoint.local_checkpoint_every", "Local checkpoint every N steps"),
    ("Checkpoints", "checkpoint.keep_last", "Keep the newest N"),
    ("Checkpoints", "checkpoint.keep_best", "Keep the best N"),
    ("Checkpoints", "checkpoint.keep_every", "Keep every K-th step"),
    ("Validation", "checkpoint.val_tolerance", "Loss tolerance"),
    ("Validation", "checkpoint.val_max_loss", "Highest loss"),
    ("Validation", "checkpoint.val_min_accuracy", "Lowest accuracy"),
    ("Validation", "checkpoint.max_rollbacks", "Rollbacks at most"),
)


def _config_params(*sections: str) -> dict[str, Param]:
    return {
        key.rpartition(".")[2]: config_param(key, title, sec, PRESETS)
        for sec, key, title in CONFIG_FIELDS
        if sec in sections
    }


def training_params(continual: bool) -> dict[str, Param]:
    """The trigger form: each field titled, typed, bounded and described.  Empty (``null``) keeps the preset's
    value, and an empty list or object (chaos, gke, overrides) means off."""
    params = _run_params(continual) | _task_and_data_params()
    params["steps_per_run" if continual else "steps"] = _steps_param(continual)
    params |= _config_params("Training", "Checkpoints", "Validation")
    return params | _export_params() | _backend_params() | _chaos_and_overrides_params()


def _steps_param(continual: bool) -> Param:
    """Steps: the run's total, or (continual) how many each scheduled run adds."""
    return (
        Param(
            20,
            type="integer",
            minimum=1,
            maximum=1_000_000,
            title="Steps per run",
            section="Training",
            description="Optimizer steps each scheduled run adds to the newest validated checkpoint (1 to 1,000,000).",
        )
        if continual
        else config_param("optimizer.steps", "Steps", "Training", PRESETS)
    )


def _run_params(continual: bool) -> dict[str, Param]:
    """The Run section: the run's name, preset, priority and (triggered) where it resumes from."""
    params: dict[str, Param] = {
        "run_name": Param(
            "continual" if continual else "demo",
            type="string",
            title="Run name",
            section="Run",
            **RUN_NAME_RULES,
            **text(
                "The run's directory under the storage root: letters, digits and `_` `.` `-`, starting with a "
                "letter or a digit, at most 63 characters, no `..` and no `/`. An existing run of this name is "
                "continued."
            ),
        ),
        "preset": Param(
            "tiny",
            type="string",
            enum=PRESETS,
            title="Preset",
            section="Run",
            **text(
                "Model and run preset (`training/configs/<preset>.yml`): `tiny` and `small` run on CPU; the Llama "
                "presets are the published models (Llama 3.2 1B and 3B, Llama 3.1 8B and 70B, Llama 3 8B and 70B) "
                "for TPU slices (and show the memory-fit refusal locally). The fields left empty below take its "
                "values."
            ),
        ),
    }
    params["priority"] = Param(
        None,
        type=["null", "string"],
        enum=[None, *PRIORITY_LEVELS],
        title="Priority",
        section="Run",
        **text(
            "Empty: the run has its capacity to itself. A level (`"
            + "`, `".join(PRIORITY_LEVELS)
            + "`): the run joins its storage root's shared pool of hosts, whose scheduler gives hosts to "
            "higher levels first; the run may wait queued, shrink to its fewest hosts after a preemption notice "
            "(no step lost) and grow back (`rtrain queue` and the Training queue page show it). On GKE: the "
            "run's Kueue priority (the `gke` field then needs `kueue_queue`). It also orders this run's tasks "
            "before lower ones when Airflow's slots are short."
        ),
    )
    if not continual:
        params["resume_from"] = Param(
            "latest",
            type="string",
            title="Resume from",
            section="Run",
            examples=["latest", "none"],
            pattern=r"^(latest|none|[0-9]+)$",
            **text(
                "`latest`, `none` or a step number. `latest`: continue the run from its newest committed checkpoint "
                "(a new run starts from scratch); `none`: a new run only (an existing one is refused); a step: roll "
                "the run back to that committed step and continue from it."
            ),
        )
    return params


def _optional(kind: str, title: str, section: str, help_text: str, **schema: Any) -> Param:
    """A field that may be left empty: None, else a value of JSON type ``kind`` (a free string is never empty)."""
    if kind == "string" and "enum" not in schema:
        schema.setdefault("minLength", 1)
    return Param(None, type=["null", kind], title=title, section=section, **schema, **text(help_text))


def _task_and_data_params() -> dict[str, Param]:
    """The Task and Data sections: what is trained, on what."""
    return {
        "task": _optional(
            "string",
            "Task",
            "Task",
            "What is trained: `lm` (the built-in Llama 3 on the prepared dataset), `maxtext` (a MaxText model "
            "on it) or your own code as "
            "`package.module:factory` or `path/to/file.py:factory` (a path relative to the project), e.g. "
            "`examples/regression/task.py:make_task`. A task that cannot be loaded fails the run before it "
            f"trains. {when_empty('task', PRESETS)}",
        ),
        "task_args": _optional(
            "object",
            "Task arguments",
            "Task",
            "The task's own arguments, as a JSON object that the task checks, e.g. "
            '`{"hidden": 64, "seed": 1}`; for `maxtext`, `{"model_name": "llama3-8b", "overrides": {...}}`. '
            "Empty: none (the built-in `lm` takes none).",
        ),
        "init_from": _optional(
            "string",
            "Start from (Hugging Face Llama)",
            "Task",
            "A Hugging Face Llama checkpoint the built-in `lm` task starts from: a directory (local, relative to "
            "the project, or `gs://`) of `config.json` and `*.safetensors`. Its config sets the model's shapes "
            "and its `tokenizer.json` the dataset's tokenizer. A run that resumes from its own checkpoint "
            "ignores it. On GKE it must be `gs://` (the pods cannot read a path on the Airflow worker). Empty: a random init.",
        ),
        "dataset_source": Param(
            "stdlib",
            type="string",
            minLength=1,
            title="Dataset source",
            section="Data",
            examples=["stdlib"],
            **text(
                "What to train on: `stdlib` (this Python's standard library sources), a local directory or glob, or "
                "`gs://bucket/prefix`."
            ),
        ),
        "dataset": _optional(
            "string",
            "Prepared dataset",
            "Data",
            "Where the prepared dataset lives (a local path or `gs://`); prepared if missing. Empty: "
            "`var/data/stdlib-seq<seq_len>` (one per sequence length).",
        ),
        "dataset_max_bytes": _optional(
            "integer",
            "Source bytes at most",
            "Data",
            "Read at most this many bytes of the source (10,000 or more). Empty: all of it.",
            minimum=10_000,
        ),
    }


def _export_params() -> dict[str, Param]:
    """The export after promotion: a format and a directory (both empty: no export)."""
    return {
        "export_format": _optional(
            "string",
            "Export format",
            "Checkpoints",
            "After promotion, write the newest validated checkpoint to `export_dir`: `hf` (a Hugging Face "
            "directory: config.json, safetensors, tokenizer.json) or `orbax` (the parameter tree alone, as "
            "plain Orbax). Empty: no export.",
            enum=[None, "hf", "orbax"],
        ),
        "export_dir": _optional(
            "string",
            "Export directory",
            "Checkpoints",
            "A new or empty directory for the export (local, relative to the project, or gs://). Empty: no export.",
        ),
    }


def _backend_params() -> dict[str, Param]:
    """The Storage and Backend sections: where the run lives and where its workers run."""
    return {
        "storage_root": Param(
            "var/runs",
            type="string",
            minLength=1,
            title="Storage root",
            section="Storage",
            **text("Run root: a local path (relative to the project) or `gs://bucket/prefix`."),
        ),
        "backend": Param(
            "local",
            type="string",
            enum=list(backend_names()),  # the engine's and those installed beside it
            values_display={
                **{name: name for name in backend_names()},
                "local": "local: simulated hosts on this machine",
                "gke": "gke: TPU node pools on GKE",
            },
            title="Backend",
            section="Backend",
            **text(
                "Where the workers run: `local` (simulated hosts on this machine), `gke` (TPU node pools; fill in "
                "the GKE field), or a backend installed beside the engine."
            ),
        ),
        "gke": Param(
            None,
            type=["null", "object"],
            title="GKE cluster and slices",
            section="Backend",
            **text(
                "`backend: gke` only (empty otherwise): a JSON object with `project_id`, `location`, `cluster_name`, "
                "`machine_type`, `tpu_topology`, `image`, `node_pools` (one per slice), and optionally `namespace`, "
                "`spot`, `node_locations`, `node_service_account`, `gcp_conn_id`, `kueue_queue` (a Kueue LocalQueue: "
                "admits the JobSet by the run's priority), `provision_timeout_s` (how long `provision_capacity` "
                "waits for enough node pools for `min_workers`; 3600), `admission_timeout_s` (how long the JobSet may "
                "wait for Kueue's admission while its pools are up: then it fails, not retried, and the pools are "
                "released; 1800, none with `queued_provisioning`), `flex_start` (flex-start VMs: pools created empty, "
                "each slice made when the job's pods ask for it), `queued_provisioning` (with `flex_start` and `kueue_queue`: the "
                "whole JobSet's slices come at once, for a ProvisioningRequest), `gcs_fuse` (the pods read the dataset's bucket through GCS FUSE "
                "instead of downloading it)."
            ),
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
                "node_locations": {"type": "array", "items": {"type": "string"}},
                "gcp_conn_id": {"type": "string"},
                "kueue_queue": {"type": "string"},
                "node_service_account": {"type": "string"},
                "provision_timeout_s": {"type": "number", "exclusiveMinimum": 0},
                "admission_timeout_s": {"type": "number", "exclusiveMinimum": 0},
                "flex_start": {"type": "boolean"},
                "queued_provisioning": {"type": "boolean"},
                "gcs_fuse": {"type": "boolean"},
            },
        ),
    }


def _chaos_and_overrides_params() -> dict[str, Param]:
    """The Chaos and Config overrides sections."""
    return {
        "chaos": _optional(
            "array",
            "Fault injection",
            "Chaos",
            "One fault per line (empty: off), `action:key=value,...`, e.g. "
            + ", ".join(f"`{x}`" for x in CHAOS_EXAMPLES)
            + ".",
            items=CHAOS_RULES,
        ),
        "overrides": _optional(
            "object",
            "Other config keys",
            "Config overrides",
            'Any other run-config key (`rtrain config` lists them), as a JSON object, e.g. `{"learning_rate": '
            "0.001}`; empty: none. Unknown keys, and keys that have a field of their own above, are refused.",
        ),
    }


def pipeline(continual: bool) -> None:
    """The tasks of one DAG (called inside its ``with DAG(...)``).

    Every task reads the run spec from ``resolve_config``'s XCom when it runs (``spec_from``), so the graph
    draws the pipeline's order and nothing else; the only data edges are launch -> watch (the job handle)
    and validate -> promote_or_rollback (the verdict), both on that order anyway.
    """
    resolve = RTrainResolveRunConfigOperator(task_id=RESOLVE_TASK_ID, continual=continual, retries=0)
    prepare = RTrainPrepareDatasetOperator(task_id="prepare_dataset", spec_from=RESOLVE_TASK_ID)
    provision = RTrainProvisionCapacityOperator(task_id="provision_capacity", spec_from=RESOLVE_TASK_ID)

    # The body.  Retries relaunch the job from its newest committed checkpoint (see RTrainTrainingJobSensor).
    with TaskGroup(
        "training",
        tooltip="plan, launch or re-attach, watch (retries relaunch)",
        default_args={"retries": TRAINING_RETRIES, "retry_delay": RETRY_DELAY},  # type: ignore[arg-type]
    ) as training:
        plan = RTrainPlanTopologyOperator(task_id="plan_topology", spec_from=RESOLVE_TASK_ID)
        launch = RTrainStartTrainingJobOperator(task_id="launch_job", spec_from=RESOLVE_TASK_ID)
        watch = RTrainTrainingJobSensor(task_id="watch_job", spec_from=RESOLVE_TASK_ID, handle=launch.output)
        plan >> launch >> watch

    validate = RTrainValidateCheckpointsOperator(task_id="validate", spec_from=RESOLVE_TASK_ID)
    branch = RTrainBranchValidationOperator(
        task_id="promote_or_rollback",
        validation=validate.output,
        promote_task_id="promote",
        rollback_task_id="rollback_and_resume",
    )
    promote = RTrainPromoteCheckpointOperator(task_id="promote", spec_from=RESOLVE_TASK_ID)
    rollback = RTrainRollbackAndResumeOperator(
        task_id="rollback_and_resume",
        spec_from=RESOLVE_TASK_ID,
        retries=TRAINING_RETRIES,
        on_execute_callback=rollback_alert(),
    )
    prune = RTrainPruneCheckpointsOperator(task_id="prune", spec_from=RESOLVE_TASK_ID)
    export = RTrainExportCheckpointOperator(
        task_id="export",
        spec_from=RESOLVE_TASK_ID,
        export_format="{{ params.export_format or '' }}",
        export_dir="{{ params.export_dir or '' }}",
    )

    # The teardown: always, whatever failed (ALL_DONE), and not deciding the run's state.
    report = RTrainReportRunOperator(task_id="report", spec_from=RESOLVE_TASK_ID).as_teardown(setups=provision)
    release = RTrainReleaseCapacityOperator(
        task_id="release_capacity",
        spec_from=RESOLVE_TASK_ID,
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
    [promote, rollback] >> export >> report  # optional: skipped unless export_format and export_dir are set


DEFAULT_ARGS = {"owner": "rtrain", "retries": 1, "retry_delay": RETRY_DELAY, **alert_callbacks()}

with DAG(
    dag_id="resilient_training",
    description="Elastic JAX training from data to pruned checkpoints; survives lost hosts",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=MAX_ACTIVE_RUNS,
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
