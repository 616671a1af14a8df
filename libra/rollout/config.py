"""`libra rollout` configuration: one TOML file, every key overridable by a flag."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from libra.cluster.config import ClusterSection, LaunchSection
from libra.config import Config
from libra.endpoints.config import BucketConfig, EndpointConfig, SamplingConfig
from libra.rollout.toolrun import DEFAULT_MAX_OUTPUT_BYTES
from libra.routing.config import PolicyName, RoutingTable


class LimitsConfig(Config):
    """Per-episode limits; scopes nest: episode ⊃ turn ⊃ call ⊃ tool."""

    max_context: int | None = Field(None, ge=16)
    """Largest total context (prompt + generated + tool tokens). Default: the model's
    `max_position_embeddings`."""
    max_turns: int | None = Field(None, ge=1)
    """Override the env's `max_turns`."""
    episode_timeout_s: float = Field(1800.0, gt=0)
    """Whole episode, tools included; on expiry the episode ends `timeout`."""
    turn_timeout_s: float = Field(600.0, gt=0)
    """One model turn (all retries of its calls)."""
    tool_timeout_s: float | None = Field(None, gt=0)
    """Cap on every tool call (each tool also has its own timeout)."""
    reward_timeout_s: float = Field(300.0, gt=0)
    teardown_timeout_s: float = Field(60.0, gt=0)
    """`env.teardown` (it runs after the episode's own limit, which it is not part of):
    the record and the episode's slot wait for it, so a teardown that hangs holds them
    this long."""
    max_tool_calls_per_turn: int = Field(8, ge=1)
    """Further calls in one turn get an error response."""
    max_tool_output_bytes: int = Field(DEFAULT_MAX_OUTPUT_BYTES, ge=1024)
    """A tool's text beyond this many bytes (UTF-8) is cut before it is tokenized, with
    a note the model sees; the tool return's `info` gets `output_cut_chars` (the
    characters the tool returned). Tokenizing costs about 1.5 s per MB here."""


class RolloutConfig(Config):
    """A batch of episodes of one env against buckets of endpoints."""

    model: str | None = None
    """Model folder (config.json, tokenizer.json, chat template). Default: the tiny
    default model, made on first use in the user cache."""
    env: str = "arith"
    """Registered env id (`libra envs`) or a path: `file.py:Class`, `package.module:Class`;
    or an agent function `file.py:run` (`async def run(task, client)`, see docs/proxy.md)."""
    env_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the env's constructor (or the agent function)."""
    tasks: str | None = None
    """Tasks file (.jsonl or .parquet). Default: the env's shipped task file."""
    num_tasks: int | None = Field(None, ge=1)
    """Use only the first N tasks (unset: all of them)."""
    group_size: int = Field(1, ge=1)
    """Samples per task (GRPO group size G)."""
    concurrency: int = Field(64, ge=1)
    """Episodes in flight at once; more wait for admission (backpressure)."""
    workers: int = Field(1, ge=1, le=256)
    """Processes that run the episodes, each with its own event loop (one loop tops out
    near 1,000 turns/s). 1: this process. N > 1: N rollout workers (`libra.rollout.
    workers`); this process admits episodes and writes the records."""
    out: str = "runs/rollout.jsonl"
    """Where records go, one per line, appended as each episode finishes."""
    batch_id: str | None = Field(None, min_length=1)
    """Batch id stamped on records. Default: a fresh random id."""
    step: int = Field(0, ge=0)
    """Policy version (training step) stamped on records."""
    policy: PolicyName = "cmlfq"
    """Routing policy: `cmlfq` (causal prefix tree, docs/cmlfq.md), `mlfq` (demote when
    the running length crosses the bound), `predictor` (length regression, routes once)
    or `static` (smallest bucket that fits the prompt, never moves)."""
    routing: RoutingTable = Field(default_factory=dict)
    """Options of the routing policy (`libra.routing.RoutingConfig`: size classes,
    `tree_path` to keep the C-MLFQ tree across runs, `update` mode, KV-aware moves)."""
    buckets: list[BucketConfig] = Field(default_factory=list)
    """Buckets in order of their bound. Default: one bucket `tp1` with one launched
    embedded engine."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    endpoint: EndpointConfig = Field(default_factory=EndpointConfig)
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    """Where the engines `launch` asks for start: `backend = "ray"` places each on a node
    of a Ray cluster (docs/cluster.md); URLs given as endpoints are used as they are."""
    launch: LaunchSection = Field(default_factory=LaunchSection)
    """What the engines `launch` asks for are: embedded (default) or vLLM servers at their
    bucket's `tp` (`[launch] kind = "vllm"`, `[launch.vllm]`: docs/service.md)."""
