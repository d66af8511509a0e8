"""Layered, validated run configuration.

A config is built in layers:

1. ``configs/base.yml``           every key with its default;
2. ``configs/<preset>.yml``       a model/run preset (``tiny``, ``small``, ``llama3-8b`` ...);
3. ``--config FILE`` YAML files   the user's own;
4. ``key=value`` overrides        from the command line, Airflow params, reruns.

The result is one typed object.  Unknown keys and wrong types are errors that
name the key; cross-field rules (ranges, divisibility) are checked here once so
that nothing downstream has to.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from training.cadence import gcs_timing
from training.faults import ChaosError, parse_chaos
from training.layout import run_uri
from training.storage import scheme

CONFIG_DIR = Path(__file__).parent / "configs"
# A run name is one directory name: no "/", no "..", not hidden.  (The DAG's param schema uses the same pattern.)
RUN_NAME_PATTERN = r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
RUN_NAME_RE = re.compile(RUN_NAME_PATTERN)
# Config keys that name local paths: made absolute once, when the config is resolved.
PATH_KEYS = ("root", "dataset", "compilation_cache", "local_checkpoint_dir", "init_from")
BUILTIN_TOKENIZERS = ("bytes", "bpe")
TOKEN_TASKS = ("lm", "maxtext")  # the built-in tasks that train on a prepared token dataset (`dataset`)
DEFAULT_DATASET = "var/data/stdlib-seq{seq_len}"  # byte-level; another tokenizer adds its name


class ConfigError(ValueError):
    """A config that cannot be run, with a message that names the key."""


class RunKeys(BaseModel):
    """The run: its name, where it lives, its dataset and where a launch resumes from."""

    run_name: str = Field("demo", description="Run name; the run's directory under `root`. Letters, digits, `_.-`.")
    root: str = Field(
        "var/runs",
        description="Run root URI: a local path (made absolute against the directory the command runs in) or "
        "gs://bucket/prefix.",
    )
    dataset: str = Field(
        "",
        description="Prepared dataset URI (output of `rtrain prepare`); empty: var/data/stdlib-seq<seq_len>, one "
        "dataset of this Python's standard library per sequence length.",
    )
    dataset_reads: Literal["auto", "direct", "download"] = Field(
        "auto",
        description="How each host reads a gs:// dataset: `direct` (in place, only the records it trains on), "
        "`download` (every shard into a local cache first) or `auto` (direct above 1 GiB a split).",
    )
    preset: str = Field("tiny", description="Preset the config was built from (informational once resolved).")
    resume_from: str = Field(
        "latest",
        description="Where a new launch starts: `latest` (the run's newest committed checkpoint, else scratch), "
        "`none` (refuse to reuse an existing run), or a step number of this run.",
    )
    init_from: str = Field(
        "",
        description="A Hugging Face Llama checkpoint a new run of the built-in `lm` task starts from: a directory "
        "(local or gs://) of `config.json` and `*.safetensors`. Its config.json sets the model's shapes (keys your "
        "config or overrides also set must agree) and its `tokenizer.json` becomes the tokenizer; a run that "
        "resumes from its own checkpoint ignores it. Empty: a random init.",
    )

    on_dataset_change: Literal["refuse", "restart"] = Field(
        "refuse",
        description="When a resumed checkpoint was trained on another dataset (a refreshed one): `refuse`, or "
        "`restart` the data position at the new dataset's first example (continual training).",
    )


class TaskKeys(BaseModel):
    """The task: what is trained, its arguments and the tokenizer its data is prepared with."""

    task: str = Field(
        "lm",
        description="What is trained: a built-in task (`lm`: a Llama 3 decoder on a prepared token dataset; "
        "`maxtext`: a MaxText model on it, the `maxtext` extra) or "
        "user code as `package.module:factory` or `path/to/file.py:factory` (factory(cfg, task_args) -> Task).",
    )
    task_args: dict[str, Any] = Field(
        default_factory=dict, description="Free-form arguments for the task, validated by the task itself."
    )
    tokenizer: str = Field(
        "bytes",
        description="How `rtrain prepare` turns text into token ids: `bytes` (vocab 256), `bpe` (a byte-level BPE "
        "of `vocab_size` trained on the corpus with Hugging Face tokenizers), or a local `tokenizer.json` "
        "(Hugging Face) or SentencePiece `.model` file.",
    )


class ModelKeys(BaseModel):
    """The built-in ``lm`` task's model: a Llama 3 decoder's shapes and kernels."""

    vocab_size: int = Field(256, ge=2, description="Vocabulary size (byte-level tokens: 256).")
    seq_len: int = Field(64, ge=8, description="Tokens per training sequence.")
    d_model: int = Field(64, ge=8, description="Model width.")
    n_layers: int = Field(2, ge=1, description="Transformer blocks.")
    n_heads: int = Field(4, ge=1, description="Attention heads.")
    n_kv_heads: int = Field(0, ge=0, description="Key/value heads (grouped-query attention); 0 means n_heads.")
    d_ff: int = Field(256, ge=8, description="MLP hidden width.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Activation dtype.")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Parameter (master weight) dtype; with dtype bfloat16: bf16 compute, fp32 masters."
    )
    rope_theta: float = Field(500000.0, gt=0, description="RoPE base frequency (Llama 3: 500000).")
    rope_scaling: float = Field(
        0.0, ge=0, description="Llama 3.1 RoPE frequency scaling factor for long context (0: off; Llama 3.1: 8)."
    )
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    rope_original_context: int = Field(
        8192,
        ge=1,
        description="Llama 3.1 RoPE scaling: the context length the model was first trained at (Hugging Face's "
        "original_max_position_embeddings).",
    )
    tie_embeddings: bool = Field(False, description="Share the input embedding with the output head.")
    scan_layers: bool = Field(
        False,
        description="Run the blocks as one scanned layer (one compiled block whatever the depth: deep models "
        "compile in seconds); off, each block is compiled on its own (faster for a few layers).",
    )
    attention: Literal["auto", "splash", "xla", "reference"] = Field(
        "auto",
        description="Attention kernel: `splash` (Pallas's TPU splash kernel; interpreted, slowly, elsewhere), `xla` "
        "(jax.nn.dot_product_attention: cuDNN on a GPU, einsums on TPU and CPU), `reference` (plain einsums, for "
        "checking); `auto`: splash on a TPU when sequence and head width are multiples of 128, else xla.",
    )
    remat: Literal["none", "full", "dots", "qkv_proj", "attn", "attn_mlp"] = Field(
        "none",
        description="What each block keeps for the backward pass (the rest is recomputed): `none` (no "
        "rematerialisation), `full` (only the block's input), `dots` (every projection's output), `qkv_proj` (the "
        "attention's q, k, v projections), `attn` (those and the attention's output), `attn_mlp` (and the MLP's "
        "gated hidden). true means full, false none.",
    )

    @field_validator("remat", mode="before")
    @classmethod
    def _remat_bool(cls, v: Any) -> Any:
        return ("full" if v else "none") if isinstance(v, bool) else v


class OptimKeys(BaseModel):
    """Optimisation: steps, the global batch, the optimizer and its schedule."""

    steps: int = Field(40, ge=1, le=10_000_000, description="Total optimizer steps of the run.")
    global_batch: int = Field(16, ge=1, description="Sequences per step, constant across resizes.")
    grad_accum: int = Field(
        1, ge=1, description="Micro-batches per step: the global batch is split and the gradients summed."
    )
    optimizer: Literal["adamw", "adafactor", "lion", "sgd"] = Field("adamw", description="The optimizer (optax).")
    learning_rate: float = Field(3e-3, gt=0, description="Peak learning rate.")
    b1: float = Field(0.9, ge=0, lt=1, description="First moment decay (adamw, lion) or momentum (sgd).")
    b2: float = Field(0.95, ge=0, lt=1, description="Second moment decay (adamw, lion).")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    schedule: Literal["cosine", "wsd", "linear", "constant"] = Field(
        "cosine",
        description="Learning-rate schedule after the warmup: cosine or linear decay to min_lr_ratio, constant, "
        "or wsd (warmup-stable-decay: constant, then a linear decay over the last `decay_fraction` of the steps).",
    )
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: the fraction of the steps that decays.")
    warmup_steps: int = Field(5, ge=0, description="Linear warmup steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of the peak.")
    weight_decay: float = Field(0.01, ge=0, description="Decoupled weight decay (adamw, lion, adafactor).")
    grad_clip: float = Field(1.0, ge=0, description="Global-norm gradient clipping; 0 disables.")
    seed: int = Field(0, description="Seed for initialisation, data order and dropout.")


class CheckpointKeys(BaseModel):
    """Checkpoints: how often, how (async, format), the local tier and the notice's grace."""

    checkpoint_every: int = Field(
        10, ge=1, le=1_000_000, description="Save a checkpoint every N steps (and at the end)."
    )
    async_checkpoint: bool = Field(True, description="Save in the background while training goes on.")
    local_checkpoint_every: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Local tier: every N steps each host also saves the state to host-local storage "
        "(`local_checkpoint_dir`), restored from after a lost host when newer than the newest persistent "
        "checkpoint (0: off).",
    )
    local_checkpoint_dir: str = Field(
        "",
        description="Local tier directory on each host (on GKE an emptyDir volume with medium Memory); empty: "
        "/dev/shm/rtrain (a tmpfs) when it has 1 GiB free, else the system's temp directory. A host's "
        "RTRAIN_LOCAL_CHECKPOINT_DIR wins.",
    )
    local_keep: int = Field(2, ge=1, description="Local tier: each host keeps its newest N local checkpoints.")
    preemption_grace_s: float = Field(
        25.0,
        gt=0,
        description="After a preemption notice (SIGTERM), the seconds the job has to stop at a step boundary and "
        "commit a checkpoint of it (keep below the platform's grace period: 30 s for a GKE pod by default, 15 s for "
        "a Spot preemption; a GKE Spot job is refused unless this plus 5 s fits).",
    )
    checkpoint_format: Literal["lean", "auto", "ocdbt", "zarr"] = Field(
        "lean",
        description="How persistent checkpoints are written. lean: each process writes the shards it is the writer of "
        "once, with an index (a few files per process and save, a tenth of Orbax's CPU). ocdbt or zarr: Orbax's "
        "formats; auto = OCDBT except against a GCS emulator. Steps of any format restore whatever this says.",
    )
    checkpoint_compression: bool = Field(
        False,
        description="Compress checkpoint arrays with zstd, in Orbax's formats (Orbax's default). Trained weights "
        "barely compress (about 7% here) and zstd costs CPU in every save and restore, so it is off.",
    )


