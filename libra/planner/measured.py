"""What each assignment measured, so the planner predicts it from its own step times.

The cost model ranks assignments; on a real machine its absolute times are off, and not
by one factor for all assignments: on two shared cores a second training replica took
cores from the rollout engines, so training did not get faster although the model said
twice as fast (docs/benchmarks.md). So every step that ran wholly in one assignment
records that assignment's factors, measured / modelled, for training and for rollout
(the model evaluated on the very workload of that step). An option is then predicted
as its modelled time on the current workload times *its own* factors (the median of its
last `WINDOW` steps), and only an option that has never run borrows the factors of the
assignment that ran last. A switch that measured no gain is therefore seen as such at
the next decision, and the planner moves back when the plan it replaced is faster by
the hysteresis band and the move pays for itself.

Pure: no clock, no I/O. `to_dict` / `from_dict` keep it across a resume.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from libra.planner.search import iteration_time, run_time

if TYPE_CHECKING:
    from libra.planner.replan import Signals
    from libra.planner.search import Plan

WINDOW = 4
"""Steps per assignment whose factors are kept (the median of these is used)."""

Scale = tuple[float, float]
"""(train, rollout) factors: measured seconds / modelled seconds."""


def ratio(measured: float, modelled: float) -> float:
    """measured / modelled, 1.0 where either is missing or not finite."""
    if measured > 0 and modelled > 0 and math.isfinite(modelled):
        return measured / modelled
    return 1.0


@dataclass(slots=True)
class Measurements:
    """Per-assignment factors of the steps each assignment ran."""

    window: int = WINDOW
    factors: dict[Hashable, deque[Scale]] = field(default_factory=dict)
    last: Hashable | None = None
    """The assignment that ran most recently."""

    def add(self, assignment: Hashable, scale: Scale) -> None:
        kept = self.factors.setdefault(assignment, deque(maxlen=self.window))
        kept.append(scale)
        self.last = assignment

    def steps(self, assignment: Hashable) -> int:
        return len(self.factors.get(assignment, ()))

    def own(self, assignment: Hashable) -> Scale | None:
        """The assignment's own factors (medians), or None if it never ran."""
        kept = self.factors.get(assignment)
        if not kept:
            return None
        return (
            statistics.median(t for t, _ in kept),
            statistics.median(r for _, r in kept),
        )

    def scale(self, assignment: Hashable, fallback: Scale) -> tuple[Scale, str]:
        """Factors to predict `assignment` with, and where they come from: `own`, the
        assignment that ran `last`, or the `step` just measured (`fallback`)."""
        own = self.own(assignment)
        if own is not None:
            return own, "own"
        last = self.own(self.last) if self.last is not None else None
        if last is not None:
            return last, "last"
        return fallback, "step"

    def to_dict(self, key: Any) -> list[dict[str, Any]]:
        """[{"assignment": key(a), "factors": [[train, rollout], ...], "last": bool}]."""
        return [
            {"assignment": key(a), "factors": [list(s) for s in kept], "last": a == self.last}
            for a, kept in self.factors.items()
        ]

    @classmethod
    def from_dict(cls, rows: list[dict[str, Any]], parse: Any) -> Measurements:
        m = cls()
        for row in rows:
            a = parse(row["assignment"])
            m.factors[a] = deque(((s[0], s[1]) for s in row["factors"]), maxlen=m.window)
            if row.get("last"):
                m.last = a
        return m


@dataclass(frozen=True, slots=True)
class Timed:
    """A plan's times after calibration to this run's measurements."""

    t_train: float
    t_rollout: float
    t_sync: float = 0.0
    """Weight sync, counted only when `sync`."""
    sync: bool = False
    """Rollout and training alternate (a synchronous or colocated plan): an iteration
    costs their sum plus the weight sync; otherwise the slower of the two."""

    @property
    def t_iter(self) -> float:
        return iteration_time(self.t_rollout, self.t_train, self.t_sync, sync=self.sync)

    def run_s(self, steps: int) -> float:
        """Seconds for `steps` more iterations (`libra.planner.search.run_time`)."""
        return run_time(self.t_rollout, self.t_train, self.t_sync, steps, sync=self.sync)

    @classmethod
    def of(cls, p: Plan, scale: tuple[float, float]) -> Timed:
        return cls(p.t_train * scale[0], p.t_rollout * scale[1], p.sync_s, p.sync)


def calibration(plan: Plan, signals: Signals) -> Scale:
    """(train, rollout) factors measured / modelled of the assignment that ran this
    step (`plan`: the model's times for it on this step's workload). 1.0 where nothing
    was measured."""
    return ratio(signals.train_s, plan.t_train), ratio(signals.rollout_s, plan.t_rollout)


__all__ = ["WINDOW", "Measurements", "Scale", "Timed", "calibration", "ratio"]
