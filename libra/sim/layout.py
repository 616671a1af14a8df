"""Layouts: a training configuration and a rollout instance mix, and where they come from.

Every layout is chosen with the planner's own code on a workload's statistics: the
planner's plans for Libra's rungs (`plan`, and the time-shared `plan_colocated`), the
best uniform-TP plan for the homogeneous rung, `best_train` + `evaluate_rollout` for the
verl baselines' fixed splits. A layout's buckets are its TP sizes, each serving final
contexts up to the longest its plan assigned it (the largest serves everything).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from libra.errors import ConfigError
from libra.planner import (
    HardwareProfile,
    ModelProfile,
    Plan,
    PlannerSettings,
    TrainConfig,
    WorkloadStats,
    best_train,
    evaluate_rollout,
    instance_cost,
    plan,
    plan_colocated,
    time_config,
    tp_supported,
)
from libra.planner.search import colocated_settings
from libra.routing import Bucket
from libra.sim.config import SimConfig
from libra.sim.episodes import Workload


@dataclass(frozen=True, slots=True)
class Layout:
    train: TrainConfig
    mix: dict[int, int]
    """Rollout instances per TP size."""
    bounds: dict[int, int]
    """Largest final context each TP size's bucket serves."""
    predicted_t_iter: float = math.nan
    plan: Plan | None = field(default=None, compare=False)
    shared: bool = False
    """Training and rollout take turns on the same GPUs (colocated, synchronous)."""

    @property
    def rollout_gpus(self) -> int:
        return sum(tp * n for tp, n in self.mix.items())

    def buckets(self) -> list[Bucket]:
        return [Bucket(f"tp{tp}", tp, self.bounds[tp]) for tp in sorted(self.mix) if self.mix[tp]]

    def describe(self) -> dict[str, Any]:
        c = self.train
        return {
            "train": {"gpus": c.gpus, "tp": c.tp, "pp": c.pp, "dp": c.dp, "zero": c.zero},
            "rollout": {f"tp{tp}": n for tp, n in sorted(self.mix.items()) if n},
            "bounds": {f"tp{tp}": b for tp, b in sorted(self.bounds.items())},
            "predicted_t_iter_s": None if math.isnan(self.predicted_t_iter) else
            round(self.predicted_t_iter, 1),
            **({"colocated": True} if self.shared else {}),
        }  # fmt: skip

    @classmethod
    def of_plan(cls, p: Plan, max_context: int) -> Layout:
        groups = [g for g in p.rollout.groups if g.instances]
        bounds = {g.tp: g.max_tokens for g in groups}
        bounds[groups[-1].tp] = max_context
        return cls(p.train.config, p.rollout.mix(), bounds, p.t_iter, p, shared=p.colocated)


