"""What stops a run that can no longer learn, with the reason and the way on.

**Updates skipped.** `Replica.apply` leaves the weights as they were when a step's
gradient holds a NaN or an infinity (one overflow would otherwise spread NaN to every
weight and, published, to every engine). One such step is noise; several in a row mean
the model has diverged or its numbers overflow, and going on only spends the fleet:
`libra train` stops after `trainer.max_skipped_updates` of them in a row, naming the
usual causes.

**Episodes that all fail.** A failed episode is data (reward as scored, usually 0), but
when every episode of a step ended `error` (a reward that returns the wrong type, a
tool or a sandbox that never starts, an endpoint that refuses every request) all its
groups have equal rewards and nothing is learned. `rollout.max_failed_steps` such steps
in a row stop the run, naming the most common error. Errors of the endpoints
(`endpoint: ...`) are the fleet's, which replaces engines that die: a step with one
neither counts nor breaks the row.
"""

from __future__ import annotations

import math
from collections import Counter

from libra.errors import EnvError, TrainerError
from libra.record import ENDPOINT_ERROR


class SkippedUpdates:
    """Counts the steps in a row whose update was skipped. A step that trained on no
    token neither counts nor breaks the row (it says nothing about the gradient)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.steps: list[int] = []

    def after_step(self, step: int, norm: float, tokens: float) -> int:
        """Record step `step` (its gradient norm, its loss tokens); the skipped steps in
        a row, 0 when this one's update was applied."""
        if math.isfinite(norm):
            if tokens > 0:
                self.steps.clear()
            return 0
        self.steps.append(step)
        return len(self.steps)

    @property
    def stop(self) -> bool:
        return len(self.steps) >= self.limit

    def note(self, step: int, norm: float) -> str:
        return (
            f"step {step}: the gradient was not finite (norm {norm}); its update was "
            f"skipped, the weights are unchanged ({len(self.steps)} in a row; the run stops "
            f"at {self.limit})"
        )

    def error(self, checkpointed: int) -> TrainerError:
        """The run's stop, with how to go on from checkpoint `checkpointed`."""
        then = going_on(checkpointed)
        n = len(self.steps)
        which = (f"{n} steps in a row (steps {', '.join(map(str, self.steps))})" if n > 1
                 else f"step {self.steps[0]}")  # fmt: skip
        return TrainerError(
            f"the gradient was not finite in {which}, so no update changed the weights: the "
            "model has diverged or its numbers overflow. Lower trainer.optim.lr, keep "
            'trainer.optim.max_grad_norm set or train in trainer.dtype = "float32"; '
            f"training stopped, the same command {then} (trainer.max_skipped_updates "
            "sets how many in a row stop a run)"
        )


class FailedSteps:
    """Counts the steps in a row in which every episode that finished ended `error`, none
    of them an endpoint's."""

    def __init__(self, limit: int):
        self.limit = limit
        self.steps: list[int] = []
        self.errors: Counter[str] = Counter()
        """The errors of those steps, by reason."""

    def after_step(self, step: int, episodes: int, errors: Counter[str]) -> int:
        """Record step `step`'s finished episodes and their errors by reason; the steps
        in a row that had nothing but errors (0 when this one had another outcome; a
        step with no episode or with an endpoint's error neither counts nor breaks the
        row)."""
        if sum(errors.values()) < episodes:
            self.steps.clear()
            self.errors.clear()
            return 0
        if not episodes or any(r.startswith(ENDPOINT_ERROR) for r in errors):
            return 0
        self.steps.append(step)
        self.errors.update(errors)
        return len(self.steps)

    @property
    def stop(self) -> bool:
        return len(self.steps) >= self.limit

    def note(self, step: int, errors: Counter[str]) -> str:
        return (
            f"step {step}: every episode ended error, nothing to learn from; most common: "
            f"{_top(errors)} ({len(self.steps)} in a row; the run stops at {self.limit})"
        )

    def error(self, checkpointed: int) -> EnvError:
        then = going_on(checkpointed)
        steps = ", ".join(map(str, self.steps))
        return EnvError(
            f"every episode of steps {steps} ended error, so nothing was learned; the most "
            f"common error: {_top(self.errors)}. Fix the env (its records are in "
            "trajectories.jsonl; `libra rollout` runs a few episodes of it alone); "
            f"training stopped, the same command {then} (rollout.max_failed_steps sets "
            "how many such steps in a row stop a run)"
        )


def going_on(checkpointed: int) -> str:
    """What the same command does after a stop, the last checkpoint at `checkpointed`."""
    if checkpointed > 0:
        return f"resumes from its checkpoint at step {checkpointed}"
    return "starts it again (no checkpoint yet)"


def _top(errors: Counter[str]) -> str:
    (reason, n), total = errors.most_common(1)[0], sum(errors.values())
    return f"{reason!r} ({n} of {total})"


__all__ = ["FailedSteps", "SkippedUpdates", "going_on"]
