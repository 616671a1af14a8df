"""`libra serve-rollout` configuration (one TOML file, keys overridable by flags) and the
validated body of a submit request."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from libra.cluster.config import ClusterSection, LaunchSection
from libra.config import Config
from libra.endpoints.config import BucketConfig, EndpointConfig, SamplingConfig
from libra.rollout.config import LimitsConfig
from libra.routing.config import PolicyName, RoutingTable

BATCH_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""Batch ids name spool folders: letters, digits, `.`, `_`, `-`; no path separators."""

FsyncPolicy = Literal["always", "interval", "never"]


class EnvEntry(Config):
    """An env the service hosts; submits name it by `name`."""

    spec: str
    """Registered env id (`libra envs`) or a path: `file.py:Class`, `package.module:Class`."""
    name: str | None = None
    """What submits call it. Default: `spec`."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the env's constructor."""

    @property
    def key(self) -> str:
        return self.name or self.spec


class SpoolConfig(Config):
    """The durable spool: one folder per batch under `dir` (the submit request, then
    every finished record as one JSONL line, appended before it is streamed)."""

    dir: str = "runs/spool"
    """Where batch folders live (relative paths are under the working directory)."""
    fsync: FsyncPolicy = "always"
    """`always`: a record is streamed only after it is on disk (group commit: one fsync
    covers every record written meanwhile); exactly-once holds across a machine crash.
    `interval`: records stream once written to the OS (they survive a crash of the
    service, not of the machine); an fsync every `fsync_interval_s`. `never`: the OS
    decides when to write back."""
    fsync_interval_s: float = Field(1.0, gt=0)
    """Period of the background fsync under `fsync = "interval"`."""
    on_restart: Literal["rerun", "abort"] = "rerun"
    """What a restarted service does with episodes of unfinished batches that have no
    record yet: run them again (same ids), or record them `aborted`."""


class ServiceConfig(Config):
    """A rollout fleet behind the HTTP API of DESIGN.md."""

    host: str = "127.0.0.1"
    """Address to bind. Anything but loopback needs a token."""
    port: int = Field(8700, ge=0, le=65535)
    """TCP port (0 = a free one, printed at start)."""
    token: str | None = None
    """Bearer token every call but `/healthz` must carry. Default: `$LIBRA_TOKEN`."""
    model: str | None = None
    """Model folder (tokenizer, chat template). Default: the tiny default model."""
    envs: list[EnvEntry] = Field(default_factory=list)
    """Envs submits may name. Default: every registered env id (`libra envs`), each
    loaded on first use; paths (`file.py:Class`) must be listed here."""
    concurrency: int = Field(64, ge=1)
    """Episodes in flight across all batches; the rest wait, admitted fairly."""
    workers: int = Field(1, ge=1, le=256)
    """Processes that run episodes, each with its own event loop (one event loop tops
    out near 1,000 turns/s). 1: this process runs them. N > 1: N rollout workers behind
    this process's one HTTP API and spool, restarted when one dies (its running episodes
    run again); docs/service.md "Rollout workers"."""
    policy: PolicyName = "static"
    """Routing policy (`static`, or one registered in `libra.routing`); one instance per
    env, shared by that env's batches."""
    routing: RoutingTable = Field(default_factory=dict)
    """Options of the routing policy."""
    buckets: list[BucketConfig] = Field(default_factory=list)
    """Buckets in order of their bound. Default: one bucket `tp1` with one launched
    embedded engine."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Defaults for a submit's `sampling` (it overrides keys it names)."""
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    endpoint: EndpointConfig = Field(default_factory=EndpointConfig)
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    """Where the engines `launch` asks for start: `backend = "ray"` places each on a node
    of a Ray cluster (docs/cluster.md); URLs given as endpoints are used as they are."""
    launch: LaunchSection = Field(default_factory=LaunchSection)
    """What the engines `launch` asks for are: embedded (default) or vLLM servers at their
    bucket's `tp` (`[launch] kind = "vllm"`, `[launch.vllm]`: docs/service.md)."""
    endpoint_kind: Literal["auto", "embedded", "vllm"] = "auto"
    """How `POST /v1/weights` loads a checkpoint: `embedded` (`libra serve-engine`),
    `vllm` (dev-mode pause / reload / reset / resume), or `auto` (from `/v1/models`)."""
    check_weights_locally: bool = True
    """Before `POST /v1/weights` touches an endpoint, check that the folder is a
    checkpoint as this process sees it (a failed reload can crash vLLM). Turn off when
    the endpoints see a filesystem the service does not."""
    weights_dirs: list[str] = Field(default_factory=list)
    """Folders `POST /v1/weights` may load checkpoints from (a request's path must be
    absolute and inside one, links resolved). Empty: any folder while the service binds
    only loopback; none once it is reachable from other hosts. Relative entries are taken
    from the directory the service starts in."""
    spool: SpoolConfig = Field(default_factory=SpoolConfig)
    max_request_mb: float = Field(64.0, gt=0)
    """Largest request body accepted (a submit carries its tasks inline)."""
    max_task_kb: int = Field(1024, ge=1)
    """Largest task (its JSON) a submit may carry: tasks are parsed one at a time so
    that no single parse holds the event loop up (docs/service.md)."""
    max_episodes_per_batch: int = Field(100_000, ge=1)
    """Largest batch (tasks x group_size) one submit may ask for."""
    max_open_batches: int | None = Field(None, ge=1)
    """Most unfinished batches at once (each holds two file descriptors, its spool's
    write and read sides): a submit past it is answered 429 (the client retries it).
    Default: a quarter of the open-file limit (256 under the usual 1,024; half goes to
    connections). Past the limit, submits failed with `Too many open files`."""
    max_queued_episodes: int = Field(1_000_000, ge=1)
    """Most episodes waiting for a slot, across all batches: a submit that would queue
    more is answered 429 (the client retries it), so clients that submit faster than the
    fleet serves cannot grow the service's memory without bound (a queued episode holds
    about 0.4 KB). A batch submitted while nothing waits is taken whatever its size."""
    max_batch_weight: float = Field(16.0, ge=1.0, allow_inf_nan=False)
    """Largest `weight` a submit may give its batch (its share of the episode slots
    against a weight-1 batch)."""

    @field_validator("weights_dirs")
    @classmethod
    def _absolute(cls, dirs: list[str]) -> list[str]:
        return absolute_dirs(dirs)