class LifecycleKeys(BaseModel):
    """The checkpoint lifecycle: validation, rollback, the in-training guard and retention."""

    val_batches: int = Field(4, ge=1, description="Evaluation batches of the held-out split per validation.")
    val_batch: int = Field(16, ge=1, description="Sequences per evaluation batch.")
    validate_on: Literal["host", "slice"] = Field(
        "host",
        description="Where a checkpoint is evaluated: `host` (validation restores its parameters onto one device) "
        "or `slice` (the job evaluates each step it saves on its own mesh, sharded like training, and "
        "validation judges those metrics: for a model too big for one device). `val_batch` then splits "
        "over the job's devices as `global_batch` does.",
    )
    val_tolerance: float = Field(
        0.05,
        ge=0,
        le=10,
        description="Reject a checkpoint whose loss exceeds the best validated loss by this fraction (0.05: 5%).",
    )
    val_max_loss: float = Field(
        0.0, ge=0, description="Reject a checkpoint whose validation loss is above this (0: no threshold)."
    )
    val_min_accuracy: float = Field(
        0.0, ge=0, le=1, description="Reject a checkpoint whose token accuracy is below this (0: none)."
    )
    rollback_skip_data: bool = Field(
        True, description="After a rollback, skip the data window since the good checkpoint."
    )
    rollback_lr_scale: float = Field(1.0, gt=0, description="After a rollback, scale the learning rate by this factor.")
    max_rollbacks: int = Field(
        2, ge=0, le=100, description="Validation rollbacks (each followed by resumed training) a pipeline run may do."
    )
    spike_factor: float = Field(
        4.0, ge=0, description="In-training guard: a loss above this x the running median is a spike (0: off)."
    )
    spike_window: int = Field(10, ge=3, description="Logged losses in the running median of the guard.")
    max_guard_rollbacks: int = Field(
        2, ge=0, description="In-job rollbacks for non-finite or spiking loss before the job fails."
    )
    keep_last: int = Field(3, ge=0, le=100_000, description="Pruning: keep the newest N checkpoints (0: rule off).")
    keep_best: int = Field(
        1, ge=0, le=100_000, description="Pruning: keep the best N validated checkpoints by `best_metric` (0: off)."
    )
    best_metric: str = Field("loss", description="Validation metric for keep_best (lower is better).")
    keep_every: int = Field(
        0, ge=0, le=10_000_000, description="Pruning: keep every K-th step as a milestone (0: off)."
    )
    quarantine_ttl_s: float = Field(
        7 * 86400.0, ge=0, description="Pruning: delete quarantined checkpoints after this long."
    )


