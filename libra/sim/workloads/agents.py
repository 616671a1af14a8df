"""How a simulated agent uses its tools: what it calls next and what a result does to it.

Three patterns cover the built-in workloads:

- `GoalAgent` (search, math): call a tool until the task has enough useful results,
  then answer. A result that brings nothing may make it give up; an episode that is
  *stuck* never makes progress and runs into the turn or context limit.
- `SweAgent` (repository repair): explore (search / view files), reproduce the bug, then
  cycles of edit and test until the tests pass. A failing test run is a tool `error`
  with a long log; the next turn diagnoses it.
- `SearchAgent` (`search-r1-causal`): a goal agent on a web search backend whose
  returns show what happened: empty result lists, and malformed actions from
  degenerate episodes.

An agent owns no randomness of its own: every draw comes from the episode's generator,
so a seeded episode replays exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from libra.sim.workloads.spec import ToolSpec

OUTCOME_USEFUL = "useful"
OUTCOME_MISS = "miss"
OUTCOME_RETRY = "retry"


@dataclass(frozen=True, slots=True)
class Call:
    tool: ToolSpec
    fails: bool = False
    """The call fails for task reasons (a failing test run), not by chance."""


class Agent(Protocol):
    done: bool
    """The agent answers next turn."""

    def act(self, rng: np.random.Generator) -> Call: ...

    def observe(self, call: Call, status: str, rng: np.random.Generator) -> str: ...

    @property
    def solved(self) -> bool: ...


class GoalAgent:
    def __init__(
        self, tools: tuple[ToolSpec, ...], need: int, skill: float, give_up: float, stuck: bool
    ):
        self.tools = tools
        self.weights = np.array([t.weight for t in tools]) / sum(t.weight for t in tools)
        self.need = need
        self.skill = skill
        self.give_up = give_up
        self.stuck = stuck
        self.progress = 0
        self.errors_in_row = 0
        self.done = False

    def act(self, rng: np.random.Generator) -> Call:
        if len(self.tools) == 1:
            return Call(self.tools[0])
        return Call(self.tools[int(rng.choice(len(self.tools), p=self.weights))])

    def observe(self, call: Call, status: str, rng: np.random.Generator) -> str:
        if status != "ok":
            self.errors_in_row += 1
            # Three failures in a row: the model stops calling and answers.
            self.done = self.errors_in_row >= 3
            return OUTCOME_RETRY
        self.errors_in_row = 0
        if not self.stuck and rng.random() < self.skill:
            self.progress += 1
            self.done = self.progress >= self.need
            return OUTCOME_USEFUL
        self.done = not self.stuck and rng.random() < self.give_up
        return OUTCOME_MISS

    @property
    def solved(self) -> bool:
        return self.progress >= self.need


class SweAgent:
    """explore -> reproduce -> (edit -> test)* -> submit.

    `need` is how many edit/test cycles the fix takes; `skill` is the chance an
    exploration step finds the relevant code (an unlucky explorer looks longer).
    """

    def __init__(
        self, tools: tuple[ToolSpec, ...], need: int, skill: float, give_up: float, stuck: bool
    ):
        by_name = {t.name: t for t in tools}
        self.explore = [by_name["search"], by_name["view"]]
        self.run = by_name["bash"]
        self.edit = by_name["edit"]
        self.need = need
        self.skill = skill
        self.give_up = give_up
        self.stuck = stuck
        self.phase = "explore"
        self.found = False
        self.cycles = 0
        self.passed = False
        self.errors_in_row = 0
        self.done = False

    def act(self, rng: np.random.Generator) -> Call:
        if self.phase == "explore":
            return Call(self.explore[int(rng.random() < 0.5)])
        if self.phase == "reproduce":
            return Call(self.run, fails=True)  # the bug reproduces: non-zero exit
        if self.phase == "edit":
            return Call(self.edit)
        # test: this run is cycle `cycles + 1`; it passes once the fix needs no more
        # cycles (never for a stuck episode)
        return Call(self.run, fails=self.stuck or self.cycles + 1 < self.need)

    def observe(self, call: Call, status: str, rng: np.random.Generator) -> str:
        if status == "timeout" or (status == "error" and not call.fails):
            self.errors_in_row += 1
            self.done = self.errors_in_row >= 4
            return OUTCOME_RETRY
        self.errors_in_row = 0
        if self.phase == "explore":
            if rng.random() < self.skill:
                # Half the time the agent writes a fix straight away instead of first
                # reproducing the bug.
                self.phase = "reproduce" if rng.random() < 0.5 else "edit"
                return OUTCOME_USEFUL
            return OUTCOME_MISS
        if self.phase == "reproduce":
            self.phase = "edit"
            return OUTCOME_USEFUL
        if self.phase == "edit":
            self.phase = "test"
            return OUTCOME_USEFUL
        # test run
        self.cycles += 1
        if status == "ok":
            self.passed = True
            self.done = True
            return OUTCOME_USEFUL
        # failing tests: look around again sometimes, otherwise edit again
        self.phase = "explore" if rng.random() < 0.3 else "edit"
        self.done = not self.stuck and rng.random() < self.give_up
        return OUTCOME_MISS

    @property
    def solved(self) -> bool:
        return self.passed


class SearchAgent:
    """A Search-R1-style agent on a web search backend (`search-r1-causal`).

    Its tool specs play three roles, by name, all recorded as the one call `search`:
    `search` (a result list), `search-empty` (the engine found nothing) and `invalid`
    (a malformed action, answered with Search-R1's invalid-action message). Their
    `weight`s are chances, not picking weights:

    - a query for a question the web serves badly comes back empty with chance
      `search-empty.weight * (1 - skill)`; the agent reformulates (a miss);
    - a result list holds the evidence with chance `skill`; once the task has its
      `need` useful results the agent answers; after a miss it may give up;
    - a *stuck* episode is a degenerate loop (reasoning collapsed into broken tags):
      each of its calls is malformed with chance `invalid.weight`, it never makes
      progress and never stops on errors, so it runs into the turn or context limit.
      A healthy agent answers after three failed calls in a row.
    """

    def __init__(
        self, tools: tuple[ToolSpec, ...], need: int, skill: float, give_up: float, stuck: bool
    ):
        by_name = {t.name: t for t in tools}
        self.results = by_name["search"]
        self.empty = by_name["search-empty"]
        self.invalid = by_name["invalid"]
        self.need = need
        self.skill = skill
        self.give_up = give_up
        self.stuck = stuck
        self.progress = 0
        self.errors_in_row = 0
        self.done = False

    def act(self, rng: np.random.Generator) -> Call:
        if self.stuck and rng.random() < self.invalid.weight:
            return Call(self.invalid, fails=True)
        if rng.random() < self.empty.weight * (1.0 - self.skill):
            return Call(self.empty)
        return Call(self.results)

    def observe(self, call: Call, status: str, rng: np.random.Generator) -> str:
        if status != "ok":
            self.errors_in_row += 1
            self.done = not self.stuck and self.errors_in_row >= 3
            return OUTCOME_RETRY
        self.errors_in_row = 0
        if call.tool is self.results and not self.stuck and rng.random() < self.skill:
            self.progress += 1
            self.done = self.progress >= self.need
            return OUTCOME_USEFUL
        self.done = not self.stuck and rng.random() < self.give_up
        return OUTCOME_MISS

    @property
    def solved(self) -> bool:
        return self.progress >= self.need


AGENTS: dict[str, Callable[..., Agent]] = {
    "goal": GoalAgent,
    "swe": SweAgent,
    "search": SearchAgent,
}

__all__ = ["AGENTS", "Agent", "Call", "GoalAgent", "SearchAgent", "SweAgent"]
