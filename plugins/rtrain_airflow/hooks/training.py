"""The hook of the training engine: the one place the Airflow side talks to ``training/``.

The hook owns the clients and the operators stay thin.  Here the "client" is
the engine's small API, ``training.api`` (plan, launch, job state, events, the
checkpoint lifecycle, run marks) and the service's verbs
(``training.service.commands``), plus a *backend*, chosen by the run spec:

* the local slice (the embedded default): N simulated hosts on this machine, one
  host agent each, kept running by the local slice process;
* the shared pool: the same, for a run with a priority: submitted to its storage
  root's shared pool, whose scheduler launches it and moves its hosts;
* GKE: TPU node pools and one JobSet per job, one host agent per pod; its cluster
  calls are the engine's, with the credentials of Airflow's Google connection
  (``rtrain_airflow.hooks.gke_tpu``, imported only when used).

The backends are the engine's (``training.backends``); all answer the same verbs
(``provision``, ``launch``, ``poll``, ``stop``, ``release``), so the DAG, the
operators and the watching trigger do not care where the workers run.  A job recovers from lost hosts by itself (its agents);
Airflow's retry is the second level, when the job as a whole is gone.

Import cost: ``training.api`` imports nothing heavy at module level; JAX, Orbax
and grain are imported by the engine inside the calls that need them
(validation, dataset preparation), which run inside ``execute()``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, cast

from airflow.sdk import BaseHook

from training import api, backends
from training.api import RUN_NAME_PATTERN, CheckpointRecord, Config, ConfigError, Event, mesh_text, readable
from training.backends import Backend, BackendError, JobSpec
from training.backends.base import JobHandle
from training.gke import GKESettings
from training.service import commands

# The repository root (plugins/rtrain_airflow/hooks/training.py -> parents[3]).  Relative
# local paths in a run config (``var/runs``) are taken from here, not from the
# current directory of whichever Airflow process runs a task.
PROJECT_ROOT = Path(os.environ.get("RTRAIN_PROJECT_ROOT") or Path(__file__).resolve().parents[3])

# DAG params that are not Config keys (the rest map 1:1, or by PARAM_TO_CONFIG).
PARAM_TO_CONFIG = {"storage_root": "root"}
NON_CONFIG_PARAMS = frozenset(
    {"dataset_source", "dataset_max_bytes", "overrides", "gke", "steps_per_run", "priority"}
    | {"export_format", "export_dir"}
)

# The param schemas of the DAGs: one run-name rule and one chaos grammar, the engine's.
CHAOS_PATTERN = api.spec_pattern()
CHAOS_EXAMPLES = (
    "preempt:worker=1,step=40",
    "capacity:to=4,step=80",
    "crash:worker=0,step=12",
    "lr_spike:step=30,factor=50",
)

# The same two rules as JSON-schema parts that each say in words what they allow: a refused value's
# error (Airflow prints the failing part of the schema) names the rule, not one opaque regular expression
# (short words: Airflow's message wraps longer ones).  Together they accept exactly what RUN_NAME_PATTERN
# and CHAOS_PATTERN accept (tested).
RUN_NAME_RULES: dict[str, Any] = {
    "minLength": 1,
    "maxLength": 63,
    "allOf": [
        {"description": "only letters, digits and _ . -", "pattern": "^[A-Za-z0-9_.-]*$"},
        {"description": "the first character is a letter or a digit", "pattern": "^[A-Za-z0-9]"},
        {"description": "no '..' anywhere", "not": {"pattern": "[.][.]"}},
    ],
}
CHAOS_RULES: dict[str, Any] = {
    "type": "string",
    "allOf": [
        {
            "description": "an action (one of these) and a colon",
            "pattern": "^(" + "|".join(sorted(api.CHAOS_ACTIONS)) + "):",
        },
        {
            "description": "then key=number pairs: worker=1,step=40",
            "pattern": "^[a-z_]+:[a-z_]+=[0-9.]+(,[a-z_]+=[0-9.]+)*$",
        },
    ],
}

PRIORITY_LEVELS = list(commands.PRIORITIES)  # the DAG's priority field: lowest first


def config_key(param: str) -> str:
    """The config key (``section.key``) a DAG param sets: its name in its section, or ``PARAM_TO_CONFIG``'s."""
    return api.dotted(PARAM_TO_CONFIG.get(param, param))