class ElasticKeys(BaseModel):
    """The elastic job: its size range, failure budget and the control plane's timing."""

    backend: Literal["local", "gke"] = Field("local", description="Where workers run: the local slice or GKE.")
    min_workers: int = Field(1, ge=1, le=10_000, description="Fewest workers (hosts) the job may run on.")
    max_workers: int = Field(2, ge=1, le=10_000, description="Most workers (hosts) the job may use.")
    devices_per_worker: int = Field(2, ge=1, description="Accelerator devices per worker (local slice: CPU devices).")
    hosts_per_slice: int = Field(
        1,
        ge=1,
        description="Hosts of one slice (a multi-host TPU slice is lost and gained whole); min/max_workers and every "
        "size the job runs on are whole slices.",
    )
    max_failures: int = Field(3, ge=0, description="Worker-group failures the job absorbs before it fails.")
    capacity_timeout_s: float = Field(120.0, gt=0, description="How long to wait for capacity >= min_workers.")
    hang_timeout_s: float = Field(300.0, gt=0, description="No progress from the workers for this long is a failure.")
    heartbeat_s: float = Field(
        0.5, gt=0, description="Host agents write a heartbeat to the rendezvous this often (gs:// root: 1 s)."
    )
    heartbeat_timeout_s: float = Field(
        5.0,
        gt=0,
        description="A host whose heartbeat is older than this is lost (a frozen or vanished host; gs:// root: 10 s).",
    )
    lease_s: float = Field(
        2.0,
        gt=0,
        description="The leader's lease on the run; another agent takes over when it lapses (gs:// root: 8 s).",
    )
    join_timeout_s: float = Field(
        15.0, gt=0, description="How long the first round waits for every expected host before it starts with fewer."
    )


