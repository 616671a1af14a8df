"""Static layouts found by simulation: the bar Libra is measured against, and a ceiling.

A baseline that takes its layout from Libra's planner moves whenever the planner does, and
a planner that mispredicts would set its own bar. So the static baselines are chosen the
way an operator with a simulator would choose them: every candidate layout runs a short
pilot (the first `SimConfig.pilot_steps` batches of the run's workload) on the same
simulated cluster, and the one whose pilot predicts the shortest run (`pilot`: the first
step as measured, the others at the pilot's steady-state iteration time) is kept for the
whole run.

- `best_static(env, colocated=False)` (AReaL-Static-Optimal): training on G - r GPUs
  (the cost model's best configuration on them) and r rollout GPUs as r / t instances of
  one TP size t, for every usable t dividing r and every r in steps of `split_unit`.
- `best_static(env, colocated=True)` (best-static-colocated): all G GPUs alternate; the
  only choice is the rollout TP size (one per usable size).
- `ceiling(env)`: the fastest static layout a pilot with oracle routing finds (each
  episode starts in the bucket of its true final length): from the faster of the two
  above and the planner's step-0 plan, a steepest-descent search over mixes of TP sizes
  (split an instance in two of half the TP, merge two into one of twice the TP, move one
  smallest instance's GPUs between training and rollout). It is an upper reference, not
  a system anyone can deploy.

Training configurations are not searched by simulation: the simulator times a training
step with the cost model itself, so the cost model's best configuration on n GPUs
(`best_train`) is also the simulated fastest. The pilots are deterministic (the workload
is generated from the run's seed; the simulation has no randomness); a pilot that can no
longer beat the best so far stops early, which does not change the choice (ties keep the
candidate listed first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from libra.errors import ConfigError
from libra.planner import evaluate_rollout, evaluate_train
from libra.sim.layout import Env, Layout
from libra.sim.systems import OracleStart, SystemSpec

CEILING_ROUNDS = 8
"""Most improving moves the ceiling's search makes (each round tries every neighbour)."""


@dataclass(frozen=True, slots=True)
class Search:
    """What a search kept and what it cost."""

    kind: str
    best: Layout
    pilot_s: float
    """The run's time on the kept layout, as its pilot predicts it (`pilot`)."""
    tried: int
    """Pilots run."""
    pilot_steps: int

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "layout": self.best.describe(),
            "pilot_predicted_run_s": round(self.pilot_s, 1),
            "pilots": self.tried,
            "pilot_steps": self.pilot_steps,
        }


def split_unit(gpus: int, node: int) -> int:
    """GPUs per step of the training/rollout split the baselines search: the largest power
    of two at most gpus / 12 (about a dozen splits whatever the cluster), never more than
    a node (verl and AReaL allocate by node) and at least 1."""
    unit = 1
    while unit * 2 <= min(gpus / 12, node):
        unit *= 2
    return unit