def backend_names() -> tuple[str, ...]:
    """The backends a run can name: the engine's (local, gke) first, then those installed beside it."""
    return backends.names()


class RTrainConfigError(BackendError):
    """A DAG run's params that do not make a runnable config (the message names the key)."""


@cache
def preset_config(preset: str) -> Config:
    """A preset's config as the engine builds it (its YAML over the defaults): YAML and pydantic, no JAX."""
    return api.load_config(preset, None, {}, base_dir=PROJECT_ROOT)


def preset_values(key: str, presets: Iterable[str]) -> dict[str, Any]:
    """What a config key is in each preset (the trigger form shows them next to a field left empty)."""
    return {p: preset_config(p).flat()[api.dotted(key)] for p in presets}


def format_validations(results: Sequence[Mapping[str, Any]]) -> str:
    """One aligned table of verdicts with rounded numbers (the columns of ``rtrain validate``)."""
    if not results:
        return "no checkpoint waits for a verdict"

    def num(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, int | float) else ("-" if v is None else str(v))

    lines = [f"{'step':>8}  {'verdict':<10} {'loss':>8} {'perplexity':>11} {'accuracy':>9}  reason"]
    for r in results:
        m = r.get("metrics") or {}
        lines.append(
            f"{r.get('step')!s:>8}  {r.get('verdict')!s:<10} {num(m.get('loss'), '.4f'):>8} "
            f"{num(m.get('perplexity'), '.2f'):>11} {num(m.get('accuracy'), '.3f'):>9}  {r.get('reason') or ''}".rstrip()
        )
    return "\n".join(lines)


def plan_text(report: Mapping[str, Any]) -> str:
    """The plan task's report in words: worker counts, meshes at both ends, memory per device."""
    lo, hi = report.get("min_plan") or {}, report.get("max_plan") or {}
    mem = report.get("memory_gib") or {}

    def size(gib: Any) -> str:
        if not isinstance(gib, int | float):
            return "-"
        return f"{gib:.3g} GiB" if gib >= 1 else f"{gib * 1024:.3g} MiB"

    parts = ", ".join(f"{k.removeprefix('bytes_')} {size(v)}" for k, v in mem.items() if k != "total")
    params = report.get("params")
    count = ""
    if isinstance(params, int | float):
        count = f"{params / 1e9:.3g}B parameters; " if params >= 1e9 else f"{params / 1e6:.3g}M parameters; "

    def at(plan: Mapping[str, Any]) -> str:
        n = plan.get("workers")
        return f"{n} worker{'' if n == 1 else 's'}: mesh {mesh_text(plan.get('shape'))} ({plan.get('devices')} devices)"

    remat = report.get("remat") or {}  # remat auto: the policy chosen, or when it will be
    return (
        f"feasible worker counts {readable(report.get('feasible_workers'))}; {at(lo)}, {at(hi)}; {count}"
        f"memory per device at the minimum {size(mem.get('total'))} ({parts})"
        + (f"; {remat['reason']}" if remat.get("reason") else "")
    )


def rounded(value: Any, digits: int = 4) -> Any:
    """Every float in a JSON-like value rounded (lists and mappings walked), for logs people read."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, Mapping):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def absolute(uri: str, root: Path = PROJECT_ROOT) -> str:
    """A local path made absolute against the project root; gs:// URIs unchanged."""
    return api.absolute(uri, root)


# --- the hook -------------------------------------------------------------------------------------


def job_spec(spec: Mapping[str, Any], cfg: Config) -> JobSpec:
    """The job of a run spec (what the resolve task returned) with the config ``cfg`` of its run."""
    return JobSpec.from_run_spec(spec, cfg)


def from_latest(cfg: Config) -> Config:
    """``cfg`` resuming from the run's newest committed checkpoint: how every relaunch resumes."""
    return cfg.model_copy(update={"checkpoint.resume_from": "latest"})


