"""What a policy learns from: any finished-episode record with these attributes.

`libra.Trajectory` has them; so does the lighter record `libra eval-routing` parses
(traces from other tools need only these fields).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class ToolReturnLike(Protocol):
    @property
    def tool(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def payload_tokens(self) -> int: ...


class TurnLike(Protocol):
    model_tokens: int
    tool_tokens: int

    @property
    def tool_returns(self) -> Sequence[ToolReturnLike]: ...


class FinishedEpisode(Protocol):
    task_id: str
    step: int
    prompt_tokens: int
    total_tokens: int

    @property
    def turns(self) -> Sequence[TurnLike]: ...


LEARNABLE = frozenset({"ok", "truncated", "timeout"})
"""Statuses whose length is a natural end (or the cap it ran into); `error` and
`aborted` episodes stopped for reasons that say nothing about their length."""


def learnable(record: FinishedEpisode) -> bool:
    return getattr(record, "status", "ok") in LEARNABLE


def total_of(record: FinishedEpisode) -> int:
    """`total_tokens`, or the sum of its parts when a trace left it out."""
    if record.total_tokens:
        return record.total_tokens
    return record.prompt_tokens + sum(t.model_tokens + t.tool_tokens for t in record.turns)


__all__ = [
    "LEARNABLE",
    "FinishedEpisode",
    "ToolReturnLike",
    "TurnLike",
    "learnable",
    "total_of",
]
