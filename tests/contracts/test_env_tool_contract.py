"""Every registered env and tool keeps the same contract (built-ins and entry points)."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest
from libra.envs.loading import load_records

import libra
from libra import registry
from libra.env import reward_wants_context

ENV_IDS = registry.envs.known()
TOOL_IDS = registry.tools.known()


def trajectory(env_id: str, task: dict[str, Any], answer: str | None) -> libra.Trajectory:
    return libra.Trajectory(
        id="t0",
        batch_id="b0",
        task_id=str(task.get("id", "x")),
        group_id="g0",
        env=env_id,
        answer=answer,
    )


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_env_ships_tasks_and_renders_prompts(env_id: str) -> None:
    cls = registry.envs.get(env_id)
    assert inspect.isclass(cls) and issubclass(cls, libra.Env)
    assert cls.max_turns >= 1
    path = cls.default_tasks()
    assert path is not None and path.is_file(), f"{env_id}: no shipped task file"
    tasks = load_records(path)
    assert len(tasks) >= 16
    ids = [t["id"] for t in tasks]
    assert len(set(ids)) == len(ids), f"{env_id}: task ids repeat"
    env = cls()
    for task in tasks[:8]:
        messages = env.prompt(task)
        assert messages and messages[-1]["role"] == "user"
        assert all(isinstance(m["content"], str) and m["content"] for m in messages)
        json.dumps(messages)  # goes over the wire as is


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_env_tools_have_unique_valid_schemas(env_id: str) -> None:
    env = registry.envs.get(env_id)()
    tools = list(env.tools)
    names = [t.name for t in tools]
    assert len(set(names)) == len(names)
    for t in tools:
        assert isinstance(t, libra.Tool)
        assert t.schema["function"]["parameters"]["type"] == "object"


@pytest.mark.parametrize("env_id", ENV_IDS)
async def test_env_reward_of_an_unanswered_episode_is_zero(env_id: str) -> None:
    env = registry.envs.get(env_id)()
    task = load_records(env.default_tasks())[0]
    traj = trajectory(env_id, task, None)
    if reward_wants_context(env):
        pytest.skip("reward runs in the episode's sandbox: tested in tests/integration")
    out = await env.reward(task, traj)
    value = (
        out[0] if isinstance(out, tuple) else out.get("reward") if isinstance(out, dict) else out
    )
    assert value == 0.0


@pytest.mark.parametrize("tool_id", TOOL_IDS)
def test_tool_schema_is_an_openai_function(tool_id: str) -> None:
    tool = registry.tools.get(tool_id)
    assert isinstance(tool, libra.Tool)
    fn = tool.schema["function"]
    assert fn["name"] == tool.name and fn["description"]
    params = fn["parameters"]
    assert params["type"] == "object" and params.get("additionalProperties") is False
    for name, prop in params.get("properties", {}).items():
        assert prop.get("description"), f"{tool_id}.{name} has no description"
    assert "ctx" not in params.get("properties", {})
    json.dumps(tool.schema)


@pytest.mark.parametrize("tool_id", TOOL_IDS)
async def test_tool_bad_arguments_are_a_tool_error_not_a_crash(tool_id: str) -> None:
    tool = registry.tools.get(tool_id)
    result = await tool.invoke({"no_such_argument": 1}, libra.Context("e", {}))
    assert result.status == "error" and "invalid arguments" in result.content


@pytest.mark.parametrize("tool_id", TOOL_IDS)
async def test_tool_without_what_it_needs_fails_cleanly(tool_id: str) -> None:
    """Called in a context lacking its sandbox / corpus, a tool says so as an error."""
    tool = registry.tools.get(tool_id)
    props = tool.parameters.get("properties", {})
    required = tool.parameters.get("required", [])
    args = {k: ("1" if props[k].get("type") == "string" else 1) for k in required}
    result = await tool.invoke(args, libra.Context("e", {}))
    assert result.status in ("ok", "error")
    if result.status == "error":
        assert result.content.startswith("Error")
