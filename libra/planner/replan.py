"""When to change the plan: triggers, reconfiguration cost, and a decision with hysteresis.

The policy is a pure object. The runtime (or the simulator) asks `should_replan(signals)`
every step; when it says why, the caller plans anew on fresh trajectory statistics
(`plan(...)`) and re-times the current plan on the same statistics (`evaluate_plan`),
then asks `decide(current, candidate, remaining_steps, reconfig=...)`. A change is
applied only when

1. the candidate is faster per step by at least `min_gain_fraction` (the hysteresis
   band: a plan must be clearly better, so two near-equal plans never alternate),
2. the predicted gain over the remaining steps exceeds the modelled reconfiguration cost
   by `gain_cost_ratio`, and
3. at least `cooldown_steps` have passed since the last applied change, and
4. with more than one step left, the candidate is faster per step (its `t_iter`): a
   candidate that gains only at the run's end (a pipelined plan's last training, which a
   time-shared one does not pay after the loop) gains that as well by a move at the last
   step, and every step before it would run slower. `should_replan` asks for that last
   decision (`end`) when nothing else does.

A move back to the plan the last change left (`revert=True`, both timed from what they
measured) skips the band: that change was made on a prediction and measured no gain.

Gains are counted over the remaining steps as each plan runs them (`Plan.run_s`): an
overlapped (asynchronous) plan also pays the end of the pipeline it cannot overlap (the
last batch's training), a time-shared one does not, so over a few remaining steps the two
compare as they will run; per step, the gain is that total over the steps.

Every `Decision` carries its numbers and a one-line reason; `as_dict()` is what goes in
the decision log.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from pydantic import Field

from libra.config import Config
from libra.planner.profiles import HardwareProfile, ModelProfile


class ReplanConfig(Config):
    """Replan policy settings."""

    every_steps: int = Field(10, ge=1)
    """Replan every K training steps."""
    imbalance_band: float = Field(1.25, gt=1.0)
    """Also replan when measured rollout time / training time leaves [1/band, band]."""
    queue_pressure: float = Field(2.0, gt=0.0)
    """Also replan when episodes waiting for a decode slot exceed this many per slot."""
    min_gain_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    """Hysteresis: the candidate must be at least this fraction faster per step."""
    gain_cost_ratio: float = Field(1.5, ge=1.0)
    """The gain over the remaining steps must exceed the reconfiguration cost this many
    times over."""
    cooldown_steps: int = Field(2, ge=0)
    """Steps after an applied change during which no other change applies."""


@dataclass(frozen=True, slots=True)
class Signals:
    """What the runtime measured at the end of a step."""

    step: int
    rollout_s: float = 0.0
    """Wall time of the step's rollout (or the rollout side's busy time)."""
    train_s: float = 0.0
    """Wall time of the step's training update."""
    waiting_episodes: int = 0
    """Episodes admitted but waiting for a decode slot."""
    decode_slots: int = 1
    """Sequences the rollout fleet decodes at once (sum of max_num_seqs)."""


class HasIterationTime(Protocol):
    @property
    def t_iter(self) -> float: ...


def _run_s(p: HasIterationTime, steps: int) -> float:
    """`steps` more iterations of `p`: its `run_s` when it has one (a `Plan` or a
    calibrated `Timed`: a pipelined plan also pays the end it cannot overlap), else
    steps x t_iter."""
    run = getattr(p, "run_s", None)
    return float(run(steps)) if run is not None else steps * float(p.t_iter)


