"""An env's own code at the edges of a run (its constructor, `reward`'s signature,
`close`, `prompt` in the dry run) and tasks handed over in Python: what it does wrong is
one error naming it, or a logged warning, never a traceback, a hang or a silent mix-up."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import libra
from libra import registry
from libra.env import reward_wants_context
from libra.errors import ConfigError
from libra.rollout import run
from libra.rollout.layouts import adapt_tasks
from libra.rollout.run import close_env, load_env
from libra.rollout.tasks import given_tasks, unique_ids


class Plain(libra.Env):
    def prompt(self, task: dict[str, Any]) -> str:
        return "q"


def test_a_constructor_that_raises_is_one_error_naming_the_env() -> None:
    class Broken(Plain):
        def __init__(self, **kw: Any) -> None:
            raise ValueError("nope")

    class Exits(Plain):
        def __init__(self, **kw: Any) -> None:
            raise SystemExit(4)

    registry.envs.register("test-broken", Broken)
    registry.envs.register("test-exits", Exits)
    with pytest.raises(ConfigError, match="env 'test-broken' failed to start: ValueError: nope"):
        load_env("test-broken", {})
    with pytest.raises(ConfigError, match="env 'test-exits' failed to start: SystemExit: 4"):
        load_env("test-exits", {})


def test_only_a_third_positional_parameter_gets_the_context() -> None:
    """`reward(self, task, trajectory, *, scale=1.0)` was handed the context as a
    fourth positional argument: every episode an error."""

    class KwOnly(Plain):
        async def reward(self, task: Any, trajectory: Any, *, scale: float = 1.0) -> float:  # type: ignore[override]
            return scale

    class Kwargs(Plain):
        async def reward(self, task: Any, trajectory: Any, **kw: Any) -> float:  # type: ignore[override]
            return 1.0

    class Ctx(Plain):
        async def reward(self, task: Any, trajectory: Any, ctx: Any) -> float:  # type: ignore[override]
            return 1.0

    class Star(Plain):
        async def reward(self, task: Any, *args: Any) -> float:  # type: ignore[override]
            return 1.0

    assert [reward_wants_context(c()) for c in (Plain, KwOnly, Kwargs, Ctx, Star)] == [
        False, False, False, True, True,
    ]  # fmt: skip


def test_close_that_hangs_or_fails_is_logged_and_the_job_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A `close` that never returned kept `libra rollout` running after its last record;
    a plain `def close` or one that raised ended it with a traceback."""

    class Hangs(Plain):
        async def close(self) -> None:
            await asyncio.sleep(3600)

    class Sync(Plain):
        def close(self) -> None:  # type: ignore[override]
            self.closed = True

    class Raises(Plain):
        async def close(self) -> None:
            raise RuntimeError("bad close")

    monkeypatch.setattr(run, "CLOSE_S", 0.2)
    sync = Sync()
    with caplog.at_level(logging.WARNING, logger="libra.rollout"):
        for env in (Hangs(), sync, Raises()):
            asyncio.run(asyncio.wait_for(close_env(env), 10))
    assert sync.closed
    said = caplog.text
    assert "env.close did not return within 0.2 s" in said
    assert "env.close failed: RuntimeError: bad close" in said


def test_tasks_given_in_python_are_checked_as_a_file_s() -> None:
    for tasks, says in (
        ([], "a non-empty list"),
        ("abc", "a non-empty list"),
        (["str"], "task 1 is a str, not a dict"),
        ([{"id": "a"}, None], "task 2 is a NoneType"),
        ([{"id": "a", "x": b"\xff"}], "task 1 is not JSON"),
        ([{"id": "a"}, {"id": "a"}], "task 2 repeats the id 'a' of task 1"),
    ):
        with pytest.raises(ConfigError, match=says):
            given_tasks(tasks, "rollout(tasks=...)")


def test_ids_are_unique_after_verl_rows_are_mapped() -> None:
    """A verl row's id comes from `extra_info.index`: `arith-1` beside a row of that id
    gave four records with two ids, in one group."""
    rows = [
        {"id": "arith-1", "question": "What is 2 + 3?", "answer": "5"},
        {"data_source": "arith", "prompt": [{"role": "user", "content": "What is 1 + 1?"}],
         "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 1}},
    ]  # fmt: skip
    unique_ids(rows, "t.jsonl")  # as read: no two ids alike
    mapped = adapt_tasks(rows, ("question", "answer"), env="arith", source="t.jsonl")
    with pytest.raises(ConfigError, match="t.jsonl: task 2 repeats the id 'arith-1'"):
        unique_ids(mapped, "t.jsonl")


def test_task_fields_and_on_record_of_the_wrong_kind_are_named() -> None:
    """`task_fields = "question"` (a str) was a ValueError traceback at the first TRL
    row; an async `on_record` was never awaited (a RuntimeWarning, no record seen)."""
    from libra.rollout.config import RolloutConfig
    from libra.rollout.run import check_env, rollout

    class Fields(Plain):
        task_fields = "question"  # type: ignore[assignment]

    with pytest.raises(ConfigError, match="task_fields is 'question'; give"):
        check_env(Fields(), "fields")

    async def seen(rec: Any) -> None:
        pass

    with pytest.raises(ConfigError, match="on_record is an async function"):
        asyncio.run(rollout(RolloutConfig(env="arith"), on_record=seen))
    with pytest.raises(ValueError, match="batch_id"):
        RolloutConfig(env="arith", batch_id="")
