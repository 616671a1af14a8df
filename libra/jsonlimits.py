"""How deep untrusted JSON may nest: one limit for every request body Libra parses.

orjson reads 1,024 levels of lists and objects but writes at most 254, and a request's
parts are written again after the check that took them (a submit's tasks: the
idempotency digest, the spool; an agent's tool list: the proxy's cache key, the prompt).
A body between the two limits passed and then failed as an internal error. A request
that nests deeper than `MAX_DEPTH` is refused at the edge instead, with a 400 naming it.
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 64
"""Deepest nesting of lists and objects a task or an agent's request may have (the
outermost object is level 1)."""


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
