"""Operators of the training pipeline: thin, each one verb of the engine (``RTrainHook``).

They are defined in the DAG's order; the job's watch, whose retries relaunch it, is the sensor of
``rtrain_airflow.sensors.training``.  Each operator checks its inputs in ``__init__`` (when the DAG
is parsed) where the values are plain, and in ``execute`` once templates and XComs are resolved.
Nothing here imports JAX: the engine imports it inside ``execute()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from airflow.sdk import BaseBranchOperator, BaseOperator, TriggerRule
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from rtrain_airflow.hooks.training import (
    RTrainConfigError,
    RTrainHook,
    format_validations,
    from_latest,
    job_spec,
    plan_text,
    readable,
)
from rtrain_airflow.triggers.training import PROGRESS_EVERY_S, RTrainTrainingJobTrigger, WatchEnd, check_watch_settings
from training.api import Config, DatasetSpec, RunSpec
from training.backends import Backend, BackendError, JobSpec
from training.service import commands

if TYPE_CHECKING:
    from airflow.sdk import Context

    from training.api import Config, PlanReport, RunReport
    from training.gke import GKESettings

RESOLVE_TASK_ID = "resolve_config"


def _is_deferred_value(value: Any) -> bool:
    """An XComArg or a Jinja template: only checkable once resolved."""
    from airflow.sdk.definitions.xcom_arg import XComArg

    return isinstance(value, XComArg) or (isinstance(value, str) and "{{" in value)


def check_spec(spec: Any, who: str) -> RunSpec:
    """A resolved run spec (what RTrainResolveRunConfigOperator returned), or an error naming the problem."""
    if not isinstance(spec, Mapping):
        raise AirflowFailException(
            f"{who}: spec must be the mapping {RESOLVE_TASK_ID} returns, got {type(spec).__name__}"
        )
    missing = [k for k in ("config", "run_uri", "backend") if k not in spec]
    if missing:
        raise AirflowFailException(f"{who}: spec lacks {', '.join(missing)}")
    return cast(RunSpec, dict(spec))


class _RTrainBaseOperator(BaseOperator):
    """What the pipeline's operators share: the run spec, the hook, the backend.

    :param spec: the run spec (what the resolve task returned; an XComArg makes a data edge), or
    :param spec_from: the id of the task whose XCom it is, pulled when the task runs (no edge: the
        DAG draws only the pipeline's own order).
    """

    template_fields: Sequence[str] = ("spec",)
    ui_color = "#e8f1fb"

    def __init__(self, *, spec: Any = None, spec_from: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if spec is None and spec_from is None:
            raise ValueError(
                f"{type(self).__name__}: give spec (the output of {RESOLVE_TASK_ID}) or spec_from (its task id)"
            )
        if spec is not None and not _is_deferred_value(spec):
            check_spec(spec, type(self).__name__)
        self.spec = spec
        self.spec_from = spec_from

    @cached_property
    def hook(self) -> RTrainHook:
        return RTrainHook()

    def resolved_spec(self, context: Context) -> RunSpec | None:
        """The run spec; None when ``spec_from`` left none (a teardown after a refused conf)."""
        if self.spec is not None:
            return check_spec(self.spec, self.task_id)
        value = context["ti"].xcom_pull(task_ids=self.spec_from)
        return None if value is None else check_spec(value, self.task_id)

    def required_spec(self, context: Context) -> RunSpec:
        spec = self.resolved_spec(context)
        if spec is None:
            raise AirflowException(f"{self.task_id}: {self.spec_from} left no run spec (did it run?)")
        return spec

    def run_config(self, spec: Mapping[str, Any]) -> Config:
        return self.hook.config_from_dict(spec["config"])

    def backend(self, spec: Mapping[str, Any]) -> Backend:
        """The backend the run spec names (local slice, shared pool, GKE), made by the hook."""
        return self.hook.backend_for(spec)

    def job(self, spec: Mapping[str, Any], cfg: Config | None = None) -> JobSpec:
        """The job the run spec describes; ``cfg``: another config of the run (a relaunch from the latest step)."""
        return job_spec(spec, cfg or self.run_config(spec))


class RTrainResolveRunConfigOperator(BaseOperator):
    """Turn the DAG run's params into the validated run config; refuse bad conf before anything runs.

    The Params' JSON schemas already refused wrong types and ranges when the run was
    triggered; this adds what a schema cannot say: cross-field rules (``min_workers <=
    max_workers``, divisibility, chaos grammar), unknown ``overrides`` keys, and what the
    backend's preparation decides and refuses (``training.backends.preparation``: on GKE the
    TPU type's keys, the pods' grace, a cluster the settings do not name).  Failures are
    ``AirflowFailException``: no retry can fix a config.

    :param continual: continual training: train ``steps_per_run`` more steps from the
        newest validated checkpoint of the run (``resume_from`` is set to it).

    Returns the run *spec*: ``config`` (the resolved Config as JSON), ``run_uri``,
    ``run_name``, ``backend``, ``dataset`` (``source``, ``max_bytes``), ``gke`` (the backend's
    settings: the conf's key of its name), ``priority`` (None: the run has its capacity to itself;
    a level: it is submitted to its storage root's shared pool, whose scheduler places it by
    priority; on GKE, its Kueue priority).

    With ``backend: gke`` and no ``gke.image`` in the conf, ``gke.image`` is the
    environment variable ``RTRAIN_TRAIN_IMAGE`` of the Airflow process when it is
    set (docker/compose.yaml names the training image there, once).
    """

    template_fields: Sequence[str] = ()

    def __init__(self, *, continual: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.continual = continual

    @cached_property
    def hook(self) -> RTrainHook:
        return RTrainHook()

    def execute(self, context: Context) -> RunSpec:
        params = dict(context["params"])
        try:
            overrides = self.hook.overrides_from_params(params)
            if self.continual:
                overrides.update(self._continue_from(overrides, params))
                # Refreshed data: the model trains on, the data position restarts on the new dataset.
                overrides.setdefault("data.on_dataset_change", "restart")
            name = str(overrides.get("placement.backend") or "local")
            prep = self.hook.preparation(name)  # the placement's keys and checks, before any capacity bills
            settings, given = prep.settings(params.get(name)), set(overrides)
            for key, value in prep.config_keys(settings).items():
                overrides.setdefault(key, value)
            cfg = self.hook.build_config(overrides)
            priority = params.get("priority") or None
            if priority is not None:
                try:
                    commands.priority_value(priority)
                except commands.PriorityError as e:
                    raise RTrainConfigError(f"priority: {e}") from None
            self.hook.backend(name, cast("GKESettings", settings), priority)  # a backend refuses its settings
            cfg = prep.fit(cfg, settings, priority, given)
            if cfg.task != "lm":  # it must import and build here (a token dataset is prepared next)
                self.hook.check_task(cfg, data=not cfg.prepared_tokens)
            # remat auto is chosen here, before any capacity is provisioned: a model no policy fits is refused now
            cfg = self.hook.resolve_remat(cfg)
        except BackendError as e:  # RTrainConfigError too
            raise AirflowFailException(f"invalid conf: {e}") from None
        spec = RunSpec(
            config=cfg.model_dump(mode="json"),
            run_uri=cfg.run_uri,
            run_name=cfg.run_name,
            backend=cfg.placement.backend,
            dataset=DatasetSpec(
                source=params.get("dataset_source") or "stdlib",
                max_bytes=params.get("dataset_max_bytes"),
                uri=cfg.data.dataset,
                refresh=self.continual,
            ),
            gke=cast("GKESettings", settings),
            priority=priority,
        )
        self.log.info(
            "Run %s at %s: preset %s, %s steps, %s..%s workers, backend %s%s, resume_from %s, chaos %s",
            cfg.run_name,
            cfg.run_uri,
            cfg.preset,
            cfg.optimizer.steps,
            cfg.elastic.min_workers,
            cfg.elastic.max_workers,
            cfg.placement.backend,
            f" at priority {priority}" if priority else "",
            cfg.checkpoint.resume_from,
            cfg.elastic.chaos or "off",
        )
        return spec

    def _continue_from(self, overrides: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        """steps and resume_from for one more stretch of continual training."""
        probe = self.hook.build_config({**overrides, "checkpoint.resume_from": "latest"})
        per_run = int(params.get("steps_per_run") or 0)
        if per_run < 1:
            raise RTrainConfigError(f"steps_per_run: at least 1, got {params.get('steps_per_run')!r}")
        base = None
        if self.hook.run_exists(probe.run_uri):
            base = self.hook.newest_validated(probe.run_uri)
        self.log.info(
            "Continual training of %s: newest validated checkpoint %s, %d more steps", probe.run_name, base, per_run
        )
        return {
            "optimizer.steps": (base or 0) + per_run,
            "checkpoint.resume_from": str(base) if base is not None else "latest",
        }


class RTrainPrepareDatasetOperator(_RTrainBaseOperator):
    """Prepare the run's dataset (``training.data.prepare``): idempotent, a same-fingerprint dataset is kept.

    Returns ``dataset``, ``fingerprint``, ``train_records``, ``validation_records``, ``seq_len``.
    """

    def execute(self, context: Context) -> dict[str, Any]:
        spec = self.required_spec(context)
        cfg = self.run_config(spec)
        if not cfg.prepared_tokens:
            self.log.info("Task %s brings its own data: nothing to prepare", cfg.task)
            return {"dataset": None, "task": cfg.task}
        data: Mapping[str, Any] = spec.get("dataset") or {}  # an older spec may lack uri and refresh
        max_bytes = data.get("max_bytes")
        if max_bytes is not None and int(max_bytes) < 1:
            raise AirflowFailException(f"dataset_max_bytes: positive or null, got {max_bytes!r}")
        from training.api import DatasetError

        try:
            return dict(
                self.hook.prepare_dataset(
                    data.get("source"),
                    cfg.data.dataset,
                    cfg.model.seq_len,
                    None if max_bytes is None else int(max_bytes),
                    progress=lambda line: self.log.info("[prepare] %s", line),
                    refresh=bool(data.get("refresh")),
                    tokenizer=cfg.data.tokenizer,
                    vocab_size=cfg.model.vocab_size,
                )
            )
        except DatasetError as e:  # a different dataset at the output, a bad source: a retry cannot help
            raise AirflowFailException(str(e)) from None


class RTrainProvisionCapacityOperator(_RTrainBaseOperator):
    """Setup: capacity for the job (the local slice's hosts, or TPU node pools on GKE)."""

    def execute(self, context: Context) -> dict[str, Any]:
        spec = self.required_spec(context)
        try:
            result = self.backend(spec).provision(self.job(spec))
        except BackendError as e:  # a run that can never fit: no retry helps
            raise AirflowFailException(str(e)) from None
        self.log.info("Provisioned: %s", readable(result))
        return dict(result)


class RTrainPlanTopologyOperator(_RTrainBaseOperator):
    """Mesh plans for every worker count in ``min..max_workers``, and the memory-fit check.

    A model that does not fit at the minimum topology is refused here, before any
    worker starts; ``AirflowFailException`` (the plan is arithmetic: a retry cannot help).
    """

    def execute(self, context: Context) -> PlanReport:
        from training.api import PlanError

        spec = self.required_spec(context)
        try:
            report = self.hook.plan(self.run_config(spec))
        except PlanError as e:
            raise AirflowFailException(f"plan refused: {e}") from None
        self.log.info("Plan: %s", plan_text(report))
        return report


class RTrainStartTrainingJobOperator(_RTrainBaseOperator):
    """Launch the training job, or re-attach to the live one.  Never starts over, never overwrites.

    ``resume_from`` (of the run config) is honoured on this DAG run's *first* launch:

    * ``latest``: the run's newest committed checkpoint (scratch for a new run);
    * ``none``: a new run; an existing run of that name is refused;
    * a step: the run is rolled back to that committed step first (newer ones are
      quarantined, not deleted), and trains on from it.

    What the first launch did is marked in the run root (``airflow/<dag run id>.json``),
    so a retry or a cleared task relaunches from the newest committed checkpoint
    instead of redoing it (no second rollback, no refusing its own run).

    Returns the job *handle*: ``backend``, ``run_uri``, ``attached``, ``agent_pid`` /
    ``jobset``, ``launched_at``.
    """

    def execute(self, context: Context) -> dict[str, Any]:
        spec = self.required_spec(context)
        cfg = self.run_config(spec)
        run_uri, run_id = cfg.run_uri, context["run_id"]
        mark = self.hook.dag_run_mark(run_uri, run_id)
        exists = self.hook.run_exists(run_uri)
        resume = cfg.checkpoint.resume_from
        if mark is None:
            if exists and resume == "none":
                raise AirflowFailException(
                    f"run {cfg.run_name!r} exists at {run_uri} and resume_from=none; pick another run_name, "
                    "or trigger with resume_from=latest (or a step) to continue it"
                )
            if resume.isdigit():
                self._rewind(cfg, int(resume), run_id, exists)
            self.hook.set_dag_run_mark(run_uri, run_id, resume_from=resume, existed=exists)
        else:
            self.log.info(
                "This DAG run launched %s before (%s): relaunching from the newest committed checkpoint",
                cfg.run_name,
                mark,
            )
        launch_cfg = cfg if (mark is None and resume == "none") else from_latest(cfg)
        try:
            handle = self.backend(spec).launch(self.job(spec, launch_cfg), attempt=context["ti"].try_number)
        except Exception as e:
            from training.api import LaunchError, PlanError, TaskError
            from training.gke import GKEConfigError

            if isinstance(
                e, LaunchError | PlanError | TaskError | GKEConfigError | commands.QueueError | commands.PriorityError
            ):
                raise AirflowFailException(str(e)) from None
            raise
        verb = "Re-attached to" if handle.get("attached") else "Launched"
        where = (
            f"JobSet {handle.get('namespace')}/{handle.get('jobset')}"
            if handle.get("jobset")
            else f"local slice pid {handle.get('controller_pid')} on {handle.get('host')}"
        )
        self.log.info("%s job %s of %s (%s)", verb, handle.get("job"), cfg.run_name, where)
        return dict(handle)

    def _rewind(self, cfg: Config, step: int, run_id: str, exists: bool) -> None:
        if not exists:
            raise AirflowFailException(f"resume_from={step}: run {cfg.run_name!r} does not exist yet (use latest)")
        committed = self.hook.committed_steps(cfg.run_uri)
        if step not in committed:
            raise AirflowFailException(
                f"resume_from={step}: not a committed checkpoint of {cfg.run_name} (committed: {committed})"
            )
        if committed[-1] > step:
            rb = self.hook.rollback(cfg.run_uri, to=step, reason=f"rerun from step {step} (dag run {run_id})")
            self.log.info("Rolled back to step %s for this rerun: %s", step, rb)


class RTrainValidateCheckpointsOperator(_RTrainBaseOperator):
    """Validate every committed checkpoint that has no verdict yet (oldest first), on the held-out split.

    Thresholds come from the run config (``val_tolerance``, ``val_max_loss``,
    ``val_min_accuracy``).  Returns ``verdict`` and ``step`` of the newest committed
    checkpoint, ``reason``, ``newest_validated`` and every verdict of this call.
    """

    def execute(self, context: Context) -> dict[str, Any]:
        spec = self.required_spec(context)
        return validation_summary(self.hook, spec["run_uri"], self.log)


def validation_summary(hook: RTrainHook, run_uri: str, log: Any) -> dict[str, Any]:
    results = hook.validate_pending(run_uri)
    log.info("[rtrain] validation:\n%s", format_validations(results))
    committed = hook.committed_steps(run_uri)
    if not committed:
        raise AirflowException(f"run {run_uri} has no committed checkpoint to validate")
    newest = hook.checkpoint_state(run_uri, committed[-1])
    passed = newest is not None and newest["state"] in ("validated", "promoted")
    return {
        "step": committed[-1],
        "verdict": "validated" if passed else "rejected",
        "reason": newest.get("reason", "") if newest is not None else "",
        "metrics": newest.get("metrics") if newest is not None else None,
        "newest_validated": hook.newest_validated(run_uri),
        "results": results,
    }


class RTrainBranchValidationOperator(BaseBranchOperator):
    """Follow ``promote_task_id`` when the newest checkpoint is validated, else ``rollback_task_id``.

    :param validation: what RTrainValidateCheckpointsOperator returned (an XComArg).
    """

    template_fields: Sequence[str] = ("validation",)

    def __init__(self, *, validation: Any, promote_task_id: str, rollback_task_id: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not promote_task_id or not rollback_task_id or promote_task_id == rollback_task_id:
            raise ValueError("promote_task_id/rollback_task_id: two different task ids")
        self.validation = validation
        self.promote_task_id = promote_task_id
        self.rollback_task_id = rollback_task_id

    def choose_branch(self, context: Context) -> str:
        v = self.validation
        if not isinstance(v, Mapping) or v.get("verdict") not in ("validated", "rejected"):
            raise AirflowFailException(f"validation: expected a verdict of validated/rejected, got {v!r}")
        if v["verdict"] == "validated":
            return self.promote_task_id
        self.log.warning("Checkpoint %s rejected (%s): rolling back", v.get("step"), v.get("reason"))
        return self.rollback_task_id


class RTrainPromoteCheckpointOperator(_RTrainBaseOperator):
    """Promote the newest validated checkpoint (the ledger's ``promoted`` state)."""

    def execute(self, context: Context) -> dict[str, Any]:
        spec = self.required_spec(context)
        result = self.hook.promote(spec["run_uri"])
        self.log.info("Promoted checkpoint %s", result["step"])
        return dict(result)


class RTrainRollbackAndResumeOperator(_RTrainBaseOperator):
    """Roll back to the newest validated checkpoint, train on from it, validate again; at most ``max_rollbacks`` times.

    Each round: ``rollback`` (the resume pointer goes back, newer checkpoints are
    quarantined, the data window since is skipped as the run config says), launch
    from the pointer, defer to the watching trigger, validate what the resumed job
    committed.  Validated: promote and succeed.  Rejected again: next round, or,
    past ``max_rollbacks`` (the run config's), fail with the pointer on a validated
    checkpoint: the run is safe for a parameterised rerun.

    A retry of this task does not roll back twice: it looks at the ledger first
    (a rejected newest checkpoint is rolled back; otherwise it relaunches from the
    newest committed one and goes on validating).
    """

    def __init__(
        self,
        *,
        poll_interval: float = 5.0,
        start_timeout_s: float = 300.0,
        progress_every_s: float = PROGRESS_EVERY_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_watch_settings(poll_interval, start_timeout_s, progress_every_s)
        self.poll_interval = poll_interval
        self.start_timeout_s = start_timeout_s
        self.progress_every_s = progress_every_s

    def execute(self, context: Context) -> dict[str, Any]:
        spec = self.required_spec(context)
        return self._round(context, spec)

    def _rollbacks(self, context: Context, run_uri: str) -> list[dict[str, Any]]:
        """This DAG run's validation rollbacks so far, from the run's events (earlier tries count too)."""
        return [
            {"from_step": e["from_step"], "to_step": e["to_step"], "quarantined": e.get("quarantined", [])}
            for e in self.hook.events(run_uri, ("rollback",))
            if e.get("kind") == "validation" and f"(dag run {context['run_id']})" in str(e.get("reason"))
        ]

    def _round(self, context: Context, spec: RunSpec) -> dict[str, Any]:
        cfg = self.run_config(spec)
        run_uri = spec["run_uri"]
        rounds = self._rollbacks(context, run_uri)
        summary = validation_summary(self.hook, run_uri, self.log)
        if summary["verdict"] == "validated":
            promoted = self.hook.promote(run_uri)
            self.log.info("Step %s validated after %d rollback(s): promoted", summary["step"], len(rounds))
            return {"rollbacks": rounds, "promoted": promoted, "validation": summary}
        if len(rounds) >= cfg.checkpoint.max_rollbacks:
            if summary["newest_validated"] is not None and summary["step"] != summary["newest_validated"]:
                self.hook.rollback(
                    run_uri, reason=f"rollback budget spent (max_rollbacks={cfg.checkpoint.max_rollbacks})"
                )
            raise AirflowFailException(
                f"step {summary['step']} rejected ({summary['reason']}) after {len(rounds)} rollback(s) "
                f"(max_rollbacks={cfg.checkpoint.max_rollbacks}); the resume pointer is on validated step "
                f"{summary['newest_validated']}: rerun with resume_from and other overrides"
            )
        if summary["newest_validated"] is None:
            raise AirflowFailException(
                f"step {summary['step']} rejected ({summary['reason']}) and no checkpoint of "
                f"{cfg.run_name} was ever validated: nothing to roll back to"
            )
        backend = self.backend(spec)  # checks the backend before touching the ledger
        rb = self.hook.rollback(
            run_uri,
            reason=f"validation rejected step {summary['step']}: {summary['reason']} (dag run {context['run_id']})",
        )
        self.log.warning(
            "[rtrain] rollback %d/%d: step %s -> %s (quarantined %s)",
            len(rounds) + 1,
            cfg.checkpoint.max_rollbacks,
            rb["from_step"],
            rb["to_step"],
            rb["quarantined"],
        )
        rounds = [*rounds, dict(rb)]
        handle = self.hook.relaunch(backend, spec, cfg, attempt=context["ti"].try_number + 100 * len(rounds))
        context["ti"].xcom_push(key="handle", value=handle)  # for the teardown
        self.defer(trigger=RTrainTrainingJobTrigger.for_task(self, cfg, handle), method_name="resume_complete")
        raise AssertionError("defer() returns only by raising")  # pragma: no cover

    def resume_complete(self, context: Context, event: WatchEnd) -> dict[str, Any]:
        if event.get("status") == "stopped":  # a person stopped the resumed job: not a failure (see the sensor)
            raise AirflowSkipException(f"the resumed job was {event.get('state')}: {event.get('message')} (resumable)")
        if event.get("status") != "success":
            raise AirflowException(f"the resumed job failed: {event.get('message')}")
        spec = self.required_spec(context)
        self.log.info("Resumed job finished at step %s", event.get("step"))
        return self._round(context, spec)


class RTrainExportCheckpointOperator(_RTrainBaseOperator):
    """Export the newest validated checkpoint as a Hugging Face directory (``hf``) or a plain Orbax one (``orbax``).

    Skipped when ``export_format`` or ``export_dir`` is empty (templated: the DAG passes its params).
    """

    template_fields: Sequence[str] = ("spec", "export_format", "export_dir")

    def __init__(self, *, export_format: str = "", export_dir: str = "", **kwargs: Any) -> None:
        kwargs.setdefault("trigger_rule", TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS)
        super().__init__(**kwargs)
        if not _is_deferred_value(export_format) and export_format not in ("", "hf", "orbax", "None"):
            raise ValueError(f"{type(self).__name__}: export_format is hf, orbax or empty, not {export_format!r}")
        self.export_format = export_format
        self.export_dir = export_dir

    def execute(self, context: Context) -> dict[str, Any]:
        fmt, out = (str(v or "").strip() for v in (self.export_format, self.export_dir))
        if fmt in ("", "None") or out in ("", "None"):
            raise AirflowSkipException("no export asked (export_format and export_dir are empty)")
        spec = self.required_spec(context)
        try:
            result = self.hook.export(spec["run_uri"], out, fmt)
        except (RTrainConfigError, ValueError) as e:
            raise AirflowFailException(f"export: {e}") from None
        self.log.info("Exported step %s as %s to %s", result["step"], fmt, result["output"])
        return result


class RTrainPruneCheckpointsOperator(_RTrainBaseOperator):
    """Apply the run's retention policy (keep_last, keep_best, keep_every; quarantine TTL).

    The protected set (newest usable, newest validated, resume pointer, promoted,
    pinned) is kept whatever the policy says.  Returns what was kept and deleted.
    """

    def __init__(self, *, dry_run: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("trigger_rule", TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS)
        super().__init__(**kwargs)
        self.plan_only = dry_run  # (BaseOperator.dry_run is a method)

    def execute(self, context: Context) -> dict[str, Any]:
        spec = self.required_spec(context)
        result = self.hook.prune(spec["run_uri"], dry_run=self.plan_only)
        self.log.info(
            "Pruned %s: deleted %s, kept %s", spec["run_name"], result.get("deleted"), sorted(result.get("kept", {}))
        )
        return {
            "deleted": result.get("deleted", []),
            "kept": sorted(int(k) for k in result.get("kept", {})),
            "bytes_freed": result.get("bytes_freed"),
            "quarantine_expired": result.get("quarantine_expired", []),
        }


class RTrainReportRunOperator(_RTrainBaseOperator):
    """The run's story, from its events: steps, failures, recoveries with their times, meshes,
    validation verdicts, rollbacks, checkpoints kept and pruned, goodput.

    Wired as a teardown with ``ALL_DONE``: it reports failed runs too, and does not
    decide the DAG run's state.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("trigger_rule", TriggerRule.ALL_DONE)
        super().__init__(**kwargs)

    def as_teardown(self, *, setups: Any = None, on_failure_fail_dagrun: bool | None = None) -> RTrainReportRunOperator:
        super().as_teardown(setups=setups, on_failure_fail_dagrun=on_failure_fail_dagrun)
        self.trigger_rule = TriggerRule.ALL_DONE
        return self

    def execute(self, context: Context) -> RunReport | None:
        spec = self.resolved_spec(context)
        if spec is None or not self.hook.run_exists(spec["run_uri"]):
            self.log.info("No run to report on")
            return None
        report = self.hook.report(spec["run_uri"])
        self.log.info("Run report:\n%s", self.hook.format_report(report))
        return report


class RTrainReleaseCapacityOperator(_RTrainBaseOperator):
    """Teardown: stop a job that still runs and give its capacity back (local slice hosts, GKE JobSets and pools).

    ``trigger_rule`` is ``ALL_DONE`` and stays so under ``as_teardown()``: a provision
    that failed half way, or a sensor that gave up on a live job, still holds capacity.
    Only the jobs this DAG run launched are stopped (the handles in the XComs of
    ``handle_from``): a job of the same run name started elsewhere is left alone.
    """

    def __init__(self, *, handle_from: Sequence[str] = (), **kwargs: Any) -> None:
        kwargs.setdefault("trigger_rule", TriggerRule.ALL_DONE)
        super().__init__(**kwargs)
        self.handle_from = list(handle_from)

    def as_teardown(
        self, *, setups: Any = None, on_failure_fail_dagrun: bool | None = None
    ) -> RTrainReleaseCapacityOperator:
        super().as_teardown(setups=setups, on_failure_fail_dagrun=on_failure_fail_dagrun)
        self.trigger_rule = TriggerRule.ALL_DONE
        return self

    def execute(self, context: Context) -> dict[str, Any]:
        spec = self.resolved_spec(context)
        if spec is None:
            self.log.info("No run config (the run was refused before it started): nothing to release")
            return {"released": False}
        handles = []
        for task_id in self.handle_from:
            for key in ("return_value", "handle"):
                value = context["ti"].xcom_pull(task_ids=task_id, key=key)
                if isinstance(value, Mapping) and value.get("backend"):
                    handles.append(dict(value))
        result = self.backend(spec).release(self.job(spec), handles)
        self.log.info("Released: %s", readable(result))
        return dict(result)
