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

__all__ = [
    "Bucket",
    "Decision",
    "EpisodeState",
    "RoutingPolicy",
    "StaticPolicy",
    "ToolState",
    "default_bounds",
    "smallest_fitting",
]
