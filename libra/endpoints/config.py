"""Configs for buckets, endpoints and sampling (TOML tables `[[buckets]]`, `[endpoint]`,
`[sampling]`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from libra.config import Config


class BucketConfig(Config):
    """A bucket: endpoints of one tensor-parallel size serving contexts up to `bound`."""

    name: str
    """Bucket name (`tp1`, `short`, ...). Routing policies answer with these names."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel size of the bucket's instances."""
    bound: int | None = Field(None, ge=1)
    """Largest total context length the bucket serves. Default: the model's context split
    evenly in log space over the buckets (the last bucket gets the whole context)."""
    endpoints: list[str] = Field(default_factory=list)
    """Base URLs of OpenAI-compatible servers, e.g. `http://127.0.0.1:8000`."""
    launch: int = Field(0, ge=0)
    """Engines to start for this bucket, in addition to `endpoints`: embedded ones
    (`libra serve-engine` subprocesses on free loopback ports) or, with `[launch] kind =
    "vllm"`, vLLM servers at `tp` (`libra.cluster.config.LaunchSection`)."""


class EndpointConfig(Config):
    """How Libra talks to endpoints."""

    max_inflight: int = Field(256, ge=1)
    """Requests in flight per endpoint; more wait in Libra's queue (backpressure)."""
    max_inflight_total: int = Field(4096, ge=1)
    """Requests in flight across all endpoints of this process, at most. The actual cap
    adapts below it to keep event-loop lag near `loop_lag_target_s`."""
    loop_lag_target_s: float = Field(0.02, gt=0)
    """Event-loop lag the in-flight cap is steered to (see endpoints/governor.py)."""
    retries: int = Field(4, ge=0)
    """Retries of one call on 429 / 5xx / connection errors / timeouts."""
    backoff_s: float = Field(0.2, gt=0)
    """First retry delay; doubles per attempt with full jitter, capped at `backoff_max_s`."""
    backoff_max_s: float = Field(5.0, gt=0)
    request_timeout_s: float = Field(300.0, gt=0)
    """Limit for one completion call."""
    connect_timeout_s: float = Field(5.0, gt=0)
    health_interval_s: float = Field(2.0, gt=0)
    """How often endpoints marked down are probed (`GET /health`)."""
    down_wait_s: float = Field(30.0, ge=0)
    """How long a turn waits for some endpoint of its bucket to come back before the
    episode falls back to another bucket (or fails)."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer ...` when set."""


SEED_MAX = 2**62
"""The largest sampling seed (a derived seed adds the episode's index and turn)."""


class SamplingConfig(Config):
    """Sampling for every model turn (sent explicitly: vLLM otherwise fills omitted fields
    from the model's generation_config.json)."""

    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    max_tokens: int = Field(512, ge=1)
    """Tokens per model turn (also capped by the context left)."""
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    """Per-episode seeds derive from it (seed + episode index) when set; at most
    `SEED_MAX`, so that every derived seed fits the 64-bit seed of vLLM and torch."""
    logprobs: int = Field(0, ge=0, le=20)
    """`logprobs` sent to `/v1/completions`: 0 returns just the sampled token's log-prob
    (all Libra records); more adds top-k alternatives nobody reads."""

    @model_validator(mode="after")
    def _check(self) -> SamplingConfig:
        return self
