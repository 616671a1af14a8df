"""Held-out validation while training: version v is validated right after it is
published, on v's weights only (the loop publishes v + 1 only once it finished)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from libra.record import Trajectory
from libra.rollout.batch import Runner, run_episodes
from libra.rollout.tasks import episode_specs
from libra.train.display import View
from libra.train.report import Report
from libra.train.state import LoopState


@dataclass(slots=True)
class Validation:
    runner: Runner
    tasks: list[dict[str, Any]]
    every: int
    """Validate versions 0, every, 2 * every, ... and the last one."""
    steps: int

    def due(self, version: int) -> bool:
        return version % self.every == 0 or version == self.steps

    async def run(self, version: int, state: LoopState, report: Report, view: View) -> None:
        """Validate `version` (greedy or as configured); results go to `state`, the
        panel and the event log."""
        records: list[Trajectory] = []
        specs = list(episode_specs(self.tasks, 1, f"val-v{version}", version))
        view.validating = len(specs)

        def emit(r: Trajectory) -> None:
            records.append(r)
            view.validating -= 1

        t0 = time.monotonic()
        await run_episodes(self.runner, specs, concurrency=len(specs), emit=emit)
        reward = sum(r.reward for r in records) / max(len(records), 1)
        state.val_version, state.val_reward = version, reward
        view.val_version, view.val_reward = version, reward
        report.event(
            "validation",
            version=version,
            reward=reward,
            episodes=len(records),
            not_ok=sum(r.status != "ok" for r in records),
            wall_s=time.monotonic() - t0,
        )


__all__ = ["Validation"]
