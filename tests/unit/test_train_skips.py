"""`libra train` after steps whose update the trainer skipped (a gradient that was not
finite): counted in a row, reset by an applied update, untouched by a step with nothing
to train, and at the limit a stop that names the steps, the causes and how to resume."""

from __future__ import annotations

import math

from libra.errors import TrainerError
from libra.train.skips import SkippedUpdates
from libra.trainer.report import StepResult
from libra.trainer.stepstats import step_grad_norm

NAN, INF = math.nan, math.inf


def test_skipped_updates_in_a_row_stop_the_run_with_the_causes_and_the_resume():
    s = SkippedUpdates(3)
    assert s.after_step(1, 0.4, 100) == 0
    assert s.after_step(2, NAN, 100) == 1
    assert s.after_step(3, 0.5, 100) == 0  # an applied update breaks the row
    assert s.after_step(4, NAN, 100) == 1
    assert s.after_step(5, 0.0, 0) == 0  # nothing trained: says nothing either way
    assert s.after_step(6, INF, 100) == 2 and not s.stop
    assert "step 6: the gradient was not finite (norm inf)" in s.note(6, INF)
    assert s.after_step(7, NAN, 100) == 3 and s.stop
    err = s.error(checkpointed=4)
    assert isinstance(err, TrainerError)
    msg = str(err)
    assert "not finite in 3 steps in a row (steps 4, 6, 7)" in msg
    assert "trainer.optim.lr" in msg and "resumes from its checkpoint at step 4" in msg
    assert "starts it again (no checkpoint yet)" in str(s.error(checkpointed=0))
    one = SkippedUpdates(1)
    one.after_step(9, NAN, 10)
    assert "not finite in step 9, so no update changed" in str(one.error(checkpointed=8))


def test_a_step_reports_a_skipped_minibatch_update_even_when_its_last_one_applied():
    def res(norm: float) -> StepResult:
        return StepResult(update=1, applied=True, contributed=True, grad_norm=norm)

    assert step_grad_norm([res(0.3), res(0.7)]) == 0.7
    assert math.isnan(step_grad_norm([res(0.3), res(NAN), res(0.7)]))
    assert step_grad_norm([]) == 0.0
