"""A toy env with a reward a freshly initialised tiny model can learn, for
`examples/train_from_stream.py`: the share of the letter "a" in the model's reply.

Hosted by `libra serve-rollout examples/serve-rollout.toml` as `say-a`.
"""

from __future__ import annotations

from typing import Any

import libra


class SayA(libra.Env):
    """One turn, no tools; reward = fraction of the reply's characters that are "a"."""

    max_turns = 1
    # Rows in verl's or TRL's layout (examples/trl_grpo.py) map their prompt's question
    # here; the answer column is required by that mapping and unused by the reward.
    task_fields = ("question", "answer")

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": task["question"]}]

    async def reward(self, task: dict[str, Any], trajectory: libra.Trajectory) -> float:
        reply = "".join(m["content"] for m in trajectory.messages if m["role"] == "assistant")
        return reply.lower().count("a") / max(1, len(reply))
