"""Groups of episodes, the task stream they are drawn from, and per-step tallies."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from libra.record import Trajectory
from libra.rollout.episode import EpisodeSpec
from libra.rollout.tasks import task_id


@dataclass(slots=True)
class TaskStream:
    """Training tasks in a seeded shuffled order, epoch after epoch; `position` resumes."""

    tasks: Sequence[dict[str, Any]]
    seed: int
    position: int = 0

    def next(self) -> dict[str, Any]:
        n = len(self.tasks)
        epoch, i = divmod(self.position, n)
        order = list(range(n))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        self.position += 1
        return self.tasks[order[i]]


@dataclass(slots=True)
class Group:
    """G episodes of one task, started at one policy version."""

    key: str
    task: dict[str, Any]
    version: int
    size: int
    records: list[Trajectory] = field(default_factory=list)

    def specs(self, batch_id: str, first_index: int) -> list[EpisodeSpec]:
        tid = task_id(self.task)
        return [
            EpisodeSpec(
                id=f"{self.key}/{k}",
                batch_id=batch_id,
                task_id=tid,
                group_id=self.key,
                task=self.task,
                index=first_index + k,
                step=self.version,
            )
            for k in range(self.size)
        ]

    @property
    def done(self) -> bool:
        return len(self.records) == self.size

    def all_equal(self) -> bool:
        rewards = [r.reward for r in self.records]
        return max(rewards) - min(rewards) < 1e-9


@dataclass(slots=True)
class Tally:
    """What finished between two training steps (training episodes only)."""

    started: float = field(default_factory=time.monotonic)
    episodes: int = 0
    reward_sum: float = 0.0
    model_tokens: int = 0
    total_tokens: int = 0
    migrations: int = 0
    not_ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    """Episodes that ended `error`, or `truncated` before a token, by reason (its first
    120 characters)."""
    dropped: int = 0
    kept_equal: int = 0
    busy_s: float = 0.0
    """Seconds with at least one training episode in flight."""

    def add(self, g: Group) -> None:
        for r in g.records:
            self.episodes += 1
            self.reward_sum += r.reward
            self.model_tokens += r.model_tokens
            self.total_tokens += r.total_tokens
            self.migrations += len(r.migrations)
            self.not_ok += r.status != "ok"
            if r.status == "error" or (r.status == "truncated" and not r.model_tokens):
                # truncated before its first token (a prompt past the context): nothing
                # to learn from either (a run of them ended `done`, having trained on none)
                self.errors[(r.error or "no reason given")[:120]] += 1

    @property
    def reward(self) -> float | None:
        return self.reward_sum / self.episodes if self.episodes else None


class Busy:
    """Accumulates the time during which a counter is above zero."""

    def __init__(self) -> None:
        self.n = 0
        self.since = 0.0
        self.total = 0.0

    def up(self) -> None:
        if self.n == 0:
            self.since = time.monotonic()
        self.n += 1

    def down(self) -> None:
        self.n -= 1
        if self.n == 0:
            self.total += time.monotonic() - self.since

    def take(self) -> float:
        """Busy seconds since the last take."""
        now = time.monotonic()
        out = self.total + (now - self.since if self.n else 0.0)
        self.total = 0.0
        if self.n:
            self.since = now
        return out


__all__ = ["Busy", "Group", "Tally", "TaskStream"]
