"""The hostile-but-legal workloads of `libra bench service --stall`, hosted by the service
under test (config `[[envs]]` entries name them by path).

- `StallTool`: its tool returns 10 MB of text and its reward is a plain function that
  sleeps 3 s (both legal: Libra must cope without stalling its event loop).
- `huge_prompt_agent`: an agent function whose first request carries a 6 MB message.
"""

from __future__ import annotations

import time
from typing import Any

import libra

TOOL_BYTES = 10 * 1024 * 1024
REWARD_SLEEP_S = 3.0
PROMPT_BYTES = 6 * 1024 * 1024


@libra.tool
async def noop(x: int) -> str:
    """Return a lot of text (the instant server's model calls `noop`)."""
    return "stall " * (TOOL_BYTES // 6)


class StallTool(libra.Env):
    tools = [noop]
    max_turns = 4

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"Task {task['id']}: call noop, then answer."}]

    def reward(self, task: dict[str, Any], trajectory: Any) -> float:  # type: ignore[override]
        time.sleep(REWARD_SLEEP_S)  # a blocking reward, as user code may well be
        return 1.0


async def huge_prompt_agent(task: dict[str, Any], client: Any) -> float:
    """One request with a 6 MB user message; the proxy refuses it (it cannot fit)."""
    import openai

    text = "lorem ipsum dolor sit amet " * (PROMPT_BYTES // 27)
    try:
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": text}]
        )
    except openai.BadRequestError:
        return 0.0
    return 1.0


__all__ = ["StallTool", "huge_prompt_agent"]