def absolute_dirs(dirs: list[str]) -> list[str]:
    """Folders as absolute paths, relative ones taken from the current directory."""
    return [os.path.abspath(os.path.expanduser(d)) for d in dirs]


MAX_VERSION = 2**62
"""The largest policy version (a batch's `step`, a weight load's `version`), as for seeds:
a record's step is read back into signed 64-bit integers (torch, Arrow, pandas), and
2^63 was taken and stored."""


class SubmitRequest(Config):
    """`POST /v1/rollouts` body."""

    env: str
    """Name of a hosted env."""
    tasks: list[dict[str, Any]] = Field(min_length=1)
    """Task objects, inline; each becomes `group_size` episodes."""
    group_size: int = Field(1, ge=1, le=4096)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling for this batch; keys it names override the service's `[sampling]`."""
    batch_id: str | None = None
    """Idempotency key: resubmitting the same id returns the existing batch."""
    step: int | None = Field(None, ge=0, le=MAX_VERSION)
    """Policy version stamped on records. Default: the last `POST /v1/weights` version."""
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    """This batch's share of the service's episode slots against the other batches with
    episodes waiting (fair admission, `libra.service.fair`): weights 3 and 1 hold 3/4 and
    1/4. At most the service's `max_batch_weight`."""

    @field_validator("batch_id")
    @classmethod
    def _batch_id(cls, v: str | None) -> str | None:
        if v is not None and not BATCH_ID.fullmatch(v):  # `$` lets a final "\n" through
            raise ValueError(
                "must be 1-128 characters of letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        return v

    def sampling_over(self, base: SamplingConfig) -> SamplingConfig:
        """The service defaults with the keys this request names."""
        named = self.sampling.model_dump(include=self.sampling.model_fields_set)
        return base.model_copy(update=named)


class WeightsRequest(Config):
    """`POST /v1/weights` body."""

    version: int = Field(ge=0, le=MAX_VERSION)
    """Policy version stamped on turns served after the load."""
    path: str | None = None
    """Checkpoint folder, as the endpoints see it."""
    sender: str | None = None
    """Instead of `path`: the URL of a broadcast sender (`libra.weights.remote.serve_sender`
    in the trainer's process) whose tensors the endpoints receive over gloo."""

    @model_validator(mode="after")
    def _one_source(self) -> WeightsRequest:
        if (self.path is None) == (self.sender is None):
            raise ValueError("give exactly one of path (a checkpoint folder) and sender "
                             "(a broadcast sender's URL)")  # fmt: skip
        return self


__all__ = [
    "BATCH_ID",
    "EnvEntry",
    "ServiceConfig",
    "SpoolConfig",
    "SubmitRequest",
    "WeightsRequest",
    "absolute_dirs",
]
