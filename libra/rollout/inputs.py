"""What an episode starts from: its own copy of the task, and the prompt its env made
from it, checked."""

from __future__ import annotations

import copy
from typing import Any

import orjson


async def own_task(task: dict[str, Any], offload: Any) -> dict[str, Any]:
    """A copy of `task` for one episode: the episodes of a group share one task object,
    so an env that wrote to `ctx.task` changed what its siblings saw (a tool appending
    to the answer: the group's rewards read `done!`, `done!!`, ...). Copied on a worker
    thread when it is large (its size as JSON; a task JSON cannot hold is copied here).
    The copy is the task's JSON read back, in C (`deepcopy`, pure Python, held the GIL
    56 ms for a 0.6 MB task, stalling the event loop beside its thread), unless that is
    not equal to the task (a tuple, a NaN): then `deepcopy` copies it."""
    try:
        data = orjson.dumps(task)
    except TypeError:
        return copy.deepcopy(task)

    def copied(_tok: Any) -> dict[str, Any]:
        out = orjson.loads(data)
        return out if out == task else copy.deepcopy(task)

    return await offload.run(len(data), copied)


def check_prompt(messages: Any) -> None:
    """`env.prompt`'s value is chat messages (a str, or messages without a `role`,
    rendered as an empty prompt: the episode ran on no question at all)."""
    fix = 'return a list of chat messages: [{"role": "user", "content": "..."}]'
    if not isinstance(messages, list) or not messages:
        raise TypeError(f"env.prompt returned {_kind(messages)}; {fix}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TypeError(f"env.prompt's message {i} is {_kind(m)} without a 'role'; {fix}")


def _kind(x: Any) -> str:
    if isinstance(x, list) and not x:
        return "an empty list"
    return f"a {type(x).__name__}"


__all__ = ["check_prompt", "own_task"]
