"""Controllers: how each system chooses its layout at the start and after every step.

- `Fixed`: verl-Colocated (all GPUs, one TP size), verl-Static-Uniform (an even split),
  AReaL-Static-Optimal, best-static-colocated and the ceiling (the fastest static layouts
  pilot runs find, `libra.sim.search`); never changes.
- `Greedy`: verl-Greedy-Heuristic. After each step it compares the measured rollout time
  of the step's batch with its training time and, when the slower side was slower by more
  than `greedy_band`, moves one node's worth of GPUs to it (best training configuration on
  the new count, the same uniform TP size); every change restarts the trainer.
- `Replanner`: Libra and its ladder rungs. The real `ReplanPolicy` decides when to plan
  anew from the last batch's trajectories; the candidate (the planner's plan, or its best
  uniform-TP plan) replaces the current layout only when `ReplanPolicy.decide` says the
  gain over the remaining steps pays for the modelled reconfiguration cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from libra.planner import ReplanPolicy, Signals, evaluate_plan, reconfig_cost
from libra.sim.layout import Layout
from libra.sim.systems import SystemSpec

if TYPE_CHECKING:
    from libra.sim.cluster import Simulation


class Fixed:
    def __init__(self, spec: SystemSpec, sim: Simulation):
        self.spec, self.sim = spec, sim

    def initial_layout(self) -> Layout:
        env, g = self.sim.env, self.sim.env.cfg.gpus
        stats = env.initial
        if self.spec.split == "colocated":
            return env.fixed(stats, g, g, env.colocated_settings)
        if self.spec.split in ("even", "greedy"):
            return env.fixed(stats, g // 2, g - g // 2, env.settings)
        if self.spec.split in ("searched", "colocated-searched", "ceiling"):
            from libra.sim import search  # it simulates, so it imports the simulation

            if self.spec.split == "ceiling":
                return search.ceiling(env).best
            return search.best_static(env, colocated=self.spec.split != "searched").best
        return env.planned(stats, hetero=self.spec.hetero, step=0)

    def on_step_end(self, step: int) -> None:
        return None

    def measured(self, step: int) -> tuple[float, float]:
        """(rollout makespan, training time) of `step`."""
        sim = self.sim
        return sim.done[step] - sim.released[step], sim.t_end[step] - sim.t_start[step]


class Greedy(Fixed):
    def on_step_end(self, step: int) -> None:
        sim, env = self.sim, self.sim.env
        rollout_s, train_s = self.measured(step)
        band = 1.0 + env.cfg.greedy_band
        node = env.hw.devices_per_node
        train = sim.layout.train.gpus
        (tp,) = sim.layout.mix
        if rollout_s > band * train_s and train - node >= 1:
            train -= node
        elif train_s > band * rollout_s and env.cfg.gpus - train - node >= tp:
            train += node
        else:
            return
        stats = env.stats(step)
        rollout = env.cfg.gpus - train
        try:
            cfg = env.best_train(stats, train)
        except Exception:  # training does not fit on fewer GPUs: stay
            return
        layout = Layout(cfg, {tp: rollout // tp}, sim.layout.bounds)
        sim.decisions.append(
            {
                "step": step,
                "t": sim.loop.now,
                "apply": True,
                "rollout_s": rollout_s,
                "train_s": train_s,
                "train_gpus_before": sim.layout.train.gpus,
                "train_gpus": train,
                "reason": f"rollout {rollout_s:.0f} s vs training {train_s:.0f} s",
            }
        )
        sim.apply(layout)


class Replanner(Fixed):
    def __init__(self, spec: SystemSpec, sim: Simulation):
        super().__init__(spec, sim)
        self.policy = ReplanPolicy(sim.env.cfg.replan)

    def on_step_end(self, step: int) -> None:
        sim, env = self.sim, self.sim.env
        rollout_s, train_s = self.measured(step)
        signals = Signals(
            step=step,
            rollout_s=rollout_s,
            train_s=train_s,
            waiting_episodes=sim.fleet.waiting(),
            decode_slots=max(1, sim.fleet.decode_slots()),
        )
        why = self.policy.should_replan(signals)
        if why is None or sim.layout.plan is None:
            return
        stats = env.stats(step)
        current = evaluate_plan(sim.layout.plan, env.model, env.hw, stats)
        candidate = env.planned(stats, hetero=self.spec.hetero, step=step)
        assert candidate.plan is not None
        cost = self.cost(current, candidate.plan)
        d = self.policy.decide(
            current,
            candidate.plan,
            sim.steps - step - 1,
            reconfig=cost,
            step=step,
            trigger=why,
        )
        sim.decisions.append({"t": sim.loop.now, **d.as_dict(), "candidate": candidate.describe()})
        if d.apply:
            sim.apply(candidate)

    def cost(self, current: Any, candidate: Any) -> float:
        """`reconfig_cost` (seconds of iteration time); a trainer without the elastic
        pool restarts for a data-parallel change too, which costs what a reshard does."""
        env = self.sim.env
        rc = reconfig_cost(
            current,
            candidate,
            env.model,
            env.hw,
            engine_start_s=env.cfg.engine_start_s,
            train_restart_s=env.cfg.train_restart_s,
        )
        total = rc.total_s
        if not self.spec.elastic and rc.detail["training_change"].startswith("elastic"):
            a, b = current.train.config, candidate.train.config
            bw = env.hw.inter_node_bandwidth * env.hw.eff.comm
            rebuild = 2 * 16 * env.model.params_total / (b.gpus * bw) + env.cfg.train_restart_s
            total += max(a.gpus, b.gpus) * rebuild / max(candidate.gpus, 1)
        return total


def make_controller(spec: SystemSpec, sim: Simulation) -> Fixed:
    if spec.split == "greedy":
        return Greedy(spec, sim)
    if spec.replan:
        return Replanner(spec, sim)
    return Fixed(spec, sim)


__all__ = ["Fixed", "Greedy", "Replanner", "make_controller"]
