"""Routing policies (pure): which bucket serves an episode's next turn."""

from libra.routing.base import (
    Bucket,
    Decision,
    EpisodeState,
    RoutingPolicy,
    StaticPolicy,
    ToolState,
    default_bounds,
    smallest_fitting,
)
from libra.routing.config import RoutingConfig
from libra.routing.cost import MoveCost, PlannerCost, TPScaledCost
from libra.routing.factory import POLICIES, make_policy

__all__ = [
    "POLICIES",
    "Bucket",
    "Decision",
    "EpisodeState",
    "MoveCost",
    "PlannerCost",
    "RoutingConfig",
    "RoutingPolicy",
    "StaticPolicy",
    "TPScaledCost",
    "ToolState",
    "default_bounds",
    "make_policy",
    "smallest_fitting",
]
