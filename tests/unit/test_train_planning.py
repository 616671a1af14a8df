"""The planner in the training loop: options timed by the cost model, calibrated to what
the step measured, applied only past the hysteresis band and the reconfiguration cost."""

from __future__ import annotations

from pathlib import Path

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
    assert entry["current"]["t_iter_s"] == 100.0  # calibrated: the measured step
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
