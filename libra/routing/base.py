"""The routing-policy interface (DESIGN.md): pure values in, a bucket name out.

The rollout engine and the simulator call a policy with plain immutable values, never
with I/O objects:

    on_start(state)       -> bucket             where the episode's first turn goes
    on_tool_return(state) -> bucket | Decision  after each tool return (same bucket = stay)
    on_finish(record)                           learn from a finished trajectory

The engine then picks the least-loaded healthy endpoint inside the bucket. A policy may
return a `Decision` to explain a move; the explanation lands in `migrations[].reason`.
Policies own no tasks and do no I/O, so the simulator runs exactly the live code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Bucket:
    """A group of endpoints with one tensor-parallel size."""

    name: str
    tp: int
    """Tensor-parallel size of its instances."""
    bound: int
    """Largest total context length (prompt + generated + tool tokens) it serves."""


@dataclass(frozen=True, slots=True)
class ToolState:
    """One tool return as routing sees it."""

    tool: str
    status: str
    """`ok` / `error` / `timeout`."""
    payload_tokens: int
    """Size of the response appended to the context; policies classify it."""


@dataclass(frozen=True, slots=True)
class EpisodeState:
    episode_id: str
    task_id: str
    prompt_tokens: int
    tokens_so_far: int
    """Current context length: prompt + everything generated and appended."""
    tool_returns: tuple[ToolState, ...]
    """Ordered tool-return states so far (all turns)."""
    bucket: str
    """Bucket currently serving the episode."""
    turn: int = 0
    """Index of the next turn."""
    prompt_token_ids: tuple[int, ...] = ()
    """The rendered prompt's token ids; engines pass them to `on_start` (a length
    predictor reads them), and may leave them out later."""


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing answer with its explanation (recorded on a migration)."""

    bucket: str
    reason: str = ""


@runtime_checkable
class RoutingPolicy(Protocol):
    def on_start(self, state: EpisodeState) -> str: ...

    def on_tool_return(self, state: EpisodeState) -> str | Decision: ...

    def on_finish(self, record: Any) -> None: ...


def smallest_fitting(buckets: Sequence[Bucket], tokens: int) -> str:
    """Name of the smallest bucket whose bound fits `tokens` (the largest if none does)."""
    for b in sorted(buckets, key=lambda b: b.bound):
        if tokens <= b.bound:
            return b.name
    return max(buckets, key=lambda b: b.bound).name


class StaticPolicy:
    """The default before C-MLFQ: the smallest bucket that fits the prompt; never moves."""

    name = "static"

    def __init__(self, buckets: Sequence[Bucket]):
        if not buckets:
            raise ValueError("a routing policy needs at least one bucket")
        self.buckets = tuple(sorted(buckets, key=lambda b: b.bound))

    def on_start(self, state: EpisodeState) -> str:
        return smallest_fitting(self.buckets, state.prompt_tokens)

    def on_tool_return(self, state: EpisodeState) -> str | Decision:
        return state.bucket

    def on_finish(self, record: Any) -> None:
        return None

    def end_step(self, step: int | None = None) -> None:
        return None


def default_bounds(names: Sequence[str], max_context: int, min_bound: int = 1024) -> list[int]:
    """Bounds that split [min_bound, max_context] evenly in log space; the last is
    `max_context`."""
    n = len(names)
    if n == 1:
        return [max_context]
    lo = math.log(min(min_bound, max_context))
    hi = math.log(max_context)
    return [round(math.exp(lo + (hi - lo) * (i + 1) / n)) for i in range(n - 1)] + [max_context]


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
