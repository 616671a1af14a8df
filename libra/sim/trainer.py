"""The training side: one RL update per step, timed by the planner's training cost model.

A step trains on its whole batch (`TrainWorkload.from_stats`) with the core configuration
plus the hybrid replicas that have caught up (the elastic pool: each adds data-parallel
replicas of the core's TP x PP shape, `train_step_time` with a larger DP). A change of
configuration costs what the trainer's kind allows:

- an elastic trainer (Libra with its hybrid pool) changes data parallelism online:
  joiners fetch a snapshot (16 bytes per parameter of their shard) over the network in
  the background while the core keeps stepping (docs/planner.md, `reconfig_cost`);
- any other change (TP or PP, or any change of a trainer that cannot resize online:
  verl, AReaL, the ladder's rungs without the pool) checkpoints, reloads the full state
  over the network and restarts: `2 x 16 x params / (GPUs x bandwidth) + train_restart_s`,
  the reshard term of `libra.planner.reconfig_cost`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from libra.errors import ConfigError
from libra.planner import (
    HardwareProfile,
    ModelProfile,
    TrainConfig,
    TrainSettings,
    TrainWorkload,
    WorkloadStats,
    best_train,
    train_step_time,
)
from libra.planner.settings import PlannerSettings


class Trainer:
    def __init__(
        self,
        model: ModelProfile,
        hw: HardwareProfile,
        settings: TrainSettings,
        config: TrainConfig,
        *,
        elastic: bool,
        restart_s: float,
    ):
        self.model, self.hw, self.settings = model, hw, settings
        self.config = config
        self.elastic, self.restart_s = elastic, restart_s
        self.stall_until = 0.0
        self.hybrids: dict[Any, float] = {}
        """Lent rollout instances -> the time they have caught up (snapshot fetched)."""
        self.busy_gpu_s = 0.0
        self.stall_gpu_s = 0.0
        self.restarts = 0
        self.stall_s = 0.0
        """Seconds of restarts so far (checkpoint, reshard, start)."""
        self.running_gpus = 0

    @property
    def replica_gpus(self) -> int:
        return self.config.tp * self.config.pp

    @property
    def net_bw(self) -> float:
        return self.hw.inter_node_bandwidth * self.hw.eff.comm

    def fetch_s(self) -> float:
        """Seconds a joining replica needs to fetch its model + optimizer snapshot."""
        return 16 * self.model.params_total / self.replica_gpus / self.net_bw

    def extra_replicas(self, now: float) -> int:
        r = self.replica_gpus
        return sum(inst.tp // r for inst, ready in self.hybrids.items() if ready <= now)

    def step_time(self, stats: WorkloadStats, extra_gpus: int = 0) -> float:
        """Predicted step time on `stats` with `extra_gpus` of hybrid replicas added."""
        cfg = self.config
        dp = cfg.dp + extra_gpus // self.replica_gpus
        wl = TrainWorkload.from_stats(stats)
        return train_step_time(
            self.model, self.hw, dataclasses.replace(cfg, dp=dp), wl, self.settings
        ).total_s

    def runs(self, stats: WorkloadStats) -> bool:
        """Whether the present configuration trains `stats` without a restart."""
        wl = TrainWorkload.from_stats(stats)
        return math.isfinite(train_step_time(self.model, self.hw, self.config, wl,
                                             self.settings).total_s)  # fmt: skip

    def fits(self, stats: WorkloadStats, gpus: int) -> bool:
        """Whether some training configuration on at most `gpus` (the layout's training
        GPUs) runs `stats` (`step` restarts on it when its own no longer does)."""
        return self.runs(stats) or self._fitting(stats, gpus) is not None

    def _fitting(self, stats: WorkloadStats, gpus: int) -> TrainConfig | None:
        """The best configuration that runs `stats` on the most GPUs, at most `gpus`,
        that has one; None if no count does."""
        settings = PlannerSettings(train=self.settings)
        for g in range(gpus, 0, -1):
            best = best_train(self.model, self.hw, stats, g, settings)
            if best is not None:
                return best.config
        return None

    def step(self, stats: WorkloadStats, now: float) -> tuple[float, int]:
        """(duration, GPUs) of a training step on `stats` starting at `now`."""
        wl = TrainWorkload.from_stats(stats)
        cfg = self.config
        extra = self.extra_replicas(now)
        cost = train_step_time(
            self.model, self.hw, dataclasses.replace(cfg, dp=cfg.dp + extra), wl, self.settings
        )
        if not math.isfinite(cost.total_s):
            # The batch outgrew the configuration (e.g. a sequence longer than its
            # micro-batch budget): the trainer restarts on the best fitting one.
            # On a GPU count where nothing fits any more, it uses fewer GPUs.
            best = self._fitting(stats, cfg.gpus)
            if best is None:
                raise ConfigError(
                    f"{self.model.id}: no training configuration fits a batch of this "
                    f"workload on {cfg.gpus} x {self.hw.id}"
                )
            stall = self.change(best, now)
            return self.step(stats, now + stall)[0] + stall, cfg.gpus + extra * self.replica_gpus
        return cost.total_s, cfg.gpus + extra * self.replica_gpus

    def change(self, new: TrainConfig, now: float) -> float:
        """Switch to `new` from the next step; the stall it costs the next step."""
        old = self.config
        if new == old:
            return 0.0
        self.config = new
        same_shape = (old.tp, old.pp, old.ep) == (new.tp, new.pp, new.ep)
        if self.elastic and same_shape:
            # data-parallel joins and leaves: joiners catch up in the background
            self.stall_gpu_s += max(0, new.gpus - old.gpus) * self.fetch_s()
            return 0.0
        state = 16 * self.model.params_total
        stall = 2 * state / (new.gpus * self.net_bw) + self.restart_s
        self.stall_until = max(self.stall_until, now) + stall
        self.stall_gpu_s += stall * max(old.gpus, new.gpus)
        self.stall_s += stall
        self.restarts += 1
        return stall


__all__ = ["Trainer"]
