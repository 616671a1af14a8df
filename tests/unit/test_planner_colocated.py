"""Issue #16: the colocated (time-shared) plan is a candidate of the planner.

- `plan_colocated`: every GPU trains, then every GPU rolls out (engines with
  `colocated_memory` of each device); an iteration is the sum of both plus weight sync.
- `plan(..., colocated=True)` returns it exactly when its predicted iteration is shorter.
- Over a few remaining steps a pipelined plan also pays the end it cannot overlap, so the
  replan policy moves to a time-shared plan that is no faster per step only when few
  steps remain; the hysteresis keeps it from moving over a long run.
"""

from __future__ import annotations

import json

import pytest

from libra.cli import main
from libra.planner import (
    PlannerSettings,
    ReplanPolicy,
    WorkloadStats,
    evaluate_plan,
    load_hardware,
    load_model,
    plan,
    plan_colocated,
    reconfig_cost,
)
from libra.planner.measured import Timed
from libra.sim import workloads

MODEL, HW = load_model("qwen3-14b"), load_hardware("a800-80g")


def stats(prompts: int = 32, seed: int = 0) -> WorkloadStats:
    return WorkloadStats.from_records(workloads.sample("search-r1", prompts, 16, seed=seed))


def test_a_colocated_plan_time_shares_every_gpu():
    s = stats()
    p = plan_colocated(MODEL, HW, s, 24)
    assert p.colocated and p.sync and p.mode == "colocated"
    assert p.train_gpus == 24 and 0 < p.rollout_gpus <= 24 and p.idle_gpus >= 0
    assert p.t_iter == pytest.approx(p.t_rollout + p.t_train + p.sync_s)
    assert p.as_dict()["mode"] == "colocated"
    # Its engines get less memory beside the training state: less KV than a split's.
    roomy = plan_colocated(MODEL, HW, s, 24, PlannerSettings(colocated_memory=0.9))
    kv = {g.tp: g.kv_capacity_tokens for g in p.rollout.groups}
    assert all(kv[g.tp] < g.kv_capacity_tokens for g in roomy.rollout.groups if g.tp in kv)


def test_plan_returns_the_colocated_plan_exactly_when_it_is_predicted_faster():
    for sync in (False, True):
        settings = PlannerSettings(sync=sync)
        for gpus, prompts in ((24, 128), (48, 32)):
            s = stats(prompts)
            split = plan(MODEL, HW, s, gpus, settings)
            shared = plan_colocated(MODEL, HW, s, gpus, settings)
            chosen = plan(MODEL, HW, s, gpus, settings, colocated=True)
            assert chosen.colocated == (shared.t_iter < split.t_iter)
            assert chosen.t_iter == min(split.t_iter, shared.t_iter)
            assert not plan(MODEL, HW, s, gpus, settings).colocated  # only when asked
    # Synchronous RL waits for both sides anyway: giving each all the GPUs wins.
    assert plan(MODEL, HW, stats(), 48, PlannerSettings(sync=True), colocated=True).colocated


def test_a_colocated_plan_is_re_timed_as_one_and_moving_to_it_restarts_every_engine():
    s0, s1 = stats(seed=0), stats(seed=1)
    shared = plan_colocated(MODEL, HW, s0, 24)
    again = evaluate_plan(shared, MODEL, HW, s1)
    assert again.colocated and again.sync
    assert again.t_rollout == pytest.approx(plan_colocated(MODEL, HW, s1, 24).t_rollout, rel=0.05)
    split = plan(MODEL, HW, s0, 24)
    cost = reconfig_cost(split, shared, MODEL, HW)
    assert cost.detail["instances_added"] == shared.rollout.mix()  # all of them
    assert cost.detail["rollout_gpus_started"] == shared.rollout_gpus


def test_moving_to_a_time_shared_plan_drains_the_pipeline_at_the_move():
    """A pipelined plan's `run_s` pays its last batch's training after everything rolled
    out; a move to an alternating plan pays, at the move, the training of the batch in
    flight in the new plan (nothing beside it). An equal plan that trains faster is
    worth the move for what it saves at the end, not for a whole end, and only at the
    last step: earlier, the same saving would come after as many equal steps."""
    overlapped = Timed(t_train=100.0, t_rollout=100.0)  # 100 s per step, + 100 s at the end
    shared = Timed(t_train=50.0, t_rollout=48.0, t_sync=2.0, sync=True)  # 100 s per step
    assert overlapped.t_iter == shared.t_iter == 100.0
    assert overlapped.run_s(3) == 400.0 and shared.run_s(3) == 300.0
    near_end = ReplanPolicy().decide(overlapped, shared, 3, reconfig=10.0)
    assert not near_end.apply and "only at the run's end" in near_end.reason
    assert near_end.predicted_gain_s == pytest.approx(400.0 - 300.0 - 50.0)
    last = ReplanPolicy().decide(overlapped, shared, 1, reconfig=10.0)
    assert last.apply and last.predicted_gain_s == pytest.approx(200.0 - 100.0 - 50.0)
    slow_trainer = Timed(t_train=90.0, t_rollout=8.0, t_sync=2.0, sync=True)  # 100 s too
    d = ReplanPolicy().decide(overlapped, slow_trainer, 1, reconfig=10.0)
    assert not d.apply and d.predicted_gain_s == pytest.approx(200.0 - 100.0 - 90.0)
    long_run = ReplanPolicy().decide(overlapped, shared, 1000, reconfig=10.0)
    assert not long_run.apply and "only at the run's end" in long_run.reason
    # And the other way: a time-shared plan is not left for one that only looks equal.
    assert not ReplanPolicy().decide(shared, overlapped, 3, reconfig=0.0).apply


def test_libra_plan_colocated_prints_the_time_shared_plan_when_it_wins(capsys):
    argv = ["plan", "--gpus", "24", "--workload", "search-r1", "--batch", "32", "--sync"]
    assert main([*argv, "--colocated", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mode"] == "colocated" and doc["train_gpus"] == doc["gpus"] == 24
    assert doc["t_iter_s"] < doc["search"]["disaggregated_t_iter_s"]
    assert main([*argv, "--colocated"]) == 0
    assert "colocated (time-shared" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0  # without the flag: a split, as before
    assert json.loads(capsys.readouterr().out)["mode"] == "sync"


def test_moving_back_from_a_change_that_measured_no_gain_needs_no_hysteresis():
    """A change made on a prediction measured 2% slower than the plan it left: moving
    back is a revert, which the band (meant for near-equal predictions) does not hold up;
    a move to any other plan 2% faster still is."""
    now, left = Timed(t_train=90.0, t_rollout=102.0), Timed(t_train=90.0, t_rollout=100.0)
    assert not ReplanPolicy().decide(now, left, 8, reconfig=1.0).apply
    d = ReplanPolicy().decide(now, left, 8, reconfig=1.0, revert=True)
    assert d.apply
    assert not ReplanPolicy().decide(now, left, 8, reconfig=100.0, revert=True).apply  # cost
