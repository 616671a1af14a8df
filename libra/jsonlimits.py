"""How deep JSON from outside Libra's own code may nest: one limit for all of it.

orjson reads 1,024 levels of lists and objects but writes at most 254 (pydantic's
serialiser about as many), and such data is written again after the check that took it:
a submit's tasks (the idempotency digest, the spool), an agent's tool list (the proxy's
cache key) and tool-message `info`, a model's tool-call arguments and an env's reward
and tool info (the trajectory record). Data between the two limits passed and then
failed as an internal error, or left a record that could not be written. Past
`MAX_DEPTH` a request is refused with a 400 naming it, a model's call is a call error,
and an env's info value becomes a note (`libra.rollout.reward.plain`).
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 64
"""Deepest nesting of lists and objects accepted (the outermost object is level 1)."""


def deeper_than(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` nests lists and dicts more than `limit` levels. Iterative: a
    recursion here would be what the check guards against."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        items = v.values() if isinstance(v, dict) else v
        stack.extend((x, depth + 1) for x in items if isinstance(x, dict | list))
    return False


__all__ = ["MAX_DEPTH", "deeper_than"]