class MeshKeys(BaseModel):
    """The device mesh and the memory-fit check."""

    ici_data: int = Field(1, description="Data parallelism inside a host (-1: fill).")
    ici_fsdp: int = Field(-1, description="FSDP parallelism inside a host (-1: fill).")
    ici_tensor: int = Field(1, description="Tensor parallelism inside a host (-1: fill).")
    dcn_data: int = Field(-1, description="Data parallelism across hosts (-1: fill).")
    dcn_fsdp: int = Field(1, description="FSDP parallelism across hosts (-1: fill).")
    device_memory_gib: float = Field(2.0, gt=0, description="Memory per device for the fit check.")


class OperationsKeys(BaseModel):
    """Operations: logging, fault injection, compilation."""

    log_every: int = Field(
        10,
        ge=1,
        description="A progress event (loss, tokens/s, ETA for the task log and status) every N steps; the "
        "per-step curves go to TensorBoard whatever N is.",
    )
    chaos: list[str] = Field(default_factory=list, description="Fault injections, e.g. `preempt:worker=1,step=12`.")
    compilation_cache: str = Field("var/jax-cache", description="JAX persistent compilation cache directory.")
    compile_ahead: bool | None = Field(
        None,
        description="Process 0 compiles the step for each smaller size the job may shrink to, in the background "
        "after a round's first steps, into the persistent cache: a recovery onto one loads it instead of compiling. "
        "Unset: on, except on TPU, where loading a step compiled in a larger runtime has not yet run on a real slice.",
    )
    trace_data_ids: bool = Field(False, description="Record the example ids of every step (tests, audits).")


