"""What stops `libra train` when it can no longer learn. Steps whose update the trainer
skipped (a gradient that was not finite), and steps whose episodes all ended `error`:
each counted in a row, reset by a step that went otherwise, untouched by a step that
says nothing, and at the limit a stop naming the steps, the cause and how to resume."""

from __future__ import annotations

import math
from collections import Counter

from libra.errors import EnvError, TrainerError
from libra.train.guards import FailedSteps, SkippedUpdates
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


def test_steps_whose_episodes_all_failed_stop_the_run_naming_the_error():
    """A reward returning `{"score": 1}` made every episode `error` and the run trained
    on nothing to its last step, exit 0, saying only `reward 0.000`."""
    bad = "reward: the returned dict has no 'reward' key"
    s = FailedSteps(3)
    assert s.after_step(1, 8, Counter({bad: 8})) == 1
    assert s.after_step(2, 8, Counter({bad: 7})) == 0  # one that did not fail: a new row
    assert s.after_step(3, 0, Counter()) == 0  # nothing finished: says nothing
    assert s.after_step(4, 8, Counter({bad: 6, "KeyError: 'x'": 2})) == 1
    # the endpoints' errors are the fleet's (it replaces engines): neither way
    assert s.after_step(5, 8, Counter({bad: 4, "endpoint: http://h:1: HTTP 500": 4})) == 0
    assert s.after_step(6, 8, Counter({bad: 8})) == 2 and not s.stop
    assert f"most common: {bad!r} (8 of 8)" in s.note(6, Counter({bad: 8}))
    assert s.after_step(7, 4, Counter({bad: 4})) == 3 and s.stop
    err = s.error(checkpointed=5)
    assert isinstance(err, EnvError)
    msg = str(err)
    assert "every episode of steps 4, 6, 7 ended error" in msg
    assert f"the most common error: {bad!r} (18 of 20)" in msg
    assert "resumes from its checkpoint at step 5" in msg
