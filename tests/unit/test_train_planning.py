"""The planner in the training loop: options timed by the cost model, calibrated to what
the step measured, applied only past the hysteresis band and the reconfiguration cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.planner import ReplanPolicy, Signals, WorkloadStats, load_hardware, load_model
from libra.planner.replan import ReplanConfig
from libra.sim import workloads
from libra.train.config import TrainConfig
from libra.train.planning import Assignment, FleetShape, Replanner, SwitchCosts, Workload
from libra.train.setup import planner_settings

COSTS = SwitchCosts(to_train_s=12.0, to_rollout_s=6.0)


def replanner(model: Path, **replan: float) -> Replanner:
    policy = ReplanPolicy(ReplanConfig(every_steps=1, cooldown_steps=0, **replan))
    return Replanner(
        FleetShape(core_rollout=1, core_train=1, hybrids=1),
        load_model(str(model)),
        load_hardware("a800-80g"),
        planner_settings(TrainConfig()),
        policy,
        Assignment(0, 1),  # the hybrid serves rollouts
    )


def work() -> Workload:
    stats = WorkloadStats.from_records(workloads.sample("search-r1", 4, 4, seed=1))
    return Workload(rollout=stats, train=stats)


def modelled(r: Replanner) -> dict[int, tuple[float, float]]:
    _, _, plans = r.best(work())
    return {a.train: (p.t_train, p.t_rollout) for a, p in plans.items()}


def test_training_bound_step_moves_the_hybrid_to_training(tiny_model: Path) -> None:
    r = replanner(tiny_model)
    t_train, t_rollout = modelled(r)[0]
    # measured: training takes 10x the rollout -> a second replica pays off
    signals = Signals(step=1, train_s=100.0, rollout_s=10.0)
    decision, target = r.consider(signals, work(), 50, COSTS) or (None, None)
    assert decision is not None and decision.apply and target == Assignment(1, 1)
    entry = r.log[-1]
    assert entry["calibration"]["train"] == 100.0 / t_train
    assert entry["calibration"]["rollout"] == 10.0 / t_rollout
    assert entry["current"]["t_iter_s"] == pytest.approx(100.0)  # calibrated: the measured step
    assert decision.predicted_gain_s > decision.reconfig_cost_s * 1.5
    assert decision.reconfig_cost_s == COSTS.to_train_s / 3  # idle seconds over 3 devices
    assert r.current == Assignment(1, 1)


def test_a_gain_below_the_switch_cost_is_not_applied(tiny_model: Path) -> None:
    r = replanner(tiny_model)
    signals = Signals(step=1, train_s=100.0, rollout_s=10.0)
    decision, _ = r.consider(signals, work(), 1, SwitchCosts(1e4, 1e4)) or (None, None)
    assert decision is not None and not decision.apply
    assert "does not exceed cost" in decision.reason
    assert r.current == Assignment(0, 1)


def test_hysteresis_keeps_a_plan_that_is_only_slightly_slower(tiny_model: Path) -> None:
    signals = Signals(step=1, train_s=12.0, rollout_s=10.0)  # training ~15% too slow
    strict = replanner(tiny_model, min_gain_fraction=0.5)
    decision, _ = strict.consider(signals, work(), 1000, COSTS) or (None, None)
    assert decision is not None and not decision.apply
    assert "hysteresis band" in decision.reason
    assert strict.current == Assignment(0, 1)
    default = replanner(tiny_model)  # 5%: the same gain is worth the switch
    decision, _ = default.consider(signals, work(), 1000, COSTS) or (None, None)
    assert decision is not None and decision.apply


def test_a_switch_that_measured_no_gain_is_reverted(tiny_model: Path) -> None:
    """The model says a second training replica halves training; measured, training got
    slower (two replicas share the cores with the engine) and rollout too. Predicted
    from its own steps, the new assignment loses to the one it replaced: the planner
    moves back, and says so with the prediction that chose it and what it measured."""
    r = replanner(tiny_model)
    a, b = Assignment(0, 1), Assignment(1, 1)
    before = Signals(step=1, train_s=100.0, rollout_s=10.0)
    r.observe(a, before, work())
    decision, target = r.consider(before, work(), 50, COSTS) or (None, None)
    assert decision is not None and decision.apply and target == b
    chosen_at = r.log[-1]["candidate"]["t_iter_s"]
    assert chosen_at < 100.0  # the model's promise

    for step in (2, 3):  # what b then measured: no gain at all
        r.observe(b, Signals(step=step, train_s=110.0, rollout_s=20.0), work())
    after = Signals(step=4, train_s=110.0, rollout_s=20.0)
    decision, target = r.consider(after, work(), 47, COSTS) or (None, None)
    assert decision is not None and decision.apply and target == a
    entry = r.log[-1]
    assert entry["revert"] is True and entry["reason"].startswith("revert to 0")
    assert entry["current"]["predicted_when_chosen_s"] == chosen_at
    assert entry["current"]["t_iter_s"] == pytest.approx(110.0)  # b from its own steps
    assert entry["candidate"]["t_iter_s"] == pytest.approx(100.0)  # a from its own step
    assert entry["options"]["0"]["calibrated_by"] == "own"
    assert entry["options"]["1"]["measured_steps"] == 2
    assert r.current == a and r.previous == b

    # and it does not go back again: b keeps its measured times
    decision, target = r.consider(Signals(step=5, train_s=100.0, rollout_s=10.0), work(), 46,
                                  COSTS) or (None, None)  # fmt: skip
    assert decision is not None and not decision.apply and target == a


def test_an_option_that_never_ran_borrows_the_last_measured_factors(tiny_model: Path) -> None:
    r = replanner(tiny_model)
    (t_train, t_rollout), _ = modelled(r)[0], modelled(r)[1]
    r.observe(Assignment(0, 1), Signals(step=1, train_s=3 * t_train, rollout_s=2 * t_rollout),
              work())  # fmt: skip
    # this step measured something else; the option that ran speaks for itself
    decision = r.consider(Signals(step=2, train_s=1.0, rollout_s=1.0), work(), 10, COSTS)
    assert decision is not None
    entry = r.log[-1]
    assert entry["calibration"] == {"train": pytest.approx(3.0), "rollout": pytest.approx(2.0),
                                    "by": "own"}  # fmt: skip
    assert entry["options"]["1"]["calibrated_by"] == "last"
    t1_train, t1_rollout = modelled(r)[1]
    assert entry["options"]["1"]["t_train_s"] == pytest.approx(3 * t1_train)
    assert entry["options"]["1"]["t_rollout_s"] == pytest.approx(2 * t1_rollout)


def test_measurements_survive_a_resume(tiny_model: Path) -> None:
    import json

    r = replanner(tiny_model)
    r.observe(Assignment(0, 1), Signals(step=1, train_s=100.0, rollout_s=10.0), work())
    r.consider(Signals(step=1, train_s=100.0, rollout_s=10.0), work(), 50, COSTS)
    saved = json.loads(json.dumps(r.state()))  # as state.json holds it
    again = replanner(tiny_model)
    again.restore(saved)
    assert again.previous == r.previous == Assignment(0, 1)
    assert again.measured.own(Assignment(0, 1)) == r.measured.own(Assignment(0, 1))
    assert again.measured.last == Assignment(0, 1)


def test_the_planner_times_the_training_that_runs(tiny_model: Path) -> None:
    """libra train's planner sees the trainer's log-prob chunks and its activation
    checkpointing (one more forward of the layers per pass), not a generic trainer's."""
    from libra.train.planning import time_assignment

    cfg = TrainConfig()
    assert planner_settings(cfg).train.logprob_chunk_tokens == 1024
    cfg.trainer.grpo.logprob_chunk_tokens = 0  # the whole logits at once
    assert planner_settings(cfg).train.logprob_chunk_tokens is None

    model, hw, settings = (
        load_model(str(tiny_model)),
        load_hardware("a800-80g"),
        planner_settings(TrainConfig()),
    )
    a = Assignment(0, 1)
    plain = time_assignment(a, FleetShape(1, 1, 1), model, hw, work(), settings)
    ckpt = time_assignment(a, FleetShape(1, 1, 1, recompute=True), model, hw, work(), settings)
    assert ckpt.train.config.recompute and not plain.train.config.recompute
    assert ckpt.t_train > plain.t_train
    assert ckpt.t_rollout == plain.t_rollout
