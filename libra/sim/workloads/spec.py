"""What a workload is made of: its tasks, its tools and how its turns are sized.

A `WorkloadSpec` holds every number a generator uses; `docs/workloads.md` gives the
source of each. Distributions are log-normal, given as (median, sigma of the log).
Specs are frozen values: `spec.replace(field=value)` (or `sample(..., params={...})`)
makes a variant, e.g. for a held-out trace family.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

LogNormal = tuple[float, float]
"""(median, sigma of the natural log)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    name: str
    """Key inside the workload (an agent asks for tools by it)."""
    call: str = ""
    """Tool name recorded on the trajectory (default: `name`); two specs may share one,
    e.g. a file editor's `view` and `edit` commands."""
    weight: float = 1.0
    """Relative chance the agent picks this tool where it may pick any (explore phase)."""
    ok_payload: LogNormal
    """Tokens of a successful response."""
    error_payload: LogNormal
    """Tokens of a failed response (error message, traceback, failing test log)."""
    max_payload: int
    """Observations are truncated to this many tokens (the env's own cap)."""
    p_error: float
    """Chance a call fails by itself (malformed call, invalid action) before drift."""
    p_timeout: float
    """Chance a call runs out of time."""
    latency_s: LogNormal
    """Wall time of a call that returns."""
    timeout_s: float
    """Wall time of a call that times out."""

    @property
    def call_name(self) -> str:
        return self.call or self.name


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskClass:
    """A kind of prompt in the dataset (e.g. single-hop vs multi-hop questions)."""

    name: str
    weight: float
    """Share of the dataset."""
    question_tokens: LogNormal
    """Tokens of the task text (added to the prompt template)."""
    need: tuple[int, int]
    """Useful tool results (or edit/test cycles) the task needs, inclusive range."""
    skill: tuple[float, float]
    """Beta(a, b) of the per-task chance that a tool result is useful: per-prompt
    difficulty."""
    p_direct: float = 0.0
    """Chance an episode answers without calling any tool."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadSpec:
    name: str
    agent: str
    """Tool-use pattern: `goal` (call until enough useful results) or `swe` (explore,
    reproduce, then edit/test cycles)."""
    dataset_size: int
    """Prompts in the training set; steps walk through it epoch by epoch."""
    max_context: int
    """Longest total context; an episode that reaches it ends `truncated`."""
    max_turns: int
    prompt_template_tokens: int
    """System prompt + instructions + chat template around the task text."""
    tool_message_tokens: int
    """Template tokens around each tool response (role tags, wrappers)."""
    classes: tuple[TaskClass, ...]
    tools: tuple[ToolSpec, ...]
    turn_tokens: float
    """Median model tokens of an ordinary turn (reasoning + call)."""
    first_turn: float
    """Multiplier for the first turn (planning)."""
    final_turn: float
    """Multiplier for the answering turn."""
    fix_turn: float
    """Multiplier for a turn that follows an error or timeout (diagnosis / retry)."""
    sigma_turn: float
    """Turn-to-turn noise (log)."""
    sigma_episode: float
    """Per-episode verbosity (log): the same prompt sampled twice reasons at different
    lengths."""
    sigma_task: float
    """Per-prompt verbosity (log): some prompts make every sample long."""
    miss_growth: float
    """Each unproductive tool result lengthens later turns by this fraction."""
    read_coef: float
    """Extra model tokens per payload token in the next turn (digesting the return)."""
    p_give_up: float
    """After an unproductive result, chance the agent answers anyway."""
    p_stuck: float
    """Chance an episode loops without progress until the turn or context limit, scaled
    by how hard the prompt is (1 - skill)."""
    drift_len: float
    """Relative growth of turn length per 100 training steps."""
    drift_tool: float
    """Relative change of the need for tool results per 100 steps (more searching)."""
    error_halflife: float
    """Steps over which malformed-call errors halve as the policy learns the format."""
    error_floor: float
    """Share of the initial malformed-call rate that never goes away."""
    version: int = 1
    """Generator version of the family. A change that alters a family's output is a new
    version with new frozen files (`tests/data/*-vN.jsonl.gz`), never a silent rewrite."""

    def replace(self, **changes: Any) -> WorkloadSpec:
        """A copy with some fields changed; unknown names raise `TypeError`."""
        return dataclasses.replace(self, **changes)


__all__ = ["LogNormal", "TaskClass", "ToolSpec", "WorkloadSpec"]
