"""The joint search: GPUs for training vs rollout, training parallelism, rollout mix.

Asynchronous RL (rollout and training overlapped) costs max(T_rollout, T_train) per
iteration. For a target tau the question "is there a plan within tau?" splits cleanly:
the rollout side needs at least R(tau) GPUs (the dynamic program of
`rollout_search`), the training side at least g(tau) (the smallest GPU count with a
configuration within tau; the compute lower bound says where to start looking). tau is
feasible iff g(tau) + R(tau) <= G. Bisection brackets the optimum and a final loop asks
for strictly faster plans until none exists, so the result is the exact optimum of the
model (on the binned requests).

Synchronous RL costs T_rollout + T_train + weight sync. The search walks the training GPU
count upwards, skipping counts whose lower bound (compute-only training time plus the
rollout time of a larger budget already solved) cannot beat the best plan so far.

`exhaustive=True` times every training configuration on every GPU count and every rollout
mix and segmentation on every budget, with no pruning: `libra plan --exhaustive` and the
benchmark use it to check that the pruned search returns the same t_iter.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from libra.errors import ConfigError
from libra.planner.profiles import HardwareProfile, ModelProfile
from libra.planner.rollout_search import INFEASIBLE, RolloutPlan, RolloutProblem, bisect_time
from libra.planner.settings import PlannerSettings
from libra.planner.train_cost import TrainCost, TrainWorkload
from libra.planner.train_search import TrainSearch
from libra.planner.workload import WorkloadStats


class PlanInfeasible(ConfigError):
    """No plan exists for this model, hardware, GPU count and workload; the message says
    what would be feasible."""


@dataclass(frozen=True, slots=True)
class Plan:
    """A resource plan and its predicted iteration time."""

    gpus: int
    model: str
    hardware: str
    sync: bool
    train: TrainCost
    rollout: RolloutPlan
    sync_s: float
    """Weight transfer to the rollout instances (counted only when `sync`)."""
    search: dict[str, Any] = field(default_factory=dict)
    colocated: bool = False
    """Time-shared: every GPU trains, then every GPU rolls out (`plan_colocated`); always
    `sync`, so an iteration costs T_rollout + T_train + weight sync."""

    @property
    def t_train(self) -> float:
        return self.train.total_s

    @property
    def t_rollout(self) -> float:
        return self.rollout.time_s

    @property
    def t_iter(self) -> float:
        return iteration_time(self.t_rollout, self.t_train, self.sync_s, sync=self.sync)

    def run_s(self, steps: int) -> float:
        """Predicted seconds for `steps` more iterations (`run_time`)."""
        return run_time(self.t_rollout, self.t_train, self.sync_s, steps, sync=self.sync)

    @property
    def train_gpus(self) -> int:
        return self.train.config.gpus

    @property
    def rollout_gpus(self) -> int:
        return self.rollout.gpus

    @property
    def idle_gpus(self) -> int:
        if self.colocated:
            return self.gpus - max(self.train_gpus, self.rollout_gpus)
        return self.gpus - self.train_gpus - self.rollout_gpus

    @property
    def mode(self) -> str:
        """`async`, `sync` or `colocated`."""
        return "colocated" if self.colocated else "sync" if self.sync else "async"

    def as_dict(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "model": self.model,
            "hardware": self.hardware,
            "mode": self.mode,
            "t_iter_s": self.t_iter,
            "t_train_s": self.t_train,
            "t_rollout_s": self.t_rollout,
            "t_sync_s": self.sync_s,
            "train_gpus": self.train_gpus,
            "rollout_gpus": self.rollout_gpus,
            "idle_gpus": self.idle_gpus,
            "train": self.train.as_dict(),
            "rollout": self.rollout.as_dict()["instances"],
            "search": dict(self.search),
        }


def iteration_time(t_rollout: float, t_train: float, t_sync: float, *, sync: bool) -> float:
    return t_rollout + t_train + t_sync if sync else max(t_rollout, t_train)


def run_time(t_rollout: float, t_train: float, t_sync: float, steps: int, *, sync: bool) -> float:
    """Seconds for `steps` iterations to finish. Alternating (synchronous, colocated):
    `steps` x t_iter. Overlapped (asynchronous): the pipeline holds rollout and training
    of consecutive batches at once, so `steps` x max(T_rollout, T_train) plus the side
    that is never overlapped at an end (the first batch's rollout before anything
    trains, or the last batch's training after everything rolled out): + min(...). Over
    a long run the term vanishes; over a few steps it is what a time-shared plan saves."""
    if steps <= 0:
        return 0.0
    if sync:
        return steps * (t_rollout + t_train + t_sync)
    return steps * max(t_rollout, t_train) + min(t_rollout, t_train)


def weight_sync_time(model: ModelProfile, hw: HardwareProfile, min_tp: int) -> float:
    """Seconds to push new weights to the rollout instances: a pipelined broadcast over
    the network, so each rollout GPU receives its shard (weights / its TP) once."""
    return model.weight_bytes / max(min_tp, 1) / (hw.inter_node_bandwidth * hw.eff.comm)


class _Search:
    def __init__(
        self,
        model: ModelProfile,
        hw: HardwareProfile,
        stats: WorkloadStats,
        gpus: int,
        settings: PlannerSettings,
        exhaustive: bool,
    ):
        self.model, self.hw, self.G, self.s = model, hw, gpus, settings
        self.exhaustive = exhaustive
        self.roll = RolloutProblem(model, hw, stats, settings.rollout, settings.bins)
        self.train = TrainSearch(
            model,
            hw,
            TrainWorkload.from_stats(stats),
            settings.train,
            exhaustive=exhaustive,
        )
        self.min_train = max(1, settings.min_train_gpus)
        self.min_roll = max(1, settings.min_rollout_gpus)

    # --- feasibility -----------------------------------------------------------------------
    def check_feasible(self) -> None:
        model, hw, G = self.model, self.hw, self.G
        if not self.roll.types:
            raise PlanInfeasible(
                f"{model.id} ({model.weight_bytes / 2**30:.0f} GiB of weights) does not fit a "
                f"rollout instance of TP <= {hw.devices_per_node} on {hw.id} "
                f"({hw.memory_bytes / 2**30:.0f} GiB per device); use hardware with more memory"
            )
        need_roll, _ = self.roll.min_gpus(math.inf)
        if not math.isfinite(need_roll):
            cap = max(ic.kv_capacity for ic in self.roll.types)
            raise PlanInfeasible(
                f"the longest episode ({self.roll.bins.stats.max_total} tokens) does not fit the "
                f"KV cache of any {model.id} instance on {hw.id} (at most {cap} tokens); "
                "shorten the episodes or use hardware with more memory"
            )
        need_roll = max(int(need_roll), self.min_roll)
        need_train = next(
            (g for g in range(self.min_train, max(4 * G, 1024) + 1) if self.train.best(g)),
            None,
        )
        if need_train is None:
            raise PlanInfeasible(
                f"{model.id} training does not fit on {hw.id} with any TP/PP/DP/ZeRO "
                "configuration tried; use hardware with more memory"
            )
        if need_train + need_roll > G:
            raise PlanInfeasible(
                f"{model.id} on {hw.id} needs at least {need_train + need_roll} GPUs "
                f"({need_train} to train, {need_roll} for rollout); got --gpus {G}"
            )

    # --- asynchronous ----------------------------------------------------------------------
    def _decide(self, tau: float, strict: bool) -> tuple[int, list[Any]] | None:
        """A (training GPUs, rollout segments) pair within tau, using the fewest training
        GPUs that meet it, or None."""
        need, segs = self.roll.min_gpus(tau, strict=strict)
        need = max(need, self.min_roll)
        if not math.isfinite(need):
            return None
        top = self.G - int(need)
        start = max(
            self.min_train, math.ceil(self.train.lower_bound(1) / tau) if tau > 0 else top + 1
        )
        for g in range(start, top + 1):
            t = self.train.time(g, bound=tau * (1.0 + 1e-12))
            if (t < tau) if strict else (t <= tau):
                return g, segs
        return None

    def _async(self) -> tuple[int, RolloutPlan]:
        hi = max(self.train.lower_bound(self.G), 1e-6)
        while self._decide(hi, False) is None:
            hi *= 2.0
            if hi > 1e12:
                raise PlanInfeasible("no plan found (the search diverged); report this as a bug")
        lo = hi / 2.0
        hi = bisect_time(lambda tau: self._decide(tau, False) is not None, lo, hi)
        found = self._decide(hi, False)
        assert found is not None
        while True:
            g, segs = found
            cost = max(self.train.time(g), self.roll.plan_of(segs).time_s)
            better = self._decide(cost, True)
            if better is None:
                break
            g2, segs2 = better
            if not max(self.train.time(g2), self.roll.plan_of(segs2).time_s) < cost:
                break  # cannot happen if inversion and forward agree
            found = better
        g, segs = found
        roll = self.roll.solve(self.G - g, hint=self.roll.plan_of(segs).time_s)
        return self._spare_to_training(g, roll), roll

    def _spare_to_training(self, g: int, roll: RolloutPlan) -> int:
        """GPUs neither side needs to meet T_iter (rollout bound by tool waits or by its
        longest episode) go to training when they make its step faster: the same T_iter,
        with slack for batches whose rollout is shorter than the planned one."""
        t = self.train.time(g)
        for more in range(self.G - max(roll.gpus, self.min_roll), g, -1):
            if self.train.time(more) < t:
                return more
        return g

    # --- synchronous -----------------------------------------------------------------------
    def _sync_total(self, g: int) -> float:
        return self.train.time(g) + self.roll.solve(self.G - g).time_s + self._sync_s()

    def _sync_s(self) -> float:
        return weight_sync_time(self.model, self.hw, min(self.roll.tps))

    def _sync(self) -> tuple[int, RolloutPlan]:
        """Branch and bound over the rollout budget R, largest first. T_rollout(R) is a
        non-increasing step function: one solve at R also gives the range [low, R] sharing
        its value (low = GPUs its plan needs), so every training GPU count in that range is
        checked against one rollout time. Bounds: the rollout time of a larger budget and
        `RolloutProblem.lower_bound` below, the training compute bound beside."""
        G, s = self.G, self._sync_s()
        g0, _ = self._async()
        best_g, best = g0, self._sync_total(g0)
        floor_train = self.train.lower_bound(G - self.min_roll)
        v_prev, r = 0.0, G - self.min_train
        while r >= self.min_roll:
            lb_roll = max(v_prev, self.roll.lower_bound(r))
            if lb_roll + s + floor_train >= best:
                break  # every smaller budget is at least this slow
            g = G - r
            if self.train.time(g, bound=best - lb_roll - s) + lb_roll + s >= best:
                r -= 1
                continue
            rp = self.roll.solve(r)
            if not math.isfinite(rp.time_s):
                break
            v, low = rp.time_s, max(rp.gpus, self.min_roll)
            for gg in range(G - low, g - 1, -1):  # budgets G - gg in [low, r]: time v
                if self.train.lower_bound(gg) + v + s >= best:
                    break  # smaller gg only have larger bounds
                t = self.train.time(gg, bound=best - v - s)
                if t + v + s < best:
                    best_g, best = gg, t + v + s
            v_prev, r = v, low - 1
        return best_g, self.roll.solve(G - best_g)

    # --- exhaustive ------------------------------------------------------------------------
    def _all(self) -> tuple[int, RolloutPlan]:
        rolls = self.roll.exhaustive(self.G)
        sync_s = self._sync_s()
        best, best_g = math.inf, -1
        for g in range(self.min_train, self.G - self.min_roll + 1):
            t = iteration_time(
                rolls[self.G - g].time_s, self.train.time(g), sync_s, sync=self.s.sync
            )
            if t < best:
                best, best_g = t, g
        if best_g < 0:
            raise PlanInfeasible("no plan found")
        return best_g, rolls[self.G - best_g]

    def run(self, clock: Callable[[], float] | None = None) -> Plan:
        t0 = clock() if clock else 0.0
        self.check_feasible()
        if self.exhaustive:
            g, roll = self._all()
        else:
            g, roll = self._sync() if self.s.sync else self._async()
        best = self.train.best(g)
        assert best is not None and roll is not INFEASIBLE
        assert g + roll.gpus <= self.G, f"plan overruns its budget: {g} + {roll.gpus} GPUs"
        counts = Counter(self.train.counts) + Counter(self.roll.counts)
        return Plan(
            gpus=self.G,
            model=self.model.id,
            hardware=self.hw.id,
            sync=self.s.sync,
            train=best,
            rollout=roll,
            sync_s=self._sync_s(),
            search={
                "exhaustive": self.exhaustive,
                "bins": self.roll.nbins,
                **dict(sorted(counts.items())),
                **({"solve_s": clock() - t0} if clock else {}),
            },
        )


def plan(
    model: ModelProfile,
    hw: HardwareProfile,
    stats: WorkloadStats,
    gpus: int,
    settings: PlannerSettings | None = None,
    *,
    exhaustive: bool = False,
    clock: Callable[[], float] | None = None,
    colocated: bool = False,
) -> Plan:
    """The plan minimising the iteration time of `stats` on `gpus` devices of `hw`.
    Raises `PlanInfeasible` (a `ConfigError`) naming what would be feasible. With a
    `clock` (e.g. `time.perf_counter`), `plan.search["solve_s"]` is the time it took.
    `colocated`: the time-shared plan (`plan_colocated`) is a candidate too, returned
    when its iteration time is shorter (ties keep the disaggregated plan)."""
    if gpus < 2:
        raise PlanInfeasible(
            f"--gpus {gpus}: a plan needs at least 2 GPUs (one to train, one to roll out)"
        )
    s = settings or PlannerSettings()
    best = _Search(model, hw, stats, gpus, s, exhaustive).run(clock)
    if colocated:
        try:
            shared = plan_colocated(model, hw, stats, gpus, s)
        except PlanInfeasible:
            return best
        if shared.t_iter < best.t_iter:
            return replace(shared, search={**best.search, "disaggregated_t_iter_s": best.t_iter})
    return best


def colocated_settings(settings: PlannerSettings) -> PlannerSettings:
    """`settings` with the rollout engine's memory share of a colocated plan
    (`PlannerSettings.colocated_memory`)."""
    rollout = settings.rollout.model_copy(
        update={"gpu_memory_utilization": settings.colocated_memory}
    )
    return settings.model_copy(update={"rollout": rollout})


def plan_colocated(
    model: ModelProfile,
    hw: HardwareProfile,
    stats: WorkloadStats,
    gpus: int,
    settings: PlannerSettings | None = None,
) -> Plan:
    """The colocated (time-shared) plan: all `gpus` train (the fastest configuration on
    them), then all roll out as the fastest instance mix of `settings.rollout.tp_sizes`
    whose engines get `settings.colocated_memory` of each device beside the resident
    training state; rollout and training alternate (synchronous), so an iteration costs
    T_rollout + T_train + weight sync. Raises `PlanInfeasible` when either side does not
    fit."""
    s = settings or PlannerSettings()
    rs = colocated_settings(s)
    train = TrainSearch(model, hw, TrainWorkload.from_stats(stats), s.train).best(gpus)
    if train is None:
        raise PlanInfeasible(
            f"{model.id} training does not fit on {gpus} x {hw.id}; no colocated plan"
        )
    roll = RolloutProblem(model, hw, stats, rs.rollout, rs.bins)
    rollout = roll.solve(gpus) if roll.types else INFEASIBLE
    if not math.isfinite(rollout.time_s) or not rollout.gpus:
        raise PlanInfeasible(
            f"{model.id} rollout with {s.colocated_memory:.0%} of each {hw.id}'s memory "
            f"cannot serve the workload on {gpus} GPUs; no colocated plan"
        )
    return Plan(
        gpus=gpus,
        model=model.id,
        hardware=hw.id,
        sync=True,
        train=train,
        rollout=rollout,
        sync_s=weight_sync_time(model, hw, min(g.tp for g in rollout.groups if g.instances)),
        search={"bins": roll.nbins},
        colocated=True,
    )


__all__ = [
    "Plan",
    "PlanInfeasible",
    "colocated_settings",
    "iteration_time",
    "plan",
    "plan_colocated",
    "run_time",
    "weight_sync_time",
]
