"""The warm start's recipe: its learning rate warms up and then decays to a floor at the
last step, and `target` ends it at the first evaluation that reaches it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from libra.trainer.sft import EVAL_EVERY, FLOOR, WARMUP, lr_factor, run_sft
from tests.integration.test_trainer_sft import demos


def test_rate_warms_up_then_decays_to_the_floor_at_the_last_step():
    steps = 600
    rates = [lr_factor(s, steps) for s in range(steps + 1)]
    assert rates[0] == pytest.approx(1 / WARMUP)
    assert max(rates) == pytest.approx(1.0, abs=5e-3) and rates.index(max(rates)) == WARMUP - 1
    after = rates[WARMUP - 1 :]
    assert all(a >= b for a, b in itertools.pairwise(after))  # never rises again
    assert rates[steps // 2] == pytest.approx(FLOOR + (1 - FLOOR) / 2, abs=1e-2)
    assert rates[-1] == pytest.approx(FLOOR)


def test_target_stops_at_the_first_evaluation_that_reaches_it(tiny_model: Path, tmp_path: Path):
    seen = []
    res = run_sft(
        tiny_model, demos(40), tmp_path / "sft", steps=10 * EVAL_EVERY, batch=4, lr=1e-3,
        target=1e-30, seed=0, held_out=4, on_progress=seen.append,
    )  # fmt: skip
    assert res.stopped == "target" and res.steps % EVAL_EVERY == 0
    assert res.steps < 10 * EVAL_EVERY and len(seen) == res.steps  # no step after it
    assert seen[-1].seq_prob == res.seq_prob >= 1e-30
    earlier = [p.seq_prob for p in seen if p.step % EVAL_EVERY == 0][:-1]
    assert all(p is not None and p < 1e-30 for p in earlier)  # the first that reached it
    assert (tmp_path / "sft" / "config.json").is_file()  # what it reached is written


def test_without_reaching_it_every_step_runs(tiny_model: Path, tmp_path: Path):
    res = run_sft(
        tiny_model, demos(40), tmp_path / "sft", steps=EVAL_EVERY + 3, batch=4, lr=1e-3,
        target=1.0, seed=0, held_out=4,
    )  # fmt: skip
    assert (res.stopped, res.steps) == ("steps", EVAL_EVERY + 3)
