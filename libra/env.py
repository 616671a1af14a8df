"""`libra.Env`: the base class of a tool environment.

The smallest complete environment (DESIGN.md):

    class Adder(libra.Env):
        tools = [add]
        max_turns = 4
        def prompt(self, task): return [{"role": "user", "content": task["question"]}]
        async def reward(self, task, trajectory): return float(trajectory.answer == task["answer"])

One Env instance serves a whole run (constructed with the config's `env.options` as
keyword arguments); per-episode resources live on the `libra.Context` that `setup`
receives and that tools asking for it get. `reward` may take a third parameter, the
context, when it needs them (e.g. to run tests in the episode's sandbox).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from libra.tooling import Context, Tool

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
"""The answer tags; `last_answer` finds the last pair the way `ANSWER_RE.findall` does,
in linear time."""

_OPEN, _CLOSE = "<answer>", "</answer>"


def last_answer(text: str) -> str | None:
    """The text of the last `<answer>...</answer>` pair (the last of
    `ANSWER_RE.findall(text)`, stripped), or None. It runs on the event loop at every
    model turn, and the regex is quadratic on a turn of unclosed `<answer>` tags (a
    degenerate policy's 128,000 characters of them: 10 s); a scan with `str.find` is
    linear."""
    found, at = None, 0
    while (start := text.find(_OPEN, at)) >= 0:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            break
        found, at = text[start + len(_OPEN) : end], end + len(_CLOSE)
    return None if found is None else found.strip()


class Env:
    """Subclass and set `tools`, `max_turns`; implement `prompt` and `reward`."""

    tools: ClassVar[Sequence[Tool]] = ()
    """Tools the model may call (built with `@libra.tool`)."""
    max_turns: ClassVar[int] = 8
    """Model turns per episode before it ends `truncated`."""
    stop: ClassVar[tuple[str, ...]] = ("</answer>",)
    """Strings that end a model turn besides the end-of-turn token (the answer's close)."""
    tool_parser: ClassVar[str] = "auto"
    """How the model writes tool calls, named as vLLM's `--tool-call-parser` names them:
    `hermes`, `qwen3_coder`, `llama3_json`, `mistral`; `auto`: the format the model's
    chat template renders (`libra.toolcalls`)."""
    tasks_file: ClassVar[str | None] = None
    """A small task file shipped with the env (used when `--tasks` is not given),
    relative to the module defining the env."""
    task_fields: ClassVar[tuple[str, str] | None] = None
    """The task fields `prompt` and `reward` read for the question and its answer, e.g.
    `("question", "answer")`: task files in verl's or TRL's layout are then mapped to them
    (`libra.rollout.layouts`). None: rows reach the env as they are."""

    def __init__(self, **options: Any):
        self.options = options

    # --- what a user implements -------------------------------------------------
    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """Chat messages that open the episode."""
        raise NotImplementedError(f"{type(self).__name__}.prompt(task) is not implemented")

    async def reward(self, task: dict[str, Any], trajectory: Any) -> Any:
        """Score a finished trajectory: a float, `(float, info_dict)`, or
        `{"reward": float, ...info}`. Default: 0."""
        return 0.0

    # --- optional hooks -----------------------------------------------------------
    async def setup(self, ctx: Context) -> None:
        """Acquire per-episode resources (e.g. `ctx.sandbox = await ...`)."""

    async def teardown(self, ctx: Context) -> None:
        """Release what `setup` acquired; runs even when the episode failed."""

    async def close(self) -> None:
        """Release what the env holds for the whole run (e.g. a sandbox backend); called
        once when the job that created the env ends."""

    def tools_for(self, task: dict[str, Any]) -> Sequence[Tool]:
        """Tools offered for this task (default: `tools`)."""
        return self.tools

    def parse_answer(self, text: str) -> str | None:
        """The final answer in a model turn's text, or None (default: last `<answer>`)."""
        return last_answer(text)

    @classmethod
    def default_tasks(cls) -> Path | None:
        if cls.tasks_file is None:
            return None
        module = inspect.getmodule(cls)
        base = Path(module.__file__).parent if module and module.__file__ else Path.cwd()
        return base / cls.tasks_file


def overrides(env: Env, hook: str) -> bool:
    """Whether `env` has its own `hook`, not Env's."""
    return hook in vars(env) or getattr(type(env), hook) is not getattr(Env, hook)


def reward_wants_context(env: Env) -> bool:
    """Whether `env.reward` takes the context: a third positional parameter (or
    `*args`); keyword-only ones and `**kwargs` are not places for it."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = inspect.signature(env.reward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in positional for p in params) >= 3


__all__ = ["ANSWER_RE", "Env", "last_answer", "overrides", "reward_wants_context"]
