"""Controllers: how each system chooses its layout at the start and after every step.

- `Fixed`: verl-Colocated (all GPUs, one TP size), verl-Static-Uniform (an even split),
  AReaL-Static-Optimal, best-static-colocated and the ceiling (the fastest static layouts
  pilot runs find, `libra.sim.search`); never changes.
- `Greedy`: verl-Greedy-Heuristic. After each step it compares the measured rollout time
  of the step's batch with its training time and, when the slower side was slower by more
  than `greedy_band`, moves one node's worth of GPUs to it (best training configuration on
  the new count, the same uniform TP size); every change restarts the trainer.
- `Replanner`: Libra and its ladder rungs. The real `ReplanPolicy` decides when to plan
  anew from the last batch's trajectories. The candidates are the planner's plan (or its
  best uniform-TP plan), for the heterogeneous rungs also the best uniform-TP plan, and
  the best colocated (time-shared) uniform-TP plan (`plan_colocated`): the fallbacks a
  policy that can choose any static split must never lose to. The first layout is the
  candidate the model predicts fastest on the first batch, a heterogeneous plan excluded
  unless routing is the oracle (no router places lengths before it has seen a batch,
  and the plan's model assumes it does). A time-shared layout runs as the colocated
  baselines do (`Simulation`: staleness 0, engines with less memory). Each is
  predicted as its modelled time on the fresh batch times the factors, measured /
  modelled, that its layout measured in the steps it ran wholly (`libra.planner.measured`,
  the live trainer's calibration); a layout that never ran borrows the training factor
  of the layout that ran last and the rollout factor of the last one routed over as many
  buckets (one bucket or several: routing is what a mix's rollout model leaves out), else
  for several buckets the last layout's (the model's own error, which routing adds to)
  and for one the model's. The fastest replaces the current layout only when `ReplanPolicy.decide`
  says the gain over the remaining steps pays for the modelled reconfiguration cost; once
  a change has measured a settled step it is checked, and moved back from (a `revert`)
  when the layout it replaced measures faster, by any margin (`decide(revert=True)`: the
  change was made on a prediction, and the measurement says it did not pay). Options
  are ranked by their time over the remaining steps (`Timed.run_s`), as `decide` weighs
  them. A batch that outgrows the training configuration (a sequence longer than its
  micro-batch budget) restarts the trainer on the best one that fits, for every system
  (`libra.sim.trainer.Trainer.step`); the current layout follows the trainer
  (`Replanner.follow_trainer`), so that staying is priced as what it is, not as a layout
  that cannot run. A start the pilots chose is not re-decided on the batches they ran
  (`Replanner.piloted`); a static search's layout chosen as the start gets a plan of its
  own configuration (`Env.with_plan`), so Libra can leave it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from libra.errors import ConfigError
from libra.planner import (
    ReplanPolicy,
    Signals,
    TrainConfig,
    evaluate_plan,
    evaluate_train,
    reconfig_cost,
)
from libra.planner.measured import Measurements, Scale, Timed, calibration
from libra.sim.layout import Layout
from libra.sim.systems import SystemSpec

if TYPE_CHECKING:
    from libra.sim.cluster import Simulation


class Fixed:
    def __init__(self, spec: SystemSpec, sim: Simulation):
        self.spec, self.sim = spec, sim

    def initial_layout(self) -> Layout:
        env, g = self.sim.env, self.sim.env.cfg.gpus
        stats, tp = env.initial, self.spec.rollout_tp
        if self.spec.split == "colocated":
            return env.fixed(stats, g, g, env.colocated_settings, tp)
        if self.spec.split in ("even", "greedy"):
            return env.fixed(stats, g // 2, g - g // 2, env.settings, tp)
        if self.spec.split in ("searched", "colocated-searched", "ceiling"):
            from libra.sim import search  # it simulates, so it imports the simulation

            if self.spec.split == "ceiling":
                return search.ceiling(env).best
            colocated = self.spec.split != "searched"
            return search.best_static(env, colocated=colocated, tp=tp).best
        return env.planned(stats, hetero=self.spec.hetero, step=0)

    def on_step_end(self, step: int) -> None:
        return None

    def grow_training(self, step: int, stats: Any) -> None:
        """Batch `step` fits no training configuration on the layout's training GPUs:
        move rollout GPUs to training a node's worth at a time (instances of the smallest
        TP size first, one instance always kept) until the best configuration on them
        fits, and apply that layout now. Raises `ConfigError` when none does."""
        sim, env = self.sim, self.sim.env
        layout = sim.layout
        mix = {tp: n for tp, n in layout.mix.items() if n}
        node = env.hw.devices_per_node
        train = layout.train.gpus
        while not layout.shared and sum(mix.values()) > 1:
            freed = 0
            for tp in sorted(mix):
                while mix[tp] and freed < node and sum(mix.values()) > 1:
                    mix[tp] -= 1
                    freed += tp
            mix = {tp: n for tp, n in mix.items() if n}
            train += freed
            try:
                config = env.best_train(stats, train)
            except ConfigError:
                continue
            new = Layout(config, mix, layout.bounds)  # a time-shared layout never gets here
            if layout.plan is not None:  # a replanner times its layouts through a plan
                new = env.with_plan(new, stats)
            sim.decisions.append({
                "step": step, "t": sim.loop.now, "apply": True, "trigger": "misfit",
                "train_gpus_before": layout.train.gpus, "train_gpus": train,
                "candidate": new.describe(),
                "reason": f"batch {step} fits no training configuration on "
                          f"{layout.train.gpus} GPUs: {train} from rollout",
            })  # fmt: skip
            sim.apply(new)
            return
        raise ConfigError(
            f"{env.model.id}: no training configuration fits batch {step} of this workload "
            f"on {env.cfg.gpus} x {env.hw.id} ({self.spec.name})"
        )

    def measured(self, step: int) -> tuple[float, float]:
        """(rollout makespan, training time) of `step`. A trainer restart inside the
        step (its batch outgrew the configuration) is not the configuration's speed: it
        is left out, as the stall of a change the controller made is (training waits
        for that one to end). Counted in, one restart made the configuration it forced
        look 5.5 times slower than it trains, and a move back cost another restart."""
        sim = self.sim
        train = sim.t_end[step] - sim.t_start[step] - sim.restart_in[step]
        return sim.done[step] - sim.released[step], train


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
        self.calib = Measurements()
        """Each layout's measured / modelled factors."""
        self.layouts: dict[Hashable, Layout] = {}
        """Every layout that ran, by `key`."""
        self.latest: dict[bool, Hashable] = {}
        """The layout that measured last, by whether it routes over several buckets."""
        self.settled_at = 0.0
        """When the last applied change finished starting (a step released and trained
        after it ran wholly in the current layout)."""
        self.previous: Layout | None = None
        """The layout the last applied change left (moving back to it is a revert)."""
        self.unchecked = False
        """The last change has not yet been judged on a step it ran wholly."""
        self.forecast: tuple[Hashable, Scale] | None = None
        """The layout just chosen and the factors its prediction used, kept until it has
        run a step wholly: then that prediction is scored (`scores`)."""
        self.scores: list[dict[str, Any]] = []
        """The forward model against the simulation, one entry per chosen layout: its
        prediction (made before it ran: the model times the factors known then), re-timed
        on the batch of its first settled step, and that step's measured iteration."""
        self.piloted = 0
        """Batches the pilots that chose the start ran on every candidate (0: the start
        was given)."""
        self.outgrown: set[TrainConfig] = set()
        """Training configurations a batch of this run outgrew (the trainer restarted
        off them): not candidates again, since the lengths that forced it come back."""

    @staticmethod
    def key(layout: Layout) -> Hashable:
        """A layout's identity for its measurements: training configuration, mix, and
        whether it is time-shared."""
        c = layout.train
        return (c.tp, c.pp, c.dp, c.ep, c.zero, tuple(sorted(layout.mix.items())), layout.shared)

    def options(self, stats: Any, step: int, *, first: bool = False) -> list[Layout]:
        """The planner's candidates on a batch: its plan (heterogeneous for the
        heterogeneous rungs), the best uniform-TP plan, and the best colocated
        (time-shared) uniform-TP plan. `first` (nothing has run): no heterogeneous plan
        unless routing is the oracle, since its model puts every length on the instance
        type the plan assigned it, which no router can do before it has seen a batch."""
        env = self.sim.env
        hetero = self.spec.hetero and not (first and self.spec.routing != "oracle")
        out = [env.planned(stats, hetero=hetero, step=step)]
        if hetero:
            out.append(env.planned(stats, hetero=False, step=step))
        try:
            out.append(env.planned(stats, hetero=False, step=step, colocated=True))
        except ConfigError:
            pass  # no colocated plan fits (training state or KV cache): not a candidate
        return out

    def initial_layout(self) -> Layout:
        """The start, chosen the way the static baselines choose theirs: by pilot runs
        (`libra.sim.search.pilot`: the first batches simulated on the layout, fixed).
        The candidates are the planner's (`options`, first) and the static layouts the
        baselines' searches keep (the fastest disaggregated and colocated ones, memoised
        on the run's `Env`): a policy that can choose any static split starts on the
        one that runs fastest, not on the one its cost model ranks first (the model's
        errors on a layout it has not run are what cost Libra cells, docs/simulation.md).
        Ties keep the planner's candidate listed first."""
        from libra.sim import search  # it simulates, so it imports the simulation

        env = self.sim.env
        oracle = self.spec.routing == "oracle"
        known: list[tuple[float, Layout]] = []
        for colocated in (False, True):
            try:
                found = search.best_static(env, colocated=colocated)
            except ConfigError:
                continue  # no static layout of this kind serves the batch
            known.append((found.pilot_s, found.best))
        bound = min((s for s, _ in known), default=math.inf)
        timed: list[tuple[float, Layout]] = []
        for layout in self.options(env.initial, 0, first=True):
            s = search.pilot(
                env, layout, oracle=oracle, oracle_from=self.spec.oracle_from,
                oracle_start=self.spec.oracle_start, bound=bound,
            )  # fmt: skip
            timed.append((s, layout))
            bound = min(bound, s)
        # a static layout's pilot with oracle routing is its plain pilot when it has one
        # bucket (both searches' layouts do), so the times compare. A static layout that
        # is one of the planner's candidates is that candidate (which carries its plan):
        # its two pilots may differ in the last digits (event order), and which of the two
        # won must not decide whether the run has a plan to replan from.
        mine = {self.key(layout) for _, layout in timed}
        known = [(t, layout) for t, layout in known if self.key(layout) not in mine]
        best_s, best = min([*timed, *known], key=lambda x: x[0])
        if not math.isfinite(best_s):
            best = timed[0][1]  # nothing finished its pilot: the planner's first choice
        self.forecast = (self.key(best), (1.0, 1.0))
        self.piloted = search.pilot_steps(env)
        return env.with_plan(best, env.initial)  # a static search's layout gets one

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
        if sim.layout.plan is None:
            return
        stats = env.stats(step)
        self.follow_trainer(stats)
        ran = evaluate_plan(sim.layout.plan, env.model, env.hw, stats, env.settings)
        step_scale = calibration(ran, signals)
        settled = sim.released[step] >= self.settled_at and sim.t_start[step] >= self.settled_at
        if settled:
            k = self.key(sim.layout)
            if self.forecast is not None and self.forecast[0] == k:
                self._score(step, ran, self.forecast[1], signals)
            self.forecast = None
            self.calib.add(k, step_scale)
            self.layouts[k] = sim.layout
            self.latest[len(sim.layout.mix) > 1] = k
        # Only batches not yet released run in a new layout (with staleness, the next
        # one is already rolling out in this one).
        remaining = sim.steps - sim.next_batch
        if step < self.piloted:
            # The pilots that chose the start ran this batch and the next ones on every
            # start candidate: a decision on this batch alone would overrule the
            # evidence of several batches with that of one (measured: moves made on a
            # first batch unlike the next ones lost 4-8% to the layout left). Not asked
            # either: a trigger asked here is spent (the periodic one, due at once,
            # came back only `every_steps` later: never, in a 10-step run).
            return
        why = self.policy.should_replan(signals, remaining)
        if why is None and self.unchecked and settled:
            why = "check"  # the change has run a step wholly: was it worth it?
        if why is None or remaining <= 0:
            return
        self.unchecked = self.unchecked and not settled
        options = self.options(stats, step)
        if self.previous is not None:
            options.append(self.previous)
        options = [o for o in options if o.train not in self.outgrown]
        if not options:
            return
        now = self.timed(sim.layout, ran, step_scale)
        replays: dict[Hashable, float] = {}
        timed = [(*self.predict(o, stats, step, step_scale, signals, replays), o)
                 for o in options]  # fmt: skip
        best_t, best_f, best = min(timed, key=lambda x: x[0].run_s(remaining))
        if self.key(best) == self.key(sim.layout):
            best_t, best, best_f = now, sim.layout, self.factors(sim.layout, step_scale)
        assert best.plan is not None
        cost = self.cost(ran, best.plan)
        back = self.previous is not None and self.key(best) == self.key(self.previous)
        d = self.policy.decide(
            now, best_t, remaining, reconfig=cost, step=step, trigger=why, revert=back
        )
        entry = {
            "t": sim.loop.now,
            **d.as_dict(),
            "candidate": best.describe(),
            "calibration": {"train": step_scale[0], "rollout": step_scale[1]},
        }
        if d.apply and back:
            entry["revert"] = True
        sim.decisions.append(entry)
        if d.apply:
            self.previous = sim.layout
            self.unchecked = True
            self.forecast = (self.key(best), best_f)
            sim.apply(best)
            self.settled_at = max(sim.loop.now + self.start_s(best), sim.trainer.stall_until)

    def follow_trainer(self, stats: Any) -> None:
        """The layout takes the training configuration the trainer runs: it restarted on
        the best fitting one when a batch (`stats`, the one it just trained) outgrew its
        own, as a static system's trainer does."""
        sim, env = self.sim, self.sim.env
        layout, config = sim.layout, sim.trainer.config
        if config == layout.train or layout.plan is None:
            return
        self.outgrown.add(layout.train)
        train = evaluate_train(env.model, env.hw, stats, config, env.settings)
        plan = dataclasses.replace(layout.plan, train=train)
        sim.layout = dataclasses.replace(layout, train=config, plan=plan, predicted_t_iter=math.nan)

    def predict(
        self, layout: Layout, stats: Any, step: int, step_scale: Scale, signals: Signals,
        replays: dict[Hashable, float],
    ) -> tuple[Timed, Scale]:  # fmt: skip
        """`layout`'s times on the fresh batch and the factors they used. A layout that
        has run is its model times its own factors; one that has not takes its training
        the same way (borrowed factors: the training model is close) and its rollout
        from a replay of the batch just finished (`search.replay`, through a copy of the
        router as it is now): the measured rollout of that batch times the replay's
        time on `layout` over its time on the current layout. A mix's model misses
        routing and queueing (it measured 1.1-2.2x its model, docs/simulation.md); the
        replay does not, and the ratio keeps what the replay itself leaves out."""
        model = self._model(layout, stats)
        factors = self.factors(layout, step_scale)
        k, cur = self.key(layout), self.key(self.sim.layout)
        if self.calib.own(k) is not None or k == cur or model.t_rollout <= 0:
            return Timed.of(model, factors), factors
        for key, lay in ((cur, self.sim.layout), (k, layout)):
            if key not in replays:
                replays[key] = self._replay(lay, step)
        new, now = replays[k], replays[cur]
        if not (math.isfinite(now) and now > 0 and signals.rollout_s > 0):
            return Timed.of(model, factors), factors
        rollout = signals.rollout_s * new / now  # inf when the replay could not serve it
        factors = (factors[0], rollout / model.t_rollout)
        return Timed.of(model, factors), factors

    def _replay(self, layout: Layout, step: int) -> float:
        from libra.sim import search  # it simulates, so it imports the simulation

        tree = getattr(self.sim.fleet.policy, "tree", None)
        spec = self.spec
        return search.replay(self.sim.env, layout, step, spec.routing, tree, spec.oracle_from,
                             spec.oracle_start)  # fmt: skip

    def _model(self, layout: Layout, stats: Any) -> Any:
        assert layout.plan is not None
        env = self.sim.env
        return evaluate_plan(layout.plan, env.model, env.hw, stats, env.settings)

    def _score(self, step: int, ran: Any, factors: Scale, signals: Signals) -> None:
        """Score the prediction that chose the layout of `step` (see `scores`)."""
        predicted = Timed.of(ran, factors)
        measured = Timed(signals.train_s, signals.rollout_s, ran.sync_s, ran.sync).t_iter
        layout = self.sim.layout
        self.scores.append({
            "step": step,
            "rollout": {f"tp{t}": n for t, n in sorted(layout.mix.items())},
            "time_shared": layout.shared,
            "predicted_t_iter_s": round(predicted.t_iter, 1),
            "measured_t_iter_s": round(measured, 1),
            "rel_error": round(abs(predicted.t_iter - measured) / max(measured, 1e-9), 4),
        })  # fmt: skip

    def factors(self, layout: Layout, step_scale: Scale) -> Scale:
        """The (train, rollout) factors, measured / modelled, that `layout`'s prediction
        uses now: its own, or borrowed ones (see the module docstring)."""
        own = self.calib.own(self.key(layout))
        if own is not None:
            return own
        last = self.calib.own(self.calib.last) if self.calib.last else None
        train = last[0] if last else step_scale[0]
        several = len(layout.mix) > 1
        kin = self.latest.get(several)
        like = self.calib.own(kin) if kin is not None else None
        # No layout with as many buckets ran: a single bucket has no routing to miss
        # (the model's 1.0); several share the model's error the single-bucket layout
        # measured (queueing, tails) and add routing's to it.
        alone = last[1] if several and last else 1.0
        return train, like[1] if like else alone

    def timed(self, layout: Layout, modelled: Any, step_scale: Scale) -> Timed:
        """`modelled` (the layout's plan on the fresh batch) times `factors`."""
        return Timed.of(modelled, self.factors(layout, step_scale))

    def start_s(self, layout: Layout) -> float:
        """How long the instances `layout` adds take to start."""
        env = self.sim.env
        bw = env.hw.inter_node_bandwidth * env.hw.eff.comm
        return env.cfg.engine_start_s + env.model.weight_bytes / min(layout.mix) / bw

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
