"""The causal episode generator shared by every workload.

An episode is simulated turn by turn, in the order a live rollout runs:

    model turn (reasoning + call)  ->  tool return (status, payload)  ->  next model turn ...

and what a tool returns decides what follows: an error or timeout brings a diagnosis /
retry turn, an unproductive result lengthens later reasoning and may make the agent give
up, a large payload lengthens the next turn (the model digests it), and the task's need
for useful results decides when the agent answers. Per-prompt latents (difficulty,
verbosity, how many results it needs) stay fixed across steps, so a prompt seen again in
a later epoch behaves alike; drift over training steps lengthens reasoning, makes agents
persist longer and removes format errors.

Everything is drawn from generators seeded by (seed, workload, step, prompt, sample), so
a trace is reproducible and independent of how many prompts are asked for at once.
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from libra.record import EpisodeStatus, Trajectory
from libra.sim.workloads.agents import AGENTS, OUTCOME_MISS, Call
from libra.sim.workloads.spec import LogNormal, TaskClass, WorkloadSpec

TIMEOUT_PAYLOAD = 16
"""Tokens of the message an env appends when a tool times out."""


@dataclass(frozen=True, slots=True)
class Task:
    index: int
    cls: TaskClass
    prompt_tokens: int
    need: int
    skill: float
    """Chance that one tool result (or exploration step) is useful."""
    scale: float
    """Per-prompt verbosity multiplier."""


def _seed(spec: WorkloadSpec, seed: int, *parts: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(spec.name.encode()), *parts])


def _lognormal(rng: np.random.Generator, dist: LogNormal) -> float:
    median, sigma = dist
    return float(median * math.exp(sigma * rng.standard_normal()))


def make_task(spec: WorkloadSpec, seed: int, index: int) -> Task:
    """The latents of dataset prompt `index`: the same every time it is drawn."""
    rng = _seed(spec, seed, 0, index)
    weights = np.array([c.weight for c in spec.classes])
    cls = spec.classes[int(rng.choice(len(spec.classes), p=weights / weights.sum()))]
    question = max(1, round(_lognormal(rng, cls.question_tokens)))
    need = int(rng.integers(cls.need[0], cls.need[1] + 1))
    skill = float(rng.beta(*cls.skill))
    scale = math.exp(spec.sigma_task * rng.standard_normal())
    return Task(index, cls, spec.prompt_template_tokens + question, need, skill, scale)


@functools.lru_cache(maxsize=8)
def _epoch_order(spec_name: str, size: int, seed: int, epoch: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(spec_name.encode()), 1, epoch])
    return rng.permutation(size)


def step_tasks(spec: WorkloadSpec, n_prompts: int, step: int, seed: int) -> list[int]:
    """Dataset indices of step `step`: positions [step*n, (step+1)*n) of the dataset
    walked epoch by epoch, each epoch in its own seeded order (a shuffling loader)."""
    out = []
    for pos in range(step * n_prompts, (step + 1) * n_prompts):
        epoch, offset = divmod(pos, spec.dataset_size)
        out.append(int(_epoch_order(spec.name, spec.dataset_size, seed, epoch)[offset]))
    return out


def episode(
    spec: WorkloadSpec, task: Task, *, step: int, seed: int, sample: int, group_id: str
) -> Trajectory:
    """Simulate one episode of `task` started by policy version `step`."""
    # One validation of plain data is ~3x faster than constructing the nested models.
    return Trajectory.model_validate(
        episode_data(spec, task, step=step, seed=seed, sample=sample, group_id=group_id)
    )


def episode_data(
    spec: WorkloadSpec, task: Task, *, step: int, seed: int, sample: int, group_id: str
) -> dict[str, Any]:
    """`episode` as the plain data of a trajectory record (not validated): what the
    cluster simulator reads, for which validating every record costs more than it tells."""
    rng = _seed(spec, seed, 2, step, task.index, sample)
    length_drift = 1.0 + spec.drift_len * step / 100
    persist = 1.0 / (1.0 + spec.drift_tool * step / 100)
    format_errors = spec.error_floor + (1 - spec.error_floor) * 0.5 ** (step / spec.error_halflife)
    verbosity = spec.turn_tokens * task.scale * length_drift
    verbosity *= math.exp(spec.sigma_episode * rng.standard_normal())
    stuck = rng.random() < spec.p_stuck * (1.0 - task.skill)
    agent = AGENTS[spec.agent](spec.tools, task.need, task.skill, spec.p_give_up * persist, stuck)
    answer_now = rng.random() < task.cls.p_direct * persist

    ctx = task.prompt_tokens
    turns: list[dict[str, Any]] = []
    status: EpisodeStatus = "ok"
    misses = 0
    last_status, last_payload = "ok", 0
    tool_s = 0.0
    for t in range(spec.max_turns):
        final = answer_now or agent.done or t == spec.max_turns - 1
        if t == 0:
            mult = spec.first_turn
        elif final:
            mult = spec.final_turn
        elif last_status != "ok":
            mult = spec.fix_turn
        else:
            mult = 1.0
        gen = verbosity * mult * (1.0 + spec.miss_growth * misses)
        gen = gen * math.exp(spec.sigma_turn * rng.standard_normal())
        gen += spec.read_coef * last_payload
        model_tokens = max(1, round(gen))
        turn: dict[str, Any] = {
            "start": ctx - task.prompt_tokens,
            "model_tokens": model_tokens,
            "tool_tokens": 0,
            "bucket": "",
            "endpoint": "",
            "policy_version": step,
            "finish_reason": "stop",
        }
        turns.append(turn)
        if ctx + model_tokens >= spec.max_context:
            turn["model_tokens"] = spec.max_context - ctx
            turn["finish_reason"] = "length"
            ctx, status = spec.max_context, "truncated"
            break
        ctx += model_tokens
        if final:
            break

        call: Call = agent.act(rng)
        ret = _tool_return(call, rng, format_errors)
        tool_s += ret["latency_s"]
        tool_tokens = ret["payload_tokens"] + spec.tool_message_tokens
        truncated = ctx + tool_tokens >= spec.max_context
        if truncated:
            tool_tokens = spec.max_context - ctx
        turn["tool_tokens"] = tool_tokens
        turn["tool_calls"] = [{"name": ret["tool"]}]
        turn["tool_returns"] = [ret]
        ctx += tool_tokens
        if truncated:
            status = "truncated"
            break
        if agent.observe(call, ret["status"], rng) == OUTCOME_MISS:
            misses += 1
        last_status, last_payload = ret["status"], ret["payload_tokens"]

    return {
        "id": f"{group_id}/{sample}",
        "batch_id": f"{spec.name}/step-{step}",
        "task_id": _task_id(spec, task),
        "group_id": group_id,
        "env": spec.name,
        "step": step,
        "status": status,
        "reward": 1.0 if status == "ok" and agent.solved else 0.0,
        "prompt_tokens": task.prompt_tokens,
        "total_tokens": ctx,
        "turns": turns,
        "timings": {"tool_s": round(tool_s, 4)},
    }


def _tool_return(call: Call, rng: np.random.Generator, format_errors: float) -> dict[str, Any]:
    """What the tool sends back: a timeout, a failure (by the task or by chance), or a
    result, with its size (capped by the env) and wall time."""
    tool = call.tool
    if rng.random() < tool.p_timeout:
        status, payload, latency = "timeout", TIMEOUT_PAYLOAD, tool.timeout_s
    else:
        failed = call.fails or rng.random() < tool.p_error * format_errors
        status = "error" if failed else "ok"
        size = _lognormal(rng, tool.error_payload if failed else tool.ok_payload)
        payload = min(tool.max_payload, max(1, round(size)))
        latency = _lognormal(rng, tool.latency_s)
    return {
        "tool": tool.call_name,
        "status": status,
        "payload_tokens": payload,
        "latency_s": round(latency, 4),
    }


def _task_id(spec: WorkloadSpec, task: Task) -> str:
    return f"{spec.name}/{task.index}"


__all__ = ["TIMEOUT_PAYLOAD", "Task", "episode", "episode_data", "make_task", "step_tasks"]
