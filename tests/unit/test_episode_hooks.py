"""The episode runner calls an env's setup/teardown only when the env has its own."""

from __future__ import annotations

from typing import Any

import libra
from libra.rollout.episode import _overrides


class Plain(libra.Env):
    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return []


class WithHooks(Plain):
    async def setup(self, ctx: libra.Context) -> None:
        ctx.state["set"] = True

    async def teardown(self, ctx: libra.Context) -> None:
        ctx.state.clear()


def test_only_an_env_s_own_hooks_count() -> None:
    assert not _overrides(Plain(), "setup") and not _overrides(Plain(), "teardown")
    assert _overrides(WithHooks(), "setup") and _overrides(WithHooks(), "teardown")
    env = Plain()

    async def setup(ctx: libra.Context) -> None:
        pass

    env.setup = setup  # type: ignore[method-assign]
    assert _overrides(env, "setup") and not _overrides(env, "teardown")
