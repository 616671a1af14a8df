"""The planner in the loop: which role each hybrid worker should have, and whether a
change is worth its cost. Pure (no I/O, no clock): the loop passes measurements in.

The fleet has `core_rollout` engines and `core_train` replicas that never move, and `H`
hybrids. An *assignment* is how many hybrids train (k of H); the rest serve rollouts. Each
assignment is a `Plan` of the global planner's cost model (`libra.planner`), timed on the
workload just measured:

- training: `evaluate_train` of `core_train + k` replicas of `replica_ranks` devices
  each, as the elastic trainer runs them: one rank per device, a replica of several
  ranks sharded with FSDP2 (ZeRO-3 inside the replica, replicated across replicas:
  `TrainConfig.shard`), a one-rank replica holding the whole state (ZeRO-0); the
  trainer's micro-batch, its log-prob chunk and activation checkpointing;
- rollout: `evaluate_rollout` of the core instances plus `H - k` hybrid instances (at
  the first bucket's TP size), lengths assigned to them by the planner's dynamic program;
- asynchronous RL: t_iter = max(t_rollout, t_train).

Calibration, per assignment (`libra.planner.measured`): every step that ran wholly in
one assignment records its factors, measured / modelled, for training and rollout
(`observe`). An option is predicted as its modelled time on the current workload times
its own factors (median of its last steps); an option that never ran borrows those of
the assignment that ran last (before anything settled: the step just measured). So the
model ranks the options it has not tried and each tried option speaks for itself: a
switch that measured no gain is seen as such at the next decision. The candidate is the
fastest calibrated assignment; `ReplanPolicy.decide` applies it only when it is faster
by the hysteresis band and its gain over the remaining steps beats the reconfiguration
cost (measured: engine start, drain, trainer join), with a cooldown. Moving back to the
assignment the last change left is logged as a `revert`, with the prediction that
chose the current one and what it measured.

Rollout TP layouts (vLLM fleets whose buckets have different TP sizes): the core
rollout devices can be laid out as different numbers of instances per bucket (say
3 x TP-1 + 1 x TP-2, or 1 x TP-1 + 2 x TP-2, on 5 devices). Every option is then a
pair (hybrids training, core layout) timed the same way, and a layout change is charged
the measured restart of each instance it starts (drain, stop, start at the new TP,
register) times its devices. Every layout keeps at least one instance per bucket: the
routing policy sends turns to every bucket, so none may be left without a server
(`layouts`).
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
from libra.planner.measured import Measurements, Scale, Timed, calibration


@dataclass(frozen=True, slots=True)
class Assignment:
    """`train` hybrids train, the others serve rollouts; the core rollout devices run
    `layout[i]` instances of bucket `i` (empty: the fleet has one layout only)."""

    train: int
    hybrids: int
    layout: tuple[int, ...] = ()

    @property
    def rollout(self) -> int:
        return self.hybrids - self.train


@dataclass(frozen=True, slots=True)
class FleetShape:
    core_rollout: int
    core_train: int
    hybrids: int
    tp: int = 1
    """Devices per rollout instance (the hybrids' instances: the first bucket's)."""
    micro_batch_tokens: int = 4096
    buckets: tuple[tuple[str, int], ...] = ()
    """(name, TP size) of each bucket, when the core layout may change (vLLM fleets with
    more than one TP size); empty: every core instance runs at `tp`."""
    layout: tuple[int, ...] = ()
    """Core instances per bucket at the start (with `buckets`)."""
    recompute: bool = False
    """The trainer recomputes each decoder layer in the backward
    (`trainer.activation_checkpointing`)."""
    replica_ranks: int = 1
    """Devices (ranks) of one training replica (`trainer.elastic.replica_ranks`); a
    hybrid counts the devices of the replica it becomes."""

    @property
    def core_devices(self) -> int:
        if self.buckets:
            return sum(tp * n for (_, tp), n in zip(self.buckets, self.layout, strict=True))
        return self.core_rollout * self.tp

    @property
    def devices(self) -> int:
        return self.core_devices + (self.core_train + self.hybrids) * self.replica_ranks

    def train_config(self, replicas: int, micro_batch_tokens: int) -> TrainConfig:
        """The training parallelism `replicas` replicas run (module doc)."""
        r = self.replica_ranks
        return TrainConfig(
            tp=1, pp=1, dp=replicas * r, zero=3 if r > 1 else 0, shard=r if r > 1 else 0,
            micro_batch_tokens=micro_batch_tokens, recompute=self.recompute,
        )  # fmt: skip

    def mix(self, a: Assignment) -> dict[int, int]:
        """Instances per TP size of assignment `a` (core layout plus rollout hybrids)."""
        if not self.buckets:
            return {self.tp: self.core_rollout + a.rollout}
        out: dict[int, int] = {self.tp: a.rollout}
        for (_, tp), n in zip(self.buckets, a.layout or self.layout, strict=True):
            out[tp] = out.get(tp, 0) + n
        return out


def layouts(shape: FleetShape) -> list[tuple[int, ...]]:
    """Every core layout on the core devices: instances per bucket, at least one each
    (the routing sends turns to every bucket), devices used exactly. `[()]` without
    `buckets`."""
    if not shape.buckets:
        return [()]
    tps = [tp for _, tp in shape.buckets]
    out: list[tuple[int, ...]] = []

    def fill(i: int, left: int, acc: tuple[int, ...]) -> None:
        if i == len(tps) - 1:
            if left % tps[i] == 0 and left // tps[i] >= 1:
                out.append((*acc, left // tps[i]))
            return
        rest = sum(tps[i + 1 :])  # one instance of every later bucket
        for n in range(1, (left - rest) // tps[i] + 1):
            fill(i + 1, left - n * tps[i], (*acc, n))

    fill(0, shape.core_devices, ())
    return out


@dataclass(frozen=True, slots=True)
class SwitchCosts:
    """Measured seconds a hybrid is out of service when it switches (it idles; the core
    keeps going: elastic joins stream the snapshot while the core steps)."""

    to_train_s: float
    """Drain its turns, stop the engine, start a replica and catch up."""
    to_rollout_s: float
    """Leave training, start an engine on the newest weights, register it."""
    restart_s: float | None = None
    """A core instance restarted at another TP size: drain, stop, start, register
    (measured by the run's layout changes; None: `to_rollout_s`)."""


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
    cfg = shape.train_config(shape.core_train + a.train, mbt)
    train = evaluate_train(model, hw, work.train, cfg, settings)
    rollout = evaluate_rollout(model, hw, work.rollout, shape.mix(a), settings)
    return Plan(
        gpus=shape.devices,
        model=model.id,
        hardware=hw.id,
        sync=False,
        train=train,
        rollout=rollout,
        sync_s=0.0,
        search={"hybrids_training": a.train, "layout": list(a.layout)},
    )


def switch_cost(
    current: Assignment, candidate: Assignment, shape: FleetShape, costs: SwitchCosts
) -> ReconfigCost:
    """Idle device-seconds of the hybrids that move, averaged over the fleet (the
    planner's convention: lost capacity per device), plus the devices of every core
    instance a layout change starts, idle for one measured instance restart."""
    moves = candidate.train - current.train
    to_train, to_roll = max(moves, 0), max(-moves, 0)
    lost = to_train * costs.to_train_s + to_roll * costs.to_rollout_s
    restart = costs.restart_s if costs.restart_s is not None else costs.to_rollout_s
    old = current.layout or shape.layout
    new = candidate.layout or shape.layout
    started = {
        name: n - o for (name, _), o, n in zip(shape.buckets, old, new, strict=True) if n > o
    }
    started_devices = sum(
        tp * max(n - o, 0) for (_, tp), o, n in zip(shape.buckets, old, new, strict=True)
    )
    lost += started_devices * restart
    return ReconfigCost(
        instance_restart_s=restart if (to_roll or started) else 0.0,
        group_rebuild_s=costs.to_train_s if to_train else 0.0,
        total_s=lost / max(shape.devices, 1),
        detail={
            "to_train": to_train,
            "to_rollout": to_roll,
            "instances_started": started,
            "measured": True,
        },
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
    measured: Measurements = field(default_factory=Measurements)
    """Each assignment's measured / modelled factors (`observe`)."""
    previous: Assignment | None = None
    """The assignment the last applied change left (moving back to it is a revert)."""
    chosen: dict[Assignment, float] = field(default_factory=dict)
    """Predicted seconds per step of each assignment when a decision chose it."""

    def options(self, fixed_layout: bool = False) -> list[Assignment]:
        """Every assignment: k hybrids training, for every core layout (only the
        current one when `fixed_layout`)."""
        lays = [self.current.layout] if fixed_layout else layouts(self.shape)
        return [Assignment(k, self.shape.hybrids, lay)
                for lay in lays for k in range(self.shape.hybrids + 1)]  # fmt: skip

    def moves(self, a: Assignment) -> int:
        """Workers `a` moves (ties go to the option that moves fewest)."""
        cur = self.current
        diff = zip(a.layout, cur.layout, strict=True) if a.layout and cur.layout else ()
        return abs(a.train - cur.train) + sum(abs(x - y) for x, y in diff)

    def best(
        self, work: Workload, fixed_layout: bool = False
    ) -> tuple[Assignment, Plan, dict[Assignment, Plan]]:
        plans = {
            a: time_assignment(a, self.shape, self.model, self.hw, work, self.settings)
            for a in self.options(fixed_layout)
        }
        a = min(plans, key=lambda o: (plans[o].t_iter, self.moves(o)))
        return a, plans[a], plans

    def key(self, a: Assignment) -> str:
        """An option's name in the decision log: `k`, or `k tp1x3 tp2x1` with layouts
        (a string either way: the log's option maps are JSON objects)."""
        if not a.layout:
            return str(a.train)
        names = " ".join(f"{b}x{n}" for (b, _), n in zip(self.shape.buckets, a.layout, strict=True))
        return f"{a.train} {names}"

    def initial(self, work: Workload) -> dict[str, Any]:
        """Choose the starting assignment on a first workload estimate (no cost: nothing
        runs yet). Returns the log entry."""
        best, plan, plans = self.best(work, fixed_layout=True)  # the fleet starts as configured
        self.current = best
        entry = {
            "step": 0,
            "trigger": "initial",
            "apply": True,
            "reason": "initial plan on the demonstrations' workload",
            "current": None,
            "candidate": self._describe(best, plan),
            "options": {self.key(a): _times(p) for a, p in plans.items()},
        }
        self.log.append(entry)
        return entry

    def observe(self, ran: Assignment, signals: Signals, work: Workload) -> Scale:
        """Record a step that ran wholly in assignment `ran`: its factors, measured /
        modelled on that step's workload. Returns them."""
        plan = time_assignment(ran, self.shape, self.model, self.hw, work, self.settings)
        scale = calibration(plan, signals)
        self.measured.add(ran, scale)
        return scale

    def consider(
        self, signals: Signals, work: Workload, remaining_steps: int, costs: SwitchCosts
    ) -> tuple[Decision, Assignment] | None:
        trigger = self.policy.should_replan(signals, remaining_steps)
        if trigger is None:
            return None
        _, _, modelled = self.best(work)
        step_scale = calibration(modelled[self.current], signals)
        scales = {a: self.measured.scale(a, step_scale) for a in modelled}
        plans = {a: Timed.of(p, scales[a][0]) for a, p in modelled.items()}
        best = min(plans, key=lambda o: (plans[o].t_iter, self.moves(o)))
        plan, current = plans[best], plans[self.current]
        cost = switch_cost(self.current, best, self.shape, costs)
        d = self.policy.decide(
            current, plan, remaining_steps, reconfig=cost, step=signals.step, trigger=trigger
        )
        own = scales[self.current][0]
        entry = d.as_dict() | {
            "current": self._describe(self.current, current)
            | {
                "predicted_when_chosen_s": self.chosen.get(self.current),
                "measured_steps": self.measured.steps(self.current),
            },
            "candidate": self._describe(best, plan),
            "reconfig": cost.as_dict(),
            "measured": {
                "rollout_s": signals.rollout_s,
                "train_s": signals.train_s,
                "waiting_episodes": signals.waiting_episodes,
            },
            "options": {
                self.key(a): _times(p)
                | {"calibrated_by": scales[a][1], "measured_steps": self.measured.steps(a)}
                for a, p in plans.items()
            },
            "calibration": {"train": own[0], "rollout": own[1], "by": scales[self.current][1]},
        }
        if d.apply and best == self.previous:
            entry["revert"] = True
            entry["reason"] = (
                f"revert to {self.key(best)}: {self.key(self.current)} was chosen at "
                f"{_s(self.chosen.get(self.current))} per step and measures "
                f"{current.t_iter:.3g} s; {self.key(best)} measured {plan.t_iter:.3g} s "
                f"({d.reason})"
            )
        self.log.append(_finite(entry))
        if d.apply:
            self.previous, self.current = self.current, best
            self.chosen[best] = plan.t_iter
        return d, best

    def state(self) -> dict[str, Any]:
        """What a resume needs besides the policy's steps."""
        return {
            "measured": self.measured.to_dict(self._keys),
            "previous": None if self.previous is None else self._keys(self.previous),
        }

    def restore(self, saved: dict[str, Any]) -> None:
        self.measured = Measurements.from_dict(saved.get("measured", []), self._parse)
        prev = saved.get("previous")
        self.previous = None if prev is None else self._parse(prev)

    def _keys(self, a: Assignment) -> list[Any]:
        return [a.train, a.hybrids, list(a.layout)]

    @staticmethod
    def _parse(key: list[Any]) -> Assignment:
        return Assignment(int(key[0]), int(key[1]), tuple(int(n) for n in key[2]))

    def _describe(self, a: Assignment, p: Plan | Timed) -> dict[str, Any]:
        out: dict[str, Any] = {"hybrids_training": a.train, "hybrids_rollout": a.rollout}
        if a.layout:
            out["layout"] = {b: n for (b, _), n in zip(self.shape.buckets, a.layout, strict=True)}
        return out | _times(p)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g} s"


def _times(p: Plan | Timed) -> dict[str, float]:
    return {"t_iter_s": p.t_iter, "t_rollout_s": p.t_rollout, "t_train_s": p.t_train}


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
    "layouts",
    "switch_cost",
    "time_assignment",
]
