"""`make_policy(name, buckets, config)`: the one way the rollout engine, the simulator
and `libra eval-routing` build a routing policy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from libra.config import build
from libra.errors import ConfigError
from libra.routing.base import Bucket, RoutingPolicy, StaticPolicy
from libra.routing.config import RoutingConfig
from libra.routing.cost import MoveCost

POLICIES = ("cmlfq", "mlfq", "predictor", "static")
"""Known policy names; `cmlfq` is the default."""


def make_policy(
    name: str,
    buckets: Sequence[Bucket],
    config: RoutingConfig | Mapping[str, Any] | None = None,
    *,
    cost: MoveCost | None = None,
) -> RoutingPolicy:
    """A fresh policy over `buckets`. `config` is a `RoutingConfig` or its table as a
    dict (e.g. `[rollout.routing]` from TOML; unknown keys are errors). `cost` prices
    C-MLFQ's KV-aware moves (default: `TPScaledCost`)."""
    if not isinstance(config, RoutingConfig):
        config = build(RoutingConfig, dict(config or {}), "routing")
    if not buckets:
        raise ConfigError("routing needs at least one bucket")
    if name == "cmlfq":
        from libra.routing.cmlfq import CMLFQPolicy

        if cost is None and config.cost_profile:
            cost = _planner_cost(config.cost_profile, config.decode_batch)
        return CMLFQPolicy(buckets, config, cost=cost)
    if name == "mlfq":
        from libra.routing.mlfq import MLFQPolicy

        return MLFQPolicy(buckets)
    if name == "predictor":
        from libra.routing.predictor import LengthPredictorPolicy

        return LengthPredictorPolicy(buckets, config)
    if name == "static":
        return StaticPolicy(buckets)
    raise ConfigError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")


def _planner_cost(profile: str, batch: int) -> MoveCost:
    model, sep, hardware = profile.partition("@")
    if not sep or not model or not hardware:
        raise ConfigError(
            f"routing.cost_profile {profile!r}: expected MODEL@HARDWARE, e.g. qwen3-14b@a800-80g"
        )
    try:
        from libra.routing.cost import PlannerCost

        return PlannerCost(model, hardware, batch)
    except ImportError:
        raise ConfigError(
            "routing.cost_profile needs the planner (libra.planner), which this install "
            "lacks; leave cost_profile unset for the built-in cost model"
        ) from None


__all__ = ["POLICIES", "make_policy"]
