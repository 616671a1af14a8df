"""Demonstrations for the supervised warm start: a scripted expert plays episodes of the
real env, token for token as the rollout engine would record them.

A random model gives all-zero reward groups, and GRPO gets no gradient from those. So
`libra train` first fits the model to a few hundred demonstrations. An *expert* is a
function `(task, messages) -> assistant text` that sees the conversation so far. The
episode around it is the rollout engine's: the prompt is rendered once
(`ChatTokenizer.prompt_ids`), a turn ends with the end-of-turn token unless it ended on an
env stop string such as `</answer>` (which is then the last token, as when a stop token
id ends a generation), tool calls are parsed with the Hermes parser and *run* (the real
tools), and their responses are appended as the rendered delta (loss mask 0). The env's
own reward scores the result; only demonstrations with reward > 0 are kept.

Built-in experts: `arith` (call the calculator on the question's expression, answer with
what it returned). Another env names its expert as `module:function` in
`[sft] expert`.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from libra import usercode
from libra.chat import ChatTokenizer
from libra.env import Env, reward_wants_context
from libra.errors import ConfigError
from libra.record import ToolReturn, Trajectory, Turn
from libra.rollout.episode import _as_reward, _maybe_await
from libra.rollout.toolrun import run_calls
from libra.toolcalls import HermesParser
from libra.tooling import Context

Expert = Callable[[dict[str, Any], list[dict[str, Any]]], str]


def arith_expert(task: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """`arith`: one calculator call on the expression, then the answer it returned."""
    if messages and messages[-1]["role"] == "tool":
        return f"<answer>{messages[-1]['content'].strip()}</answer>"
    m = re.search(r"What is (.+)\?", task["question"])
    if m is None:
        raise ConfigError(f"arith expert: cannot find an expression in {task['question']!r}")
    call = {"name": "calculator", "arguments": {"expression": m.group(1)}}
    return f"<tool_call>\n{orjson.dumps(call).decode()}\n</tool_call>"


BUILTIN: dict[str, Expert] = {"arith": arith_expert}


def load_expert(spec: str | None, env_name: str) -> Expert:
    """The expert named by `spec` (`module:function`), or the built-in one for the env."""
    if spec is None:
        if env_name not in BUILTIN:
            raise ConfigError(
                f"sft: no built-in expert for env {env_name!r} (built-in: "
                f"{', '.join(BUILTIN)}); set [sft] expert = 'module:function' or steps = 0"
            )
        return BUILTIN[env_name]
    if spec in BUILTIN:
        return BUILTIN[spec]
    module, sep, name = spec.partition(":")
    if not sep:
        raise ConfigError(f"sft.expert {spec!r}: expected 'module:function' or a built-in id")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"sft.expert {spec!r} does not resolve: {e}") from None
    if not callable(fn):
        raise ConfigError(f"sft.expert {spec!r} is not a function")
    return fn


async def demonstrate(
    env: Env,
    env_name: str,
    tok: ChatTokenizer,
    task: dict[str, Any],
    expert: Expert,
    *,
    task_id: str = "",
) -> Trajectory:
    """One expert episode as a trajectory record (reward from the env)."""
    tools = list(env.tools_for(task))
    schemas = [t.schema for t in tools] or None
    by_name = {t.name: t for t in tools}
    messages = list(env.prompt(task))
    prompt = tok.prompt_ids(messages, schemas)
    eos = tok.eos_token_ids[0]
    stops = {tid for s in env.stop if (tid := tok.token_id(s)) is not None}
    rec = Trajectory(
        id=f"demo/{task_id}",
        batch_id="demo",
        task_id=task_id,
        group_id=f"demo/{task_id}",
        env=env_name,
        step=0,
    )
    response: list[int] = []
    mask: list[int] = []
    ctx = Context(episode_id=rec.id, task=task, env=env)
    await env.setup(ctx)
    try:
        for _ in range(env.max_turns):
            text = expert(task, messages)
            ids = tok.encode(text)
            closed = not (ids and ids[-1] in stops)
            if closed:
                ids.append(eos)
            turn = Turn(
                start=len(response),
                model_tokens=len(ids),
                tool_tokens=0,
                bucket="demo",
                endpoint="expert",
                policy_version=0,
                finish_reason="stop",
            )
            rec.turns.append(turn)
            response += ids
            mask += [1] * len(ids)
            messages.append({"role": "assistant", "content": text})
            answer = env.parse_answer(text)
            if answer is not None:
                rec.answer = answer
                break
            calls = HermesParser().parse(text)
            if not calls:
                break
            outcomes = await run_calls(calls, ctx, by_name, max_calls=8, timeout_cap_s=None)
            tool_msgs = [
                {"role": "tool", "name": o.call.name, "content": o.result.content} for o in outcomes
            ]
            turn.tool_returns = [
                ToolReturn(
                    tool=o.call.name,
                    status=o.result.status,
                    payload_tokens=len(tok.encode(o.result.content)),
                    latency_s=o.latency_s,
                )
                for o in outcomes
            ]
            delta = tok.delta_ids(tool_msgs, schemas, model_closed_turn=closed)
            messages += tool_msgs
            turn.tool_tokens = len(delta)
            response += delta
            mask += [0] * len(delta)
        rec.prompt_token_ids, rec.prompt_tokens = prompt, len(prompt)
        rec.response_token_ids, rec.loss_mask = response, mask
        rec.logprobs = []
        rec.total_tokens = len(prompt) + len(response)
        rec._messages = messages
        if reward_wants_context(env):
            out = await _maybe_await(env.reward(task, rec, ctx))  # type: ignore[call-arg]
        else:
            out = await _maybe_await(env.reward(task, rec))
        rec.reward, rec.reward_info = _as_reward(out)
    finally:
        await env.teardown(ctx)
    return rec


async def demonstrations(
    env: Env,
    env_name: str,
    tok: ChatTokenizer,
    tasks: Sequence[dict[str, Any]],
    expert: Expert,
) -> list[Trajectory]:
    """Expert episodes for `tasks`, keeping those the env rewards (> 0)."""
    from libra.rollout.tasks import task_id

    out = []
    for task in tasks:
        try:
            rec = await demonstrate(env, env_name, tok, task, expert, task_id=task_id(task))
        except Exception as e:  # the env's code on a row it cannot read: the data's fault
            raise ConfigError(
                f"sft: the {env_name} env cannot run task {task_id(task)!r} "
                f"({usercode.describe(e)}); check that the task file's rows have the "
                "fields this env reads"
            ) from None
        if rec.reward > 0:
            out.append(rec)
    if not out:
        raise ConfigError(
            f"sft: the expert earned no reward on {len(tasks)} {env_name} tasks; "
            "check the expert against the env"
        )
    return out


__all__ = ["BUILTIN", "Expert", "arith_expert", "demonstrate", "demonstrations", "load_expert"]
