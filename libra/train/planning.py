"""The planner in the loop: which role each hybrid worker should have, and whether a
change is worth its cost. Pure (no I/O, no clock): the loop passes measurements in.

The fleet has `core_rollout` engines and `core_train` replicas that never move, and `H`
hybrids. An *assignment* is how many hybrids train (k of H); the rest serve rollouts. Each
assignment is a `Plan` of the global planner's cost model (`libra.planner`), timed on the
workload just measured:

- training: `evaluate_train` of data parallelism `core_train + k` (one device per replica,
  the trainer's micro-batch; `zero=0`: every replica holds the whole state);
- rollout: `evaluate_rollout` of `core_rollout + H - k` instances of the fleet's TP size,
  lengths assigned to them by the planner's dynamic program;
- asynchronous RL: t_iter = max(t_rollout, t_train).

Calibration: the model's times for the assignment that just ran are compared with the
measured training and rollout times of the step, and every option's times are scaled by
those two factors (`calibration`): the model ranks the options, the run's measurements
set the scale. The candidate is the fastest calibrated assignment; `ReplanPolicy.decide`
applies it only when it is faster by the hysteresis band and its gain over the remaining
steps beats the reconfiguration cost (measured: engine start, drain, trainer join), with
a cooldown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from libra.planner import (
    Decision,
    HardwareProfile,
    ModelProfile,
    Plan,
    PlannerSettings,
    ReconfigCost,
    ReplanPolicy,
    Signals,
    TrainConfig,
    WorkloadStats,
    evaluate_rollout,
    evaluate_train,
)


@dataclass(frozen=True, slots=True)
class Assignment:
    """`train` hybrids train, the others serve rollouts."""

    train: int
    hybrids: int

    @property
    def rollout(self) -> int:
        return self.hybrids - self.train


@dataclass(frozen=True, slots=True)
class FleetShape:
    core_rollout: int
    core_train: int
    hybrids: int
    tp: int = 1
    """Devices per rollout instance."""
    micro_batch_tokens: int = 4096

    @property
    def devices(self) -> int:
        return self.core_rollout * self.tp + self.core_train + self.hybrids


@dataclass(frozen=True, slots=True)
class SwitchCosts:
    """Measured seconds a hybrid is out of service when it switches (it idles; the core
    keeps going: elastic joins stream the snapshot while the core steps)."""

    to_train_s: float
    """Drain its turns, stop the engine, start a replica and catch up."""
    to_rollout_s: float
    """Leave training, start an engine on the newest weights, register it."""


@dataclass(frozen=True, slots=True)
class Workload:
    """One step's work: the episodes generated (dropped groups included) and the
    batch trained on."""

    rollout: WorkloadStats
    train: WorkloadStats


def time_assignment(
    a: Assignment,
    shape: FleetShape,
    model: ModelProfile,
    hw: HardwareProfile,
    work: Workload,
    settings: PlannerSettings,
) -> Plan:
    """Assignment `a` as a `Plan` of the cost model, timed on one step's work."""
    mbt = max(shape.micro_batch_tokens, work.train.max_total)
    cfg = TrainConfig(tp=1, pp=1, dp=shape.core_train + a.train, micro_batch_tokens=mbt)
    train = evaluate_train(model, hw, work.train, cfg, settings)
    engines = shape.core_rollout + a.rollout
    rollout = evaluate_rollout(model, hw, work.rollout, {shape.tp: engines}, settings)
    return Plan(
        gpus=shape.devices,
        model=model.id,
        hardware=hw.id,
        sync=False,
        train=train,
        rollout=rollout,
        sync_s=0.0,
        search={"hybrids_training": a.train},
    )


def switch_cost(
    current: Assignment, candidate: Assignment, shape: FleetShape, costs: SwitchCosts
) -> ReconfigCost:
    """Idle device-seconds of the hybrids that move, averaged over the fleet (the
    planner's convention: lost capacity per device)."""
    moves = candidate.train - current.train
    to_train, to_roll = max(moves, 0), max(-moves, 0)
    lost = to_train * costs.to_train_s + to_roll * costs.to_rollout_s
    return ReconfigCost(
        instance_restart_s=costs.to_rollout_s if to_roll else 0.0,
        group_rebuild_s=costs.to_train_s if to_train else 0.0,
        total_s=lost / max(shape.devices, 1),
        detail={"to_train": to_train, "to_rollout": to_roll, "measured": True},
    )