# Pydantic orders the fields of several bases from the last one: the sections are listed last first, so the
# keys keep their order (the run first) in dumps, docs and the DAG's form.
class Config(
    OperationsKeys, MeshKeys, ElasticKeys, LifecycleKeys, CheckpointKeys, OptimKeys, ModelKeys, TaskKeys, RunKeys
):
    """A run's whole configuration: every key of every section, validated together."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        """Keys of configs written before: ``activation_checkpointing: true|false`` is ``remat: full|none`` (unless
        remat is set too), and ``attention: dot_product`` is ``attention: xla``."""
        if isinstance(data, dict) and data.get("attention") == "dot_product":
            data = {**data, "attention": "xla"}
        if isinstance(data, dict) and "activation_checkpointing" in data:
            data = dict(data)
            old = data.pop("activation_checkpointing")
            if isinstance(old, bool):
                data.setdefault("remat", "full" if old else "none")
            else:
                data["activation_checkpointing"] = old  # refused below, naming the key
        return data

    @model_validator(mode="after")
    def _check(self) -> Config:
        if not RUN_NAME_RE.match(self.run_name):
            raise ValueError(
                f"run_name {self.run_name!r}: letters, digits and _.- (up to 63), not starting with one of _.-, no '..'"
            )
        if not self.dataset:
            self.dataset = default_dataset(self.tokenizer, self.vocab_size, self.seq_len)
        if scheme(self.root).requests:
            # Every look at a gs:// root is an HTTP request: beat, and renew the lease, less often, and
            # beat slower as the job grows (unless told otherwise).
            timing = gcs_timing(self.max_workers)
            derived = [k for k in ("heartbeat_s", "heartbeat_timeout_s", "lease_s") if k not in self.model_fields_set]
            told_timeout = "heartbeat_timeout_s" not in derived
            if "heartbeat_s" in derived and told_timeout and self.heartbeat_timeout_s < 2 * timing.heartbeat_s:
                raise ValueError(
                    f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be at least twice heartbeat_s: on gs:// "
                    f"a job of {self.max_workers} hosts beats every {timing.heartbeat_s:g} s unless told otherwise"
                )
            for key in derived:
                setattr(self, key, getattr(timing, key))
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) > max_workers ({self.max_workers})")
        if self.min_workers % self.hosts_per_slice or self.max_workers % self.hosts_per_slice:
            raise ValueError(
                f"min_workers ({self.min_workers}) and max_workers ({self.max_workers}) must be whole slices of "
                f"hosts_per_slice={self.hosts_per_slice} hosts"
            )
        if self.heartbeat_timeout_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be at least twice heartbeat_s ({self.heartbeat_s})"
            )
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.kv_heads and self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        if self.global_batch % self.grad_accum:
            raise ValueError(f"global_batch ({self.global_batch}) must be divisible by grad_accum ({self.grad_accum})")
        if self.tokenizer == "bytes" and self.task == "lm" and self.vocab_size < 256:
            raise ValueError(f"vocab_size ({self.vocab_size}) is below the byte tokenizer's 256")
        if self.checkpoint_compression and self.checkpoint_format == "lean":
            raise ValueError(
                "checkpoint_compression applies to Orbax's formats (checkpoint_format ocdbt, zarr or auto); "
                "the lean format is stored uncompressed"
            )
        if self.init_from and self.task != "lm":
            raise ValueError(f"init_from loads a Hugging Face Llama into the built-in lm task, not task {self.task!r}")
        if self.resume_from not in ("latest", "none") and not self.resume_from.isdigit():
            raise ValueError(f"resume_from must be 'latest', 'none' or a step number, got {self.resume_from!r}")
        for spec in self.chaos:
            try:
                fault = parse_chaos(spec)
            except ChaosError as e:
                raise ValueError(str(e)) from None
            if fault.action == "damage_local" and not self.local_checkpoint_every:
                raise ValueError(f"chaos {spec!r}: damage_local needs the local tier (local_checkpoint_every > 0)")
        return self

    @property
    def prepared_tokens(self) -> bool:
        """Whether the task trains on the prepared token dataset at ``dataset`` (the built-in ``lm`` and ``maxtext``)."""
        return self.task in TOKEN_TASKS

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the blocks are rematerialised at all (any ``remat`` policy but none)."""
        return self.remat != "none"

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def run_uri(self) -> str:
        return run_uri(self.root, self.run_name)

    def with_absolute_paths(self, base: str | Path | None = None) -> Config:
        """Local paths made absolute against ``base`` (default: the current directory); gs:// kept."""
        update = {k: absolute(getattr(self, k), base) for k in PATH_KEYS}
        if self.tokenizer not in BUILTIN_TOKENIZERS:
            update["tokenizer"] = absolute(self.tokenizer, base)
        file, sep, factory = self.task.rpartition(":")
        if sep and file.endswith(".py"):
            update["task"] = f"{absolute(file, base)}:{factory}"
        return self.model_copy(update=update)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


