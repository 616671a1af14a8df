"""An agent function as a Libra env: `async def run(task, client) -> float | dict`.

    async def run(task: dict, client: openai.AsyncOpenAI) -> float:
        reply = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...
        return reward            # or {"reward": r, "answer": "...", **info}

Named like any env (`--env my_agent.py:run`, `--env package.module:run`); `env_options`
become keyword arguments of the function. A function attribute `tasks_file` (a path
relative to its module) gives the tasks used when `--tasks` is not passed. Such an env
runs with `libra.proxy.AgentRunner` (chosen by `libra.rollout.run.episode_runner`).

Imports nothing heavy: `load_env` calls `as_agent` on every path it resolves.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from libra.env import Env
from libra.errors import ConfigError

AgentFn = Callable[..., Awaitable[Any]]


def _is_async(obj: Any) -> bool:
    return inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(
        getattr(obj, "__call__", None)  # noqa: B004 - an async callable object
    )


class AgentEnv(Env):
    """Wraps an agent function; the proxy runner drives it (it has no prompt of its own)."""

    def __init__(self, fn: AgentFn, name: str = "agent", **options: Any):
        super().__init__(**options)
        self.fn = fn
        self.name = name
        try:
            inspect.signature(fn).bind(None, None, **options)
        except TypeError as e:
            raise ConfigError(
                f"agent {name!r} must accept (task, client{''.join(', ' + k for k in options)}): "
                f"{e}; env_options are passed as keyword arguments"
            ) from None

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        raise ConfigError(
            f"agent {self.name!r} writes its own prompts; run it with "
            "libra.rollout.run.episode_runner (an AgentRunner), not an EpisodeRunner"
        )

    def default_tasks(self) -> Path | None:  # type: ignore[override]
        rel = getattr(self.fn, "tasks_file", None)
        if rel is None:
            return None
        module = sys.modules.get(getattr(self.fn, "__module__", ""))
        base = Path(module.__file__).parent if module and module.__file__ else Path.cwd()
        return base / str(rel)

    async def __call__(self, task: dict[str, Any], client: Any) -> Any:
        return await self.fn(task, client, **self.options)


def as_agent(obj: Any, name: str, options: dict[str, Any]) -> AgentEnv | None:
    """An AgentEnv when `obj` is an async function (or async callable), else None."""
    if isinstance(obj, type) or not _is_async(obj):
        return None
    return AgentEnv(obj, name, **options)


__all__ = ["AgentEnv", "AgentFn", "as_agent"]
