"""The episode runner calls an env's setup/teardown only when the env has its own, and
runs its own `parse_answer` in a worker thread (Libra's runs inline)."""

from __future__ import annotations

from typing import Any

import libra
from libra.env import overrides


class Plain(libra.Env):
    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return []


class WithHooks(Plain):
    async def setup(self, ctx: libra.Context) -> None:
        ctx.state["set"] = True

    async def teardown(self, ctx: libra.Context) -> None:
        ctx.state.clear()


def test_only_an_env_s_own_hooks_count() -> None:
    assert not overrides(Plain(), "setup") and not overrides(Plain(), "teardown")
    assert overrides(WithHooks(), "setup") and overrides(WithHooks(), "teardown")
    env = Plain()

    async def setup(ctx: libra.Context) -> None:
        pass

    env.setup = setup  # type: ignore[method-assign]
    assert overrides(env, "setup") and not overrides(env, "teardown")

    class OwnAnswers(Plain):
        def parse_answer(self, text: str) -> str | None:
            return text

    assert overrides(OwnAnswers(), "parse_answer") and not overrides(Plain(), "parse_answer")
