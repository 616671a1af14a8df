"""Updates the trainer skipped because their gradient was not finite.

`Replica.apply` leaves the weights as they were when a step's gradient holds a NaN or
an infinity (one overflow would otherwise spread NaN to every weight and, published,
to every engine). One such step is noise; several in a row mean the model has diverged
or its numbers overflow, and going on only spends the fleet: `libra train` stops after
`trainer.max_skipped_updates` of them in a row, naming the usual causes.
"""

from __future__ import annotations

import math

from libra.errors import TrainerError


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
        then = (f"resumes from its checkpoint at step {checkpointed}" if checkpointed > 0
                else "starts it again (no checkpoint yet)")  # fmt: skip
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


__all__ = ["SkippedUpdates"]