class RTrainHook(BaseHook):
    """The engine's API and the run's backend, for operators, sensors and triggers.

    No connection is needed for the local slice; the GKE backend uses the Google
    connection named in ``spec["gke"]["gcp_conn_id"]`` (default ``google_cloud_default``).
    """

    conn_name_attr = "rtrain_conn_id"
    hook_name = "Resilient training"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    # --- configs ---------------------------------------------------------------------------

    @staticmethod
    def overrides_from_params(params: Mapping[str, Any]) -> dict[str, Any]:
        """DAG params -> Config overrides, as ``section.key``.  ``None`` means "the preset's value" and is left out.

        Keys of ``params["overrides"]`` are Config keys too (checked by the config itself:
        an unknown key is an error that names it).
        """
        out: dict[str, Any] = {}
        for key, value in params.items():
            if key in NON_CONFIG_PARAMS or value is None:
                continue
            out[config_key(key)] = value
        extra = params.get("overrides") or {}
        if not isinstance(extra, Mapping):
            raise RTrainConfigError(f"overrides: a mapping of Config key -> value, got {type(extra).__name__}")
        named = {config_key(k) for k in params if k not in NON_CONFIG_PARAMS}
        clash = sorted(k for k in extra if api.dotted(k) in named)
        if clash:
            raise RTrainConfigError(f"overrides: {', '.join(clash)} are params of their own; set them there")
        api.note_flat_keys([k for k in extra if api.dotted(k) != k], "the DAG run's overrides")
        out.update({api.dotted(k): v for k, v in extra.items()})  # section.key, as the params
        return out

    def build_config(self, overrides: Mapping[str, Any]) -> Config:
        """The validated Config (``training.api.load_config``), local paths absolute against the project."""
        ov = dict(overrides)
        name = str(ov.get("run_name", ""))
        if name and not re.match(RUN_NAME_PATTERN, name):
            raise RTrainConfigError(f"run_name: {name!r}: letters, digits and _.- (no '..', no '/')")
        try:
            return api.load_config(str(ov.get("preset") or "tiny"), None, ov, base_dir=PROJECT_ROOT)
        except (ConfigError, ValueError) as e:
            raise RTrainConfigError(str(e)) from None

    @staticmethod
    def check_task(cfg: Config, data: bool = True) -> None:
        """Build the config's task and, unless ``data`` is False, open its data (imports JAX: from a task's execute)."""
        try:
            api.check_task(cfg, data)
        except api.TaskError as e:
            raise RTrainConfigError(str(e)) from None

    @staticmethod
    def config_from_dict(data: Mapping[str, Any]) -> Config:
        return api.config_from_dict(data)

    # --- planning and data -------------------------------------------------------------------

    def plan(self, cfg: Config) -> api.PlanReport:
        """Mesh plans and the memory-fit check; raises ``training.api.PlanError`` with the numbers."""
        return api.plan(cfg)

    def resolve_remat(self, cfg: Config) -> Config:
        """The config with ``remat: auto`` replaced by the policy the compiled steps choose, logged with why (the
        steps compile in a child process: seconds to minutes); RTrainConfigError when no policy fits."""
        try:
            return api.resolve_remat(cfg, self.log.info)
        except api.PlanError as e:
            raise RTrainConfigError(str(e)) from None

    def prepare_dataset(
        self,
        source: str | None,
        output: str,
        seq_len: int,
        max_bytes: int | None,
        progress: Callable[[str], None] | None = None,
        refresh: bool = False,
        tokenizer: str = "bytes",
        vocab_size: int | None = None,
    ) -> api.PreparedDataset:
        """Prepare (idempotently) the token dataset; imports numpy/array_record, so call it in execute().

        ``refresh``: a source whose content changed replaces the prepared dataset (continual training);
        otherwise a different dataset at ``output`` is refused.  ``tokenizer``: bytes, bpe (of
        ``vocab_size``) or a tokenizer file, as the run's config says.
        """
        src = None if source in (None, "", "stdlib") else absolute(source)
        return api.prepare_dataset(
            src,
            output,
            seq_len,
            max_bytes=max_bytes,
            progress=progress,
            refresh=refresh,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
        )

    # --- the job -------------------------------------------------------------------------------

    def backend(self, name: str, gke: GKESettings | None = None, priority: str | None = None) -> Backend:
        """The backend of a run: ``priority`` puts a local run in its root's shared pool (GKE: Kueue's)."""

        def provider_cluster(settings: GKESettings) -> backends.GKECluster:  # made only by a backend that calls GKE
            from rtrain_airflow.hooks.gke_tpu import ProviderCluster

            return ProviderCluster(settings, self.log)

        return backends.backend(name, gke=gke, priority=priority, log=self.log, make_cluster=provider_cluster)

    @staticmethod
    def preparation(name: str) -> backends.Preparation:
        """How the backend called ``name`` readies a run's config before capacity is provisioned."""
        return backends.preparation(name)

    def backend_for(self, spec: Mapping[str, Any]) -> Backend:
        """The backend a run spec names (its ``backend``, ``gke`` and ``priority``)."""
        return self.backend(spec["backend"], spec.get("gke"), spec.get("priority"))

    def relaunch(self, backend: Backend, spec: Mapping[str, Any], cfg: Config, attempt: int) -> JobHandle:
        """Launch the run's job again, from its newest committed checkpoint: a watch's retry, a rerun of a DAG run
        that launched before, the resume after a rollback.  Idempotent: a job still alive is re-attached."""
        return backend.launch(job_spec(spec, from_latest(cfg)), attempt=attempt)

    def status(self, run_uri: str) -> api.RunStatus | None:
        return api.status(run_uri)

    def events(self, run_uri: str, types: tuple[str, ...] | None = None, after: str | None = None) -> list[Event]:
        return api.events(run_uri, types, after)

    def events_since(
        self, run_uri: str, cursor: str | None, seen: Collection[str], start: str | None = None
    ) -> list[Event]:
        return api.events_since(run_uri, cursor, seen, start)

    def newest_event_key(self, run_uri: str) -> str | None:
        return api.newest_event_key(run_uri)

    def run_exists(self, run_uri: str) -> bool:
        return api.run_exists(run_uri)

    def committed_steps(self, run_uri: str) -> list[int]:
        return list(api.committed_steps(run_uri))

    def newest_validated(self, run_uri: str) -> int | None:
        return api.newest_validated(run_uri)

    def checkpoint_state(self, run_uri: str, step: int) -> CheckpointRecord | None:
        return api.checkpoint_states(run_uri).get(step)

    def dag_run_mark(self, run_uri: str, dag_run_id: str) -> api.DagRunMark | None:
        return api.dag_run_mark(run_uri, dag_run_id)

    def set_dag_run_mark(self, run_uri: str, dag_run_id: str, *, resume_from: str, existed: bool) -> None:
        api.set_dag_run_mark(run_uri, dag_run_id, resume_from=resume_from, existed=existed)

    # --- the checkpoint lifecycle ------------------------------------------------------------------

    def validate_pending(self, run_uri: str) -> list[api.Verdict]:
        return api.validate_pending(run_uri)

    def rollback(self, run_uri: str, to: int | None = None, reason: str = "") -> api.Rollback:
        return api.rollback(run_uri, to=to, reason=reason or "rollback from Airflow")

    def promote(self, run_uri: str, step: int | None = None) -> api.Promotion:
        return api.promote(run_uri, step)

    def prune(self, run_uri: str, dry_run: bool = False) -> api.Pruned:
        return api.prune(run_uri, dry_run=dry_run)

    def export(self, run_uri: str, output: str, fmt: str) -> dict[str, Any]:
        """Write the newest validated step as ``fmt`` (hf or orbax) to ``output`` (relative: to the project)."""
        if fmt not in ("hf", "orbax"):
            raise RTrainConfigError(f"export_format: hf or orbax, not {fmt!r}")
        return dict(api.export(run_uri, absolute(output), cast(Any, fmt)))

    def report(self, run_uri: str) -> api.RunReport:
        return api.report(run_uri)

    @staticmethod
    def format_report(report: Mapping[str, Any]) -> str:
        """The run's story as ``rtrain report`` prints it, every number rounded (a report kept in an XCom, or
        one read back from an older run, may carry a loss or a time to the last bit)."""
        return api.format_report(rounded(report))