class Env:
    """What every system of a run shares: profiles, settings, the workload."""

    def __init__(self, cfg: SimConfig, model: ModelProfile, hw: HardwareProfile, wl: Workload):
        self.cfg, self.model, self.hw, self.workload = cfg, model, hw, wl
        self.settings = PlannerSettings(colocated_memory=cfg.colocated_memory)
        self.colocated_settings = colocated_settings(self.settings)
        """The rollout engines of a colocated layout get `SimConfig.colocated_memory`."""
        self.max_context = wl.max_context
        self._stats: dict[int, WorkloadStats] = {}
        self._plans: dict[tuple[int | None, bool, bool], Layout] = {}
        self.searched: dict[str, Any] = {}
        """Static layouts found by pilot runs (`libra.sim.search`), by kind."""

    def stats(self, step: int) -> WorkloadStats:
        if step not in self._stats:
            self._stats[step] = WorkloadStats.from_records(self.workload.records(step))
        return self._stats[step]

    def settings_for(self, layout: Layout) -> PlannerSettings:
        """The settings `layout`'s rollout engines run with (colocated: less memory)."""
        return self.colocated_settings if layout.shared else self.settings

    def tps(self, settings: PlannerSettings) -> list[int]:
        return [
            t
            for t in settings.rollout.tp_sizes
            if tp_supported(self.model, self.hw, t)
            and instance_cost(self.model, self.hw, t, settings.rollout).fits
        ]

    # --- layouts ----------------------------------------------------------------------
    def best_train(self, stats: WorkloadStats, gpus: int) -> TrainConfig:
        best = best_train(self.model, self.hw, stats, gpus, self.settings)
        if best is None:
            raise ConfigError(
                f"{self.model.id} training does not fit on {gpus} x {self.hw.id}; "
                "use more GPUs or hardware with more memory"
            )
        return best.config

    def uniform(self, stats: WorkloadStats, gpus: int, settings: PlannerSettings) -> int:
        """The TP size whose uniform fleet on `gpus` GPUs rolls `stats` out fastest."""
        times = {}
        for tp in self.tps(settings):
            if gpus >= tp:
                r = evaluate_rollout(self.model, self.hw, stats, {tp: gpus // tp}, settings)
                times[tp] = r.time_s
        if not times or not math.isfinite(min(times.values())):
            raise ConfigError(
                f"no uniform TP size serves {self.workload.name} on {gpus} x {self.hw.id}"
            )
        return min(times, key=lambda t: (times[t], t))

    def fixed(
        self,
        stats: WorkloadStats,
        train_gpus: int,
        rollout_gpus: int,
        settings: PlannerSettings,
        tp: int | None = None,
    ) -> Layout:
        """The best training configuration on `train_gpus`, and `rollout_gpus` as
        instances of the one TP size that rolls `stats` out fastest (or of `tp`)."""
        if tp is None:
            tp = self.uniform(stats, rollout_gpus, settings)
        elif tp not in self.tps(settings) or rollout_gpus < tp:
            raise ConfigError(
                f"rollout at TP {tp} does not fit {self.model.id} on {rollout_gpus} x "
                f"{self.hw.id} (usable TP sizes: {self.tps(settings)})"
            )
        return Layout(
            self.best_train(stats, train_gpus), {tp: rollout_gpus // tp}, {tp: self.max_context}
        )

    def planned(
        self,
        stats: WorkloadStats,
        *,
        hetero: bool,
        step: int | None = None,
        colocated: bool = False,
    ) -> Layout:
        """The planner's plan (every TP size), or its best uniform-TP plan; disaggregated
        (`plan`) or time-shared (`colocated`: `plan_colocated`). Memoised by `step` (the
        systems of a run plan on the same batches)."""
        key = (step, hetero, colocated)
        if step is not None and key in self._plans:
            return self._plans[key]
        layout = self._planned(stats, hetero, colocated)
        if step is not None:
            self._plans[key] = layout
        return layout

    def remember(self, step: int, hetero: bool, layout: Layout) -> None:
        """Memoise a plan computed elsewhere (a worker process) for `planned`."""
        self._plans[(step, hetero, layout.shared)] = layout

    def _planned(self, stats: WorkloadStats, hetero: bool, colocated: bool) -> Layout:
        make = plan_colocated if colocated else plan
        g = self.cfg.gpus
        if hetero:
            p = make(self.model, self.hw, stats, g, self.settings)
            return Layout.of_plan(p, self.max_context)
        best: Plan | None = None
        for tp in self.tps(self.colocated_settings if colocated else self.settings):
            s = self.settings.model_copy(
                update={"rollout": self.settings.rollout.model_copy(update={"tp_sizes": [tp]})}
            )
            try:
                p = make(self.model, self.hw, stats, g, s)
            except ConfigError:
                continue  # this TP size cannot serve the workload
            if best is None or p.t_iter < best.t_iter:
                best = p
        if best is None:
            kind = "colocated uniform-TP" if colocated else "uniform-TP"
            raise ConfigError(f"no {kind} plan serves {self.workload.name}")
        return Layout.of_plan(best, self.max_context)

    def with_plan(self, layout: Layout, stats: WorkloadStats) -> Layout:
        """`layout` with a `Plan` of its own configuration timed on `stats`: a static
        search's layout has none, and the replanner times, calibrates and compares a
        layout through its plan (without one it could never move)."""
        if layout.plan is not None:
            return layout
        p = time_config(
            self.model, self.hw, stats, layout.train, layout.mix, gpus=self.cfg.gpus,
            sync=layout.shared or self.settings.sync, colocated=layout.shared,
            settings=self.settings, search={"static": True},
        )  # fmt: skip
        return replace(layout, plan=p, predicted_t_iter=p.t_iter)

    @cached_property
    def initial(self) -> WorkloadStats:
        return self.stats(0)


__all__ = ["Env", "Layout"]
