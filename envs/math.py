"""`math`: DAPO style verified math, one answer per problem.

The model reasons and ends with `<answer>...</answer>` (a final `\\boxed{...}` is
accepted too). Reward 1 when math-verify finds the answer equal to the reference
(numbers, fractions, expressions, LaTeX), else 0; the check runs in killable worker
processes (`verifier.py`), so a pathological answer cannot hang the rollout.

Tasks: `data/math.jsonl` ships 128 problems, 64 from CHAMP (`champ-dataset`) and 64
from `reasoning-gym` generators, made by `data/make_math.py` (more with its flags).
"""

from __future__ import annotations

import re
from typing import Any

from libra.envs.verifier import Verifier

import libra

SYSTEM = (
    "Solve the problem. Think step by step, then give only the final answer inside "
    "<answer> and </answer>, for example <answer>42</answer>."
)
BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def final_answer(trajectory: Any) -> str | None:
    """`<answer>` text, else the last `\\boxed{...}` of the last model message."""
    if trajectory.answer is not None:
        return str(trajectory.answer)
    for msg in reversed(trajectory.messages):
        if msg.get("role") == "assistant" and isinstance(msg.get("content"), str):
            boxed = BOXED.findall(msg["content"])
            return boxed[-1] if boxed else None
    return None


class Math(libra.Env):
    """Verified math; options: `workers` (verifier processes), `verify_timeout_s`."""

    tools = []
    max_turns = 1
    tasks_file = "data/math.jsonl"
    task_fields = ("question", "answer")

    def __init__(self, workers: int = 2, verify_timeout_s: float = 5.0, **options: Any):
        super().__init__(workers=workers, verify_timeout_s=verify_timeout_s, **options)
        self.verifier = Verifier(size=workers, timeout_s=verify_timeout_s)

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task["question"]},
        ]

    async def reward(self, task: dict[str, Any], trajectory: libra.Trajectory) -> Any:
        answer = final_answer(trajectory)
        if answer is None or not answer.strip():
            return 0.0, {"answered": False, "verified": False}
        ok = await self.verifier.verify(str(task["answer"]), answer)
        return float(ok), {"answered": True, "verified": ok}


__all__ = ["Math", "final_answer"]