def default_dataset(tokenizer: str, vocab_size: int, seq_len: int) -> str:
    """The dataset a config trains on when it names none: this Python's stdlib, per tokenizer and length."""
    if tokenizer == "bytes":
        return DEFAULT_DATASET.format(seq_len=seq_len)
    if tokenizer == "bpe":
        name = f"bpe{vocab_size}"
    else:
        path = Path(tokenizer)  # a checkpoint's tokenizer.json is named by its directory
        stem = path.parent.name if path.name == "tokenizer.json" and path.parent.name else path.stem
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:40] or "tok"
    return f"var/data/stdlib-{name}-seq{seq_len}"


def absolute(path: str, base: str | Path | None = None) -> str:
    """A local path made absolute against ``base`` (default: the current directory); gs:// URIs unchanged."""
    if not path or not scheme(path).filesystem:
        return path
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = Path(base if base is not None else os.getcwd()) / p
    return os.path.normpath(p)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"--config {path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of key: value, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value")
    key, _, raw = item.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has no key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: {raw!r} is not a value ({getattr(e, 'problem', None) or e})") from None
    return key, value


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yml") if p.stem != "base")


def load_config(
    preset: str | None = None,
    files: list[str] | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    base_dir: str | Path | None = None,
) -> Config:
    """Build a Config from the layers; raises ConfigError naming the bad key.

    Local paths are made absolute here, once, against ``base_dir`` (default: the
    directory the command runs in), so every process of the run sees the same ones.
    """
    layers: dict[str, Any] = dict(_read_yaml(CONFIG_DIR / "base.yml"))
    ov: dict[str, Any] = {}
    if isinstance(overrides, dict):
        ov = dict(overrides)
    else:
        for item in overrides or []:
            k, v = parse_override(item)
            ov[k] = v
    user_files = [_read_yaml(Path(f)) for f in files or []]
    preset = ov.get("preset") or next((u["preset"] for u in reversed(user_files) if "preset" in u), None) or preset
    preset = preset or layers.get("preset", "tiny")
    preset_path = CONFIG_DIR / f"{preset}.yml"
    if not preset_path.exists():
        raise ConfigError(f"preset: unknown preset {preset!r}; known: {', '.join(preset_names())}")
    layers.update(_read_yaml(preset_path))
    layers["preset"] = preset
    for u in user_files:
        layers.update(u)
    layers.update(ov)
    if layers.get("init_from"):
        user = {k for u in user_files for k in u} | set(ov)
        layers.update(checkpoint_keys(absolute(str(layers["init_from"]), base_dir), layers, user))
    return validate_dict(layers).with_absolute_paths(base_dir)


def checkpoint_keys(uri: str, layers: dict[str, Any], user: set[str]) -> dict[str, Any]:
    """The keys a Hugging Face checkpoint sets (its model's shapes, its tokenizer), checked against ``user``'s."""
    from training.hf import HFError, checkpoint_keys

    try:
        found = checkpoint_keys(uri)
    except HFError as e:
        raise ConfigError(f"init_from: {e}") from None
    keys = dict(found.model)
    for key, value in keys.items():
        mine = layers.get(key)
        if key == "n_kv_heads" and mine == 0:
            mine = layers.get("n_heads")
        if key in user and mine != value:
            raise ConfigError(f"init_from: {uri} has {key}={value!r}, the config sets {key}={mine!r}")
    if found.tokenizer and "tokenizer" not in user:
        keys["tokenizer"] = found.tokenizer
    return keys


def validate_dict(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                msgs.append(f"{loc}: unknown key")
            elif loc:
                msgs.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
            else:  # a cross-field rule: its message names the keys (the input is the whole config)
                msgs.append(str(err["msg"]).removeprefix("Value error, "))
        raise ConfigError("invalid config: " + "; ".join(msgs)) from None


def describe_keys() -> list[dict[str, str]]:
    """Every config key with its type, default and description (``rtrain config``)."""
    out = []
    for name, field in Config.model_fields.items():
        ann = field.annotation
        typ = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
        out.append(
            {
                "key": name,
                "type": typ,
                "default": repr(field.get_default(call_default_factory=True)),
                "description": field.description or "",
            }
        )
    return out


def config_from_json(text: str) -> Config:
    return Config.model_validate_json(text)