@dataclass(slots=True)
class Replanner:
    """Owns the replan policy and the current assignment; `consider` is called once per
    step with what was measured and returns the decision (None: no trigger)."""

    shape: FleetShape
    model: ModelProfile
    hw: HardwareProfile
    settings: PlannerSettings
    policy: ReplanPolicy
    current: Assignment
    log: list[dict[str, Any]] = field(default_factory=list)

    def best(self, work: Workload) -> tuple[Assignment, Plan, dict[int, Plan]]:
        plans = {
            k: time_assignment(
                Assignment(k, self.shape.hybrids),
                self.shape,
                self.model,
                self.hw,
                work,
                self.settings,
            )
            for k in range(self.shape.hybrids + 1)
        }
        k = min(plans, key=lambda i: (plans[i].t_iter, abs(i - self.current.train)))
        return Assignment(k, self.shape.hybrids), plans[k], plans

    def initial(self, work: Workload) -> dict[str, Any]:
        """Choose the starting assignment on a first workload estimate (no cost: nothing
        runs yet). Returns the log entry."""
        best, plan, plans = self.best(work)
        self.current = best
        entry = {
            "step": 0,
            "trigger": "initial",
            "apply": True,
            "reason": "initial plan on the demonstrations' workload",
            "current": None,
            "candidate": _describe(best, plan),
            "options": {k: _times(p) for k, p in plans.items()},
        }
        self.log.append(entry)
        return entry

    def consider(
        self, signals: Signals, work: Workload, remaining_steps: int, costs: SwitchCosts
    ) -> tuple[Decision, Assignment] | None:
        trigger = self.policy.should_replan(signals)
        if trigger is None:
            return None
        _, _, modelled = self.best(work)
        scale = calibration(modelled[self.current.train], signals)
        plans = {k: Timed.of(p, scale) for k, p in modelled.items()}
        k = min(plans, key=lambda i: (plans[i].t_iter, abs(i - self.current.train)))
        best, plan = Assignment(k, self.shape.hybrids), plans[k]
        current = plans[self.current.train]
        cost = switch_cost(self.current, best, self.shape, costs)
        d = self.policy.decide(
            current, plan, remaining_steps, reconfig=cost, step=signals.step, trigger=trigger
        )
        entry = d.as_dict() | {
            "current": _describe(self.current, current),
            "candidate": _describe(best, plan),
            "reconfig": cost.as_dict(),
            "measured": {
                "rollout_s": signals.rollout_s,
                "train_s": signals.train_s,
                "waiting_episodes": signals.waiting_episodes,
            },
            "options": {k: _times(p) for k, p in plans.items()},
            "calibration": {"train": scale[0], "rollout": scale[1]},
        }
        self.log.append(_finite(entry))
        if d.apply:
            self.current = best
        return d, best


@dataclass(frozen=True, slots=True)
class Timed:
    """A plan's times after calibration to this run's measurements."""

    t_train: float
    t_rollout: float

    @property
    def t_iter(self) -> float:
        return max(self.t_train, self.t_rollout)  # asynchronous RL

    @classmethod
    def of(cls, p: Plan, scale: tuple[float, float]) -> Timed:
        return cls(p.t_train * scale[0], p.t_rollout * scale[1])


def calibration(current: Plan, signals: Signals) -> tuple[float, float]:
    """(train, rollout) factors measured / modelled for the assignment that ran this
    step. The cost model ranks assignments; the measurements fix its scale on this
    machine (on 2 shared cores the model's per-device times are off by several times,
    and not by the same factor on both sides). 1.0 where nothing was measured."""

    def ratio(measured: float, modelled: float) -> float:
        if measured > 0 and modelled > 0 and math.isfinite(modelled):
            return measured / modelled
        return 1.0

    return ratio(signals.train_s, current.t_train), ratio(signals.rollout_s, current.t_rollout)


def _times(p: Plan | Timed) -> dict[str, float]:
    return {"t_iter_s": p.t_iter, "t_rollout_s": p.t_rollout, "t_train_s": p.t_train}


def _describe(a: Assignment, p: Plan | Timed) -> dict[str, Any]:
    return {"hybrids_training": a.train, "hybrids_rollout": a.rollout, **_times(p)}


def _finite(obj: Any) -> Any:
    """JSON has no inf/nan: write them as None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


__all__ = [
    "Assignment",
    "FleetShape",
    "Replanner",
    "SwitchCosts",
    "Workload",
    "switch_cost",
    "time_assignment",
]
