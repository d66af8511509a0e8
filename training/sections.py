"""The config's sections: model, data, optimizer, checkpoint, elastic, placement and observability.

Each section is its own typed model, and a component takes the one it needs (the model builder
``cfg.model``, the optimizer ``cfg.optimizer``, the checkpoint manager ``cfg.checkpoint``, the data
pipeline ``cfg.data``).  ``training.config.Config`` holds them in one document with the run's own keys
(name, root, preset, task) at its top level, and checks the rules that span sections.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger("training.config")  # the config's notes (flat keys, retired values) share one logger
_NOTED: set[str] = set()
LEAN_RETIRED = (
    "config: checkpoint_format lean is retired and read as auto (Orbax's OCDBT commits and restores faster: "
    "rtrain bench --only formats); steps saved in lean still restore"
)


class Section(BaseModel):
    """One section of the config: its keys typed and bounded; unknown keys refused, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    """The model: the built-in ``lm`` task's Llama 3 decoder's shapes and kernels, and the weights it starts from."""

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
        "checking); `auto`: splash on a TPU when the sequence is a multiple of 128 and the head width of 64, else xla.",
    )
    remat: Literal["none", "full", "dots", "qkv_proj", "attn", "attn_mlp", "auto"] = Field(
        "none",
        description="What each block keeps for the backward pass (the rest is recomputed): `none` (no "
        "rematerialisation), `full` (only the block's input), `dots` (every projection's output), `qkv_proj` (the "
        "attention's q, k, v projections), `attn` (those and the attention's output), `attn_mlp` (and the MLP's "
        "gated hidden); `auto`: the policy whose compiled step recomputes least among those that fit 90% of "
        "device_memory_gib at the minimum topology, chosen when a job is launched (rtrain plan --compiled shows "
        "it and why). true means full, false none.",
    )
    init_from: str = Field(
        "",
        description="A Hugging Face Llama checkpoint a new run of the built-in `lm` task starts from: a directory "
        "(local or gs://) of `config.json` and `*.safetensors`. Its config.json sets the model's shapes (keys your "
        "config or overrides also set must agree) and its `tokenizer.json` becomes the tokenizer; its weights are "
        "checked from the safetensors' headers when the config is resolved; a run that resumes from its own "
        "checkpoint ignores it. Empty: a random init.",
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        """Keys of configs written before: ``activation_checkpointing: true|false`` is ``remat: full|none`` (unless
        remat is set too), and ``attention: dot_product`` is ``attention: xla``."""
        if isinstance(data, dict) and data.get("attention") == "dot_product":
            data = {**data, "attention": "xla"}
        if isinstance(data, dict) and isinstance(data.get("activation_checkpointing"), bool):
            data = dict(data)
            data.setdefault("remat", "full" if data.pop("activation_checkpointing") else "none")
        return data  # any other activation_checkpointing is refused as an unknown key

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the blocks are rematerialised at all (any ``remat`` policy but none)."""
        return self.remat != "none"

    @field_validator("remat", mode="before")
    @classmethod
    def _remat_bool(cls, v: Any) -> Any:
        return ("full" if v else "none") if isinstance(v, bool) else v


class DataSection(Section):
    """The data: the prepared dataset, how hosts read it, the tokenizer it is prepared with."""

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
    tokenizer: str = Field(
        "bytes",
        description="How `rtrain prepare` turns text into token ids: `bytes` (vocab 256), `bpe` (a byte-level BPE "
        "of `vocab_size` trained on the corpus with Hugging Face tokenizers), or a local `tokenizer.json` "
        "(Hugging Face) or SentencePiece `.model` file.",
    )
    on_dataset_change: Literal["refuse", "restart"] = Field(
        "refuse",
        description="When a resumed checkpoint was trained on another dataset (a refreshed one): `refuse`, or "
        "`restart` the data position at the new dataset's first example (continual training).",
    )


class OptimizerSection(Section):
    """Optimisation: steps, the global batch, the optimizer (``name``) and its schedule."""

    steps: int = Field(40, ge=1, le=10_000_000, description="Total optimizer steps of the run.")
    global_batch: int = Field(16, ge=1, description="Sequences per step, constant across resizes.")
    grad_accum: int = Field(
        1, ge=1, description="Micro-batches per step: the global batch is split and the gradients summed."
    )
    name: Literal["adamw", "adafactor", "lion", "sgd"] = Field("adamw", description="The optimizer (optax).")
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


class CheckpointSection(Section):
    """Checkpoints and their lifecycle: how often and how they are saved, where a launch resumes from, validation, rollback, the in-training guard and retention."""

    resume_from: str = Field(
        "latest",
        description="Where a new launch starts: `latest` (the run's newest committed checkpoint, else scratch), "
        "`none` (refuse to reuse an existing run), or a step number of this run.",
    )
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
    local_keep: int = Field(
        2,
        ge=1,
        description="Local tier: each host keeps its newest N local checkpoints, and one more copy's memory "
        "(the file the next copy is written over).",
    )
    preemption_grace_s: float = Field(
        25.0,
        gt=0,
        description="After a preemption notice (SIGTERM), the seconds the job has to stop at a step boundary and "
        "commit a checkpoint of it (keep below the platform's grace period: 30 s for a GKE pod by default, 15 s for "
        "a Spot preemption; a GKE Spot job is refused unless this plus 5 s fits).",
    )
    checkpoint_format: Literal["auto", "ocdbt", "zarr"] = Field(
        "auto",
        description="How persistent checkpoints are written: Orbax's formats, the state's own tree by name (a plain "
        "orbax.checkpoint restore reads a step); auto = OCDBT (on every root), zarr = plain zarr. `lean`, this "
        "project's own format, is retired (OCDBT commits and restores faster: `rtrain bench --only formats`) and "
        "read as auto; steps saved in it, or in any format, restore whatever this says.",
    )
    checkpoint_compression: bool = Field(
        False,
        description="Compress checkpoint arrays with zstd, in Orbax's formats (Orbax's default). Trained weights "
        "barely compress (about 7% here) and zstd costs CPU in every save and restore, so it is off.",
    )

    @field_validator("checkpoint_format", mode="before")
    @classmethod
    def _lean_retired(cls, v: Any) -> Any:
        """``lean`` (retired) read as ``auto``, with a note once per process."""
        if v != "lean":
            return v
        if LEAN_RETIRED not in _NOTED:
            _NOTED.add(LEAN_RETIRED)
            log.warning("%s", LEAN_RETIRED)
        return "auto"

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


class ElasticSection(Section):
    """The elastic job: its size range, failure budget, the control plane's timing and injected faults."""

    min_workers: int = Field(1, ge=1, le=10_000, description="Fewest workers (hosts) the job may run on.")
    max_workers: int = Field(2, ge=1, le=10_000, description="Most workers (hosts) the job may use.")
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
    chaos: list[str] = Field(default_factory=list, description="Fault injections, e.g. `preempt:worker=1,step=12`.")


class PlacementSection(Section):
    """Placement: where the workers run, their devices, the device mesh, the memory-fit check and compilation."""

    backend: str = Field(
        "local",
        description="Where workers run: the local slice, GKE, or a backend installed beside them "
        "(`training.backends.add`).",
    )
    devices_per_worker: int = Field(2, ge=1, description="Accelerator devices per worker (local slice: CPU devices).")
    hosts_per_slice: int = Field(
        1,
        ge=1,
        description="Hosts of one slice (a multi-host TPU slice is lost and gained whole); min/max_workers and every "
        "size the job runs on are whole slices.",
    )
    ici_data: int = Field(1, description="Data parallelism inside a host (-1: fill).")
    ici_fsdp: int = Field(-1, description="FSDP parallelism inside a host (-1: fill).")
    ici_tensor: int = Field(1, description="Tensor parallelism inside a host (-1: fill).")
    dcn_data: int = Field(-1, description="Data parallelism across hosts (-1: fill).")
    dcn_fsdp: int = Field(1, description="FSDP parallelism across hosts (-1: fill).")
    device_memory_gib: float = Field(2.0, gt=0, description="Memory per device for the fit check.")
    compilation_cache: str = Field("var/jax-cache", description="JAX persistent compilation cache directory.")
    compile_ahead: bool | None = Field(
        None,
        description="Process 0 compiles the step for each smaller size the job may shrink to, in the background "
        "after a round's first steps, into the persistent cache: a recovery onto one loads it instead of compiling. "
        "Unset: on, except on TPU, where loading a step compiled in a larger runtime has not yet run on a real slice.",
    )

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        """A backend the engine has or one installed beside it (its traits found, its module imported)."""
        from training.placement_traits import traits

        traits(v)  # ValueError naming the known ones
        return v


class ObservabilitySection(Section):
    """Observability: progress events and the data audit trail."""

    log_every: int = Field(
        10,
        ge=1,
        description="A progress event (loss, tokens/s, ETA for the task log and status) every N steps; the "
        "per-step curves go to TensorBoard whatever N is.",
    )
    trace_data_ids: bool = Field(False, description="Record the example ids of every step (tests, audits).")


# The sections of a config, by the key each has in the document (in the document's order).
SECTIONS: dict[str, type[Section]] = {
    "model": ModelSection,
    "data": DataSection,
    "optimizer": OptimizerSection,
    "checkpoint": CheckpointSection,
    "elastic": ElasticSection,
    "placement": PlacementSection,
    "observability": ObservabilitySection,
}
# Flat keys of earlier versions whose name in their section differs (the rest keep their names).
RENAMED = {"optimizer": ("optimizer", "name"), "activation_checkpointing": ("model", "activation_checkpointing")}
# Every flat key of earlier versions -> (section, key in the section).
FLAT: dict[str, tuple[str, str]] = {
    **{key: (name, key) for name, section in SECTIONS.items() for key in section.model_fields if key != "name"},
    **RENAMED,
}