def _drain_s(current: HasIterationTime, candidate: HasIterationTime) -> float:
    """What leaving a pipelined plan for an alternating one (time-shared, synchronous)
    costs at the move: the pipeline drains, the batch in flight (rolled out in the
    pipelined plan) trains in the candidate with nothing beside it, its T_train. The
    pipelined plan's `run_s` charges its own unoverlapped end to its last step; an
    alternating candidate's `run_s` counts only the batches after the move, so without
    this term a move near the end of a run looked like it saved the whole end."""
    if getattr(current, "sync", True) or not getattr(candidate, "sync", False):
        return 0.0
    return float(candidate.t_train)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class ReconfigCost:
    """What changing from one plan to another costs, in seconds of iteration time."""

    weight_reload_s: float = 0.0
    """Fetching weights into newly started rollout instances."""
    instance_restart_s: float = 0.0
    """Starting inference engines (process, CUDA graphs, warm-up)."""
    group_rebuild_s: float = 0.0
    """Rebuilding training process groups (a TP/PP change means checkpoint, reshard and
    restart; a data-parallel join fetches a snapshot while the core keeps stepping)."""
    total_s: float = 0.0
    """The stall charged to the iteration: every component's downtime times the GPUs it
    idles, over all GPUs (lost capacity, cluster-averaged)."""
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Decision:
    apply: bool
    predicted_gain_s: float
    """Per-step gain times the remaining steps (negative if the candidate is slower)."""
    reconfig_cost_s: float
    reason: str
    gain_per_step_s: float = 0.0
    current_t_iter: float = 0.0
    candidate_t_iter: float = 0.0
    remaining_steps: int = 0
    step: int | None = None
    trigger: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ReplanPolicy:
    """Pure and deterministic: it keeps only the steps of the last replan and change."""

    def __init__(self, config: ReplanConfig | None = None):
        self.config = config or ReplanConfig()
        self.last_replan_step: int | None = None
        self.last_change_step: int | None = None

    def should_replan(self, signals: Signals, remaining_steps: int | None = None) -> str | None:
        """Why to plan anew at this step (`periodic`, `imbalance`, `queue-pressure`, or `end`
        with one step left to run in a new plan: the last moment a move that gains only at
        the run's end is worth deciding), or None."""
        c = self.config
        reason = None
        if signals.decode_slots > 0 and (
            signals.waiting_episodes / signals.decode_slots > c.queue_pressure
        ):
            reason = "queue-pressure"
        elif signals.rollout_s > 0 and signals.train_s > 0:
            ratio = signals.rollout_s / signals.train_s
            if ratio > c.imbalance_band or ratio < 1.0 / c.imbalance_band:
                reason = "imbalance"
        if reason is None and (
            self.last_replan_step is None or signals.step - self.last_replan_step >= c.every_steps
        ):
            reason = "periodic"
        if reason is None and remaining_steps == 1:
            reason = "end"
        if reason is not None:
            self.last_replan_step = signals.step
        return reason

    def decide(
        self,
        current: HasIterationTime,
        candidate: HasIterationTime,
        remaining_steps: int,
        *,
        reconfig: ReconfigCost | float,
        step: int | None = None,
        trigger: str = "",
        revert: bool = False,
    ) -> Decision:
        """Whether to move from `current` to `candidate` (both timed on the same, fresh
        workload) with `remaining_steps` steps left. `revert`: `candidate` is the plan
        the last change left and both are timed from their own measurements; moving back
        needs no hysteresis band (the band keeps near-equal predictions from alternating;
        here the change was measured not to pay), only a gain above the cost."""
        c = self.config
        cost = reconfig.total_s if isinstance(reconfig, ReconfigCost) else float(reconfig)
        cur, cand = float(current.t_iter), float(candidate.t_iter)
        n = max(remaining_steps, 0)
        if math.isfinite(cur) and math.isfinite(cand) and n:
            # Over the remaining steps, with the end a pipelined plan cannot overlap (paid
            # at the move when the candidate alternates).
            gain = _run_s(current, n) - _run_s(candidate, n) - _drain_s(current, candidate)
            per_step = gain / n
            base = _run_s(current, n) / n
        else:
            per_step, base = cur - cand, cur
            gain = per_step * n

        def verdict(apply: bool, reason: str) -> Decision:
            return Decision(
                apply=apply,
                predicted_gain_s=gain,
                reconfig_cost_s=cost,
                reason=reason,
                gain_per_step_s=per_step,
                current_t_iter=cur,
                candidate_t_iter=cand,
                remaining_steps=remaining_steps,
                step=step,
                trigger=trigger,
            )

        if math.isinf(cur) and math.isfinite(cand):
            if step is not None:
                self.last_change_step = step
            return verdict(True, "applied: the current plan cannot run this workload")
        if per_step <= 0 or math.isnan(per_step):
            return verdict(False, "kept: candidate is not faster")
        if n > 1 and not cur > cand:
            # gain(n) = n x (cur - cand) + what the end adds: with cur <= cand it is largest
            # for the fewest steps, so moving now loses to moving at the last step.
            return verdict(
                False,
                f"kept: the candidate is not faster per step ({cand:.3g} s vs {cur:.3g} s); "
                f"it gains only at the run's end, which a move at the last step gains too",
            )
        if per_step < (0.0 if revert else c.min_gain_fraction) * base:
            return verdict(
                False,
                f"kept: gain {per_step / base:.1%} per step is inside the "
                f"{c.min_gain_fraction:.0%} hysteresis band",
            )
        if gain <= cost * c.gain_cost_ratio:
            return verdict(
                False,
                f"kept: gain {per_step:.3g} s x {remaining_steps} steps = {gain:.3g} s "
                f"does not exceed cost {cost:.3g} s x {c.gain_cost_ratio:g}",
            )
        if (
            step is not None
            and self.last_change_step is not None
            and step - self.last_change_step < c.cooldown_steps
        ):
            return verdict(
                False, f"kept: cooling down after the change at step {self.last_change_step}"
            )
        if step is not None:
            self.last_change_step = step
        return verdict(
            True,
            f"applied: gain {per_step:.3g} s x {remaining_steps} steps = {gain:.3g} s "
            f"> cost {cost:.3g} s x {c.gain_cost_ratio:g}",
        )


