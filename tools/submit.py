"""`submit`: hand in the final answer (or declare the work done) through a tool call.

For envs where the answer is not free text at the end of a turn (code repair: "I am
done"), or models trained to finish with a call. The answer is kept on the episode's
context (`ctx.state["submitted"]`); the env's reward reads it with `submitted(ctx)`.
Nothing is checked here, so the model learns nothing about correctness before reward.
"""

from __future__ import annotations

from typing import Any

import libra


@libra.tool(timeout=10)
def submit(ctx: libra.Context, answer: str = "") -> str:
    """Submit your final answer (or, with no answer, declare the task done).

    Args:
        answer: the final answer; empty when the work itself is the answer.
    """
    ctx.state["submitted"] = answer
    return "Submitted."


def submitted(ctx: Any) -> str | None:
    """The submitted answer of an episode, or None if `submit` was not called."""
    state = getattr(ctx, "state", None) or {}
    value = state.get("submitted")
    return value if isinstance(value, str) else None


__all__ = ["submit", "submitted"]
