"""Timing given configurations (what the simulator's baselines and the replan policy need).

- `evaluate_rollout`: a fixed instance mix (say 6 x TP-8 for a uniform baseline); lengths
  are still assigned to instance types by the exact min-max dynamic program.
- `solve_rollout`: the fastest mix on a GPU budget (rollout only).
- `best_train`: the fastest training configuration on a GPU count.
- `evaluate_plan`: an existing plan re-timed on a new workload (same training
  configuration, same instance mix), so a replan compares like with like;
  `time_config`: the same for a configuration and mix that have no plan yet.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from libra.errors import ConfigError
from libra.planner.profiles import HardwareProfile, ModelProfile
from libra.planner.rollout_search import INFEASIBLE, RolloutPlan, RolloutProblem
from libra.planner.search import Plan, colocated_settings, weight_sync_time
from libra.planner.settings import PlannerSettings
from libra.planner.train_cost import TrainConfig, TrainCost, TrainWorkload, train_step_time
from libra.planner.train_search import TrainSearch
from libra.planner.workload import WorkloadStats


def _problem(
    model: ModelProfile, hw: HardwareProfile, stats: WorkloadStats, settings: PlannerSettings | None
) -> RolloutProblem:
    s = settings or PlannerSettings()
    return RolloutProblem(model, hw, stats, s.rollout, s.bins)


def evaluate_rollout(
    model: ModelProfile,
    hw: HardwareProfile,
    stats: WorkloadStats,
    mix: Mapping[int, int],
    settings: PlannerSettings | None = None,
) -> RolloutPlan:
    """The rollout time of a fixed mix {tp: instances}, lengths assigned optimally
    (short requests to the smaller TP sizes). INFEASIBLE if the mix cannot serve them."""
    prob = _problem(model, hw, stats, settings)
    unknown = [tp for tp, n in mix.items() if n > 0 and tp not in prob.tps]
    if unknown:
        known = ", ".join(str(t) for t in prob.tps)
        raise ConfigError(
            f"TP size(s) {unknown} cannot serve {model.id} on {hw.id}; usable: {known}"
        )
    nb = prob.nbins
    f = np.full(nb + 1, math.inf)
    f[0] = 0.0
    choice = []
    for t, tp in enumerate(prob.tps):
        m = int(mix.get(tp, 0))
        cost = np.maximum(f[:, None], prob.seg.times_at(t, m))
        arg = np.argmin(cost, axis=0)
        f = cost[arg, np.arange(nb + 1)]
        choice.append((arg, m))
    if not math.isfinite(f[nb]):
        return INFEASIBLE
    segs, i = [], nb
    for t in range(len(prob.tps) - 1, -1, -1):
        arg, m = choice[t]
        j = int(arg[i])
        if j < i:
            segs.append((t, j, i, m))
        i = j
    return prob.plan_of(segs[::-1])


def solve_rollout(
    model: ModelProfile,
    hw: HardwareProfile,
    stats: WorkloadStats,
    gpus: int,
    settings: PlannerSettings | None = None,
) -> RolloutPlan:
    """The fastest rollout plan on at most `gpus` GPUs."""
    return _problem(model, hw, stats, settings).solve(gpus)


def best_train(
    model: ModelProfile,
    hw: HardwareProfile,
    stats: WorkloadStats,
    gpus: int,
    settings: PlannerSettings | None = None,
) -> TrainCost | None:
    """The fastest fitting training configuration on exactly `gpus` GPUs (None if none)."""
    s = settings or PlannerSettings()
    return TrainSearch(model, hw, TrainWorkload.from_stats(stats), s.train).best(gpus)


def evaluate_train(
    model: ModelProfile,
    hw: HardwareProfile,
    stats: WorkloadStats,
    config: TrainConfig,
    settings: PlannerSettings | None = None,
) -> TrainCost:
    s = settings or PlannerSettings()
    return train_step_time(model, hw, config, TrainWorkload.from_stats(stats), s.train)


def time_config(
    model: ModelProfile,
    hw: HardwareProfile,
    stats: WorkloadStats,
    config: TrainConfig,
    mix: Mapping[int, int],
    *,
    gpus: int,
    sync: bool,
    colocated: bool = False,
    settings: PlannerSettings | None = None,
    search: dict[str, object] | None = None,
) -> Plan:
    """A `Plan` of a given training configuration and instance mix, timed on `stats`
    (a colocated plan's rollout with `settings.colocated_memory`)."""
    s = settings or PlannerSettings()
    train = evaluate_train(model, hw, stats, config, s)
    rs = colocated_settings(s) if colocated else s
    rollout = evaluate_rollout(model, hw, stats, mix, rs)
    tps = [g.tp for g in rollout.groups if g.instances] or [1]
    return Plan(
        gpus=gpus,
        model=model.id,
        hardware=hw.id,
        sync=sync,
        train=train,
        rollout=rollout,
        sync_s=weight_sync_time(model, hw, min(tps)),
        search=dict(search or {}),
        colocated=colocated,
    )


def evaluate_plan(
    plan: Plan,
    model: ModelProfile,
    hw: HardwareProfile,
    stats: WorkloadStats,
    settings: PlannerSettings | None = None,
) -> Plan:
    """`plan`'s configuration timed on `stats` (a fresh workload); a colocated plan's
    rollout with `settings.colocated_memory`."""
    return time_config(
        model, hw, stats, plan.train.config, plan.rollout.mix(), gpus=plan.gpus,
        sync=plan.sync, colocated=plan.colocated, settings=settings,
        search={"reevaluated": True},
    )  # fmt: skip


__all__ = [
    "best_train",
    "evaluate_plan",
    "evaluate_rollout",
    "evaluate_train",
    "solve_rollout",
    "time_config",
]