def disaggregated_candidates(env: Env, tp: int | None = None) -> list[Layout]:
    """Every static disaggregated layout AReaL-Static-Optimal chooses among (`tp`: only
    rollout instances of that size)."""
    g, stats = env.cfg.gpus, env.initial
    unit = split_unit(g, env.hw.devices_per_node)
    out = []
    for rollout in range(unit, g, unit):
        try:
            train = env.best_train(stats, g - rollout)
        except ConfigError:  # training does not fit on so few GPUs
            continue
        for t in env.tps(env.settings):
            if rollout % t == 0 and tp in (None, t):
                out.append(Layout(train, {t: rollout // t}, {t: env.max_context}))
    return out


def colocated_candidates(env: Env, tp: int | None = None) -> list[Layout]:
    """Every static colocated layout best-static-colocated chooses among: all GPUs train,
    then all roll out on instances of one TP size (`tp`: that one)."""
    g = env.cfg.gpus
    train = env.best_train(env.initial, g)
    return [
        Layout(train, {t: g // t}, {t: env.max_context}, shared=True)
        for t in env.tps(env.colocated_settings)
        if g >= t and tp in (None, t)
    ]


_PILOT = SystemSpec("pilot", "a candidate layout's pilot run", split="even")


def pilot_steps(env: Env) -> int:
    return min(env.cfg.pilot_steps, env.cfg.steps)


def _pilot_spec(routing: str, oracle_from: int, oracle_start: OracleStart) -> SystemSpec:
    return replace(_PILOT, routing=routing, oracle_from=oracle_from, oracle_start=oracle_start)


def pilot(
    env: Env, layout: Layout, *, oracle: bool = False, oracle_from: int = 0,
    oracle_start: OracleStart = "episode", bound: float = math.inf,
) -> float:  # fmt: skip
    """The run's time on `layout`, fixed, as its pilot predicts it: the first
    `pilot_steps` batches simulated as they took (the first one filling the pipeline),
    every later step of the run at the pilot's mean iteration after the first (the
    steady state). A pipelined layout's iteration is the slower of its two sides on
    the same batch (`_period`): measured between training ends instead, the first and
    the last pilot training's difference, a heavy batch's training against a light
    one's while rollout set the pace, was counted in every step extrapolated
    (docs/simulation.md, "Pilots that counted a training difference"). In an
    alternating (time-shared) layout a trainer restart in the pilot
    (a batch that outgrew the training configuration: checkpoint, reshard, start)
    delays its iteration by the whole stall, which is paid once, not every step: it is
    taken out of that iteration before the mean. (A pipelined layout's next iteration
    catches up what the stall delayed while rollout went on, so its mean is left as
    measured.) `inf` as soon as the prediction is sure to exceed `bound`. `oracle`:
    routed by the oracle from tool return `oracle_from`, knowing `oracle_start` before
    the first turn (`SystemSpec.oracle_from`, `oracle_start`)."""
    from libra.sim.cluster import Simulation

    spec = _pilot_spec("oracle" if oracle else "static", oracle_from, oracle_start)
    sim = Simulation(spec, env, layout)
    k = sim.steps = pilot_steps(env)
    n, t_end, stalled = env.cfg.steps, sim.t_end, sim.stalled_by
    # The prediction is at least what the iterations so far give (later ones add to it),
    # unless a restart's stall is to be taken out: such a pilot runs to its end.
    exact = not sim.sync or all(sim.trainer.runs(env.stats(s)) for s in range(k))

    def pipelined(now: float) -> float:
        return t_end[0] + (n - 1) * sum(_period(sim, s, now) for s in range(1, k)) / (k - 1)

    def give_up() -> bool:
        now = sim.loop.now
        if not sim.trained:
            return now > bound  # the prediction is at least the first step's end
        if not exact or k == 1:
            return False
        if not sim.sync:
            return pipelined(now) > bound
        return t_end[0] + (n - 1) * (now - t_end[0]) / (k - 1) > bound

    sim.run(give_up=give_up)
    if sim.trained < k:
        return math.inf
    if k == 1:
        return n * t_end[0]
    if not sim.sync:
        return pipelined(sim.loop.now)
    once = stalled[k - 1] - stalled[0]
    if not once:
        return t_end[0] + (n - 1) * (t_end[k - 1] - t_end[0]) / (k - 1)
    return t_end[k - 1] + (n - k) * (t_end[k - 1] - t_end[0] - once) / (k - 1)


def _period(sim: Any, s: int, now: float) -> float:
    """Step `s`'s iteration in a pipelined run: the slower of its batch's rollout (from
    when the fleet could start on it: its release, or the batch before it finishing)
    and its training. At least that, from what is known at `now`, while the step runs."""
    done, start, end = sim.done[s], sim.t_start[s], sim.t_end[s]
    released, before = sim.released[s], sim.done[s - 1]
    began = math.nan if math.isnan(released) or math.isnan(before) else max(released, before)
    rollout = done - began if not math.isnan(done) else now - began
    train = end - start if not math.isnan(end) else now - start
    return max([0.0, *(x for x in (rollout, train) if not math.isnan(x))])


def replay(
    env: Env, layout: Layout, step: int, routing: str, tree: Any = None, oracle_from: int = 0,
    oracle_start: OracleStart = "episode",
) -> float:  # fmt: skip
    """Seconds batch `step` (one the run has finished: its episodes are known) takes to
    roll out on `layout`, alone on a fresh cluster, routed by `routing` (C-MLFQ starting
    from a copy of `tree`, what the run's router has learned; the copy is discarded).
    The forward model of a rollout layout that has not run: a mix's cost-model time
    assumes every length runs on the instance type it was assigned, which no router
    does; the replay routes and queues them as the run would. `inf` if it cannot serve
    the batch."""
    import copy

    from libra.sim.cluster import Simulation
    from libra.sim.episodes import Workload

    sub = Env(
        env.cfg.model_copy(update={"steps": 1}), env.model, env.hw,
        Workload(env.workload.name, [env.workload.batch(step)]),
    )  # fmt: skip
    sub.max_context = env.max_context  # the run's bucket bounds
    sim = Simulation(_pilot_spec(routing, oracle_from, oracle_start), sub, layout)
    if tree is not None and hasattr(sim.fleet.policy, "tree"):
        sim.fleet.policy.tree = copy.deepcopy(tree)  # type: ignore[union-attr]
    sim.steps = 1
    sim.run()
    if sim.trained < 1:
        return math.inf
    return float(sim.done[0] - sim.released[0])


def _predicted(env: Env, layout: Layout) -> float:
    """The cost model's iteration time for `layout` (only to order the pilots)."""
    settings = env.colocated_settings if layout.shared else env.settings
    rollout = evaluate_rollout(env.model, env.hw, env.initial, layout.mix, settings).time_s
    train = evaluate_train(env.model, env.hw, env.initial, layout.train, env.settings).total_s
    return rollout + train if layout.shared else max(rollout, train)


def _fastest(env: Env, kind: str, candidates: list[Layout], *, oracle: bool = False) -> Search:
    """The candidate with the fastest pilot; ties keep the one listed first. Pilots run
    in the order of the cost model's prediction so that the early stop cuts most of the
    slow ones short; the order does not change the choice."""
    best: Layout | None = None
    best_s, best_i = math.inf, -1
    order = sorted(range(len(candidates)), key=lambda i: (_predicted(env, candidates[i]), i))
    for i in order:
        layout = candidates[i]
        s = pilot(env, layout, oracle=oracle, bound=best_s)
        if s < best_s or (s == best_s and i < best_i):
            best, best_s, best_i = layout, s, i
    if best is None:
        raise ConfigError(
            f"no static layout serves {env.workload.name} on {env.cfg.gpus} x {env.hw.id}"
        )
    return Search(kind, best, best_s, len(candidates), pilot_steps(env))


def best_static(env: Env, *, colocated: bool, tp: int | None = None) -> Search:
    """The fastest static layout of its kind by pilot (memoised on `env`); `tp`: among
    those whose rollout instances all have that TP size."""
    kind = ("colocated" if colocated else "disaggregated") + (f"@tp{tp}" if tp else "")
    if kind not in env.searched:
        make = colocated_candidates if colocated else disaggregated_candidates
        env.searched[kind] = _fastest(env, kind, make(env, tp))
    found: Search = env.searched[kind]
    return found


def _with_bounds(env: Env, layout: Layout, mix: dict[int, int], train: Any = None) -> Layout | None:
    """`layout` with rollout `mix` (and training `train`): each TP size's bucket serves the
    lengths the cost model assigns it (the largest everything); None when the mix cannot
    serve the batch or leaves a TP size nothing to serve."""
    mix = {tp: n for tp, n in sorted(mix.items()) if n > 0}
    settings = env.colocated_settings if layout.shared else env.settings
    r = evaluate_rollout(env.model, env.hw, env.initial, mix, settings)
    groups = [gr for gr in r.groups if gr.instances]
    if not math.isfinite(r.time_s) or {gr.tp for gr in groups} != set(mix):
        return None
    bounds = {gr.tp: gr.max_tokens for gr in groups}
    bounds[max(bounds)] = env.max_context
    return Layout(train or layout.train, mix, bounds, shared=layout.shared)


def neighbours(env: Env, layout: Layout) -> list[Layout]:
    """Layouts one move from `layout` (see the module docstring)."""
    tps = env.tps(env.colocated_settings if layout.shared else env.settings)
    mix, out = layout.mix, []
    for tp in sorted(mix):
        if tp // 2 in tps and tp > 1:
            out.append(
                _with_bounds(
                    env, layout, {**mix, tp: mix[tp] - 1, tp // 2: mix.get(tp // 2, 0) + 2}
                )
            )
        if mix[tp] >= 2 and tp * 2 in tps:
            out.append(
                _with_bounds(env, layout, {**mix, tp: mix[tp] - 2, tp * 2: mix.get(tp * 2, 0) + 1})
            )
    if not layout.shared:
        small, train = min(mix), layout.train.gpus
        for delta in (small, -small):  # one smallest instance more, or one fewer
            if train - delta < 1 or (delta < 0 and sum(mix.values()) < 2):
                continue
            try:
                cfg = env.best_train(env.initial, train - delta)
            except ConfigError:
                continue
            out.append(
                _with_bounds(
                    env, layout, {**mix, small: mix[small] + (1 if delta > 0 else -1)}, cfg
                )
            )
    return [c for c in out if c is not None]


def ceiling(env: Env) -> Search:
    """The fastest static layout with oracle routing (memoised on `env`)."""
    if "ceiling" in env.searched:
        found: Search = env.searched["ceiling"]
        return found
    dis, col = best_static(env, colocated=False), best_static(env, colocated=True)
    # One bucket: oracle and static routing place every episode alike, so the uniform
    # searches' pilots stand.
    best, best_s = (
        (dis.best, dis.pilot_s) if dis.pilot_s <= col.pilot_s else (col.best, col.pilot_s)
    )
    tried = dis.tried + col.tried
    try:
        planned = env.planned(env.initial, hetero=True, step=0)
    except ConfigError:
        planned = None
    if planned is not None:
        start = Layout(planned.train, planned.mix, planned.bounds)
        s = pilot(env, start, oracle=True, bound=best_s)
        tried += 1
        if s < best_s:
            best, best_s = start, s
    for _ in range(CEILING_ROUNDS):
        step_best, step_s = best, best_s
        for cand in neighbours(env, best):
            s = pilot(env, cand, oracle=True, bound=step_s)
            tried += 1
            if s < step_s:
                step_best, step_s = cand, s
        if step_best is best:
            break
        best, best_s = step_best, step_s
    top = Search("ceiling", best, best_s, tried, pilot_steps(env))
    env.searched["ceiling"] = top
    return top


__all__ = [
    "Search",
    "best_static",
    "ceiling",
    "colocated_candidates",
    "disaggregated_candidates",
    "neighbours",
    "pilot",
    "replay",
    "split_unit",
]