class _PlanShape(Protocol):
    gpus: int

    @property
    def train(self) -> Any: ...

    @property
    def rollout(self) -> Any: ...

    @property
    def colocated(self) -> bool: ...


def reconfig_cost(
    current: _PlanShape,
    candidate: _PlanShape,
    model: ModelProfile,
    hw: HardwareProfile,
    *,
    engine_start_s: float = 60.0,
    train_restart_s: float = 60.0,
) -> ReconfigCost:
    """The modelled cost of moving between two `Plan`s on the same cluster.

    Rollout: every instance the candidate adds (per TP size) starts an engine
    (`engine_start_s`) and pulls its weight shard over the network; instances it removes
    stop after draining. Training: a TP/PP/EP change checkpoints and reloads the full
    state (weights, gradients' buffers and Adam, 16 bytes per parameter) over the network
    and restarts (`train_restart_s`); a change of data parallelism alone is an elastic
    join or leave whose joiners fetch a snapshot in the background. Moving into or out of
    a colocated plan restarts every rollout engine of the candidate: its memory share
    changes (`PlannerSettings.colocated_memory`)."""
    bw = hw.inter_node_bandwidth * hw.eff.comm
    cur_mix, new_mix = current.rollout.mix(), candidate.rollout.mix()
    if current.colocated != candidate.colocated:
        cur_mix = {}
    added = {tp: n - cur_mix.get(tp, 0) for tp, n in new_mix.items() if n > cur_mix.get(tp, 0)}
    new_gpus = sum(tp * n for tp, n in added.items())
    reload = max((model.weight_bytes / tp / bw for tp in added), default=0.0)
    restart = engine_start_s if added else 0.0
    a, b = current.train.config, candidate.train.config
    lost = new_gpus * (reload + restart)
    if (a.tp, a.pp, a.ep) != (b.tp, b.pp, b.ep):
        state = 16 * model.params_total
        rebuild = 2 * state / (b.gpus * bw) + train_restart_s
        lost += max(a.gpus, b.gpus) * rebuild
        kind = "reshard"
    elif a.dp != b.dp:
        joiners = max(0, b.gpus - a.gpus)
        rebuild = 16 * model.params_total / (b.tp * b.pp) / bw if joiners else 0.0
        lost += joiners * rebuild
        kind = "elastic-join" if joiners else "elastic-leave"
    else:
        rebuild, kind = 0.0, "none"
    return ReconfigCost(
        weight_reload_s=reload,
        instance_restart_s=restart,
        group_rebuild_s=rebuild,
        total_s=lost / max(candidate.gpus, 1),
        detail={
            "instances_added": added,
            "training_change": kind,
            "rollout_gpus_started": new_gpus,
        },
    )


__all__ = ["Decision", "ReconfigCost", "ReplanConfig", "ReplanPolicy", "Signals", "reconfig_cost"]
