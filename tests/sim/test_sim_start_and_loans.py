"""Issue #16: Libra chooses its start and its untried layouts with the evidence the
static baselines get, and lends a hybrid only when the loan shortens the iteration.

- The start: the pilot (`search.pilot`) of every candidate, the planner's and the
  static searches' layouts alike; Libra starts on the fastest, so it never starts behind
  the simulated-best static layout.
- An untried layout's rollout is forecast by replaying the batch just finished through
  a copy of the router (`search.replay`), scaled by what the current layout measured.
- A hybrid held in a training step holds its GPUs from the next batch's rollout until
  the step ends: it is kept only when the step it saves outweighs that.
"""

from __future__ import annotations

import math

import pytest

from libra.planner import Signals, evaluate_plan
from libra.sim import search
from libra.sim.cluster import Simulation
from libra.sim.config import SimConfig
from libra.sim.control import Replanner
from libra.sim.elastic import _iteration
from libra.sim.runner import build_env
from libra.sim.systems import SYSTEMS

TINY = {"workload": "search-r1", "gpus": 16, "steps": 4, "prompts": 4, "group": 8}


def test_libra_starts_on_the_fastest_pilot_of_its_candidates_and_the_static_layouts():
    env = build_env(SimConfig(**TINY))
    sim = Simulation(SYSTEMS["libra"], env)
    start = search.pilot(env, sim.initial_layout)
    statics = [search.best_static(env, colocated=c) for c in (False, True)]
    assert all(start <= s.pilot_s for s in statics)
    ctl = sim.controller
    assert isinstance(ctl, Replanner)
    planners = [search.pilot(env, lay) for lay in ctl.options(env.initial, 0, first=True)]
    assert start == min([*planners, *(s.pilot_s for s in statics)])


def test_a_static_search_layout_gets_a_plan_so_that_libra_can_leave_it():
    """Libra may start on a static search's layout (its pilot was the fastest), which has
    no plan; the replanner times and calibrates a layout through its plan, so without
    one it never decided again. `Env.with_plan` gives it one of its own configuration."""
    env = build_env(SimConfig(**dict(TINY, steps=8)))
    static = search.best_static(env, colocated=False).best
    assert static.plan is None
    planned = env.with_plan(static, env.initial)
    same = ("train", "mix", "bounds", "shared")
    assert [getattr(planned, f) for f in same] == [getattr(static, f) for f in same]
    assert planned.plan is not None and planned.plan.train.config == static.train
    assert planned.plan.rollout.mix() == static.mix
    assert math.isfinite(evaluate_plan(planned.plan, env.model, env.hw, env.stats(1)).t_iter)
    runs = {}
    for name, layout in (("without", static), ("with", planned)):
        sim = Simulation(SYSTEMS["libra-homogeneous"], env, layout=layout)
        sim.run()
        runs[name] = sim.decisions
    assert not runs["without"] and runs["with"]


def test_an_untried_mix_is_forecast_by_replaying_the_finished_batch():
    """dapo-math on 48 GPUs, running the uniform-TP plan under C-MLFQ after one step: the
    heterogeneous plan (never run) is forecast from the replay of step 0's batch on it,
    relative to the replay on the running layout; its model alone is more optimistic
    (it puts every length on its ideal instance type), and the live router's tree is
    left as it was."""
    env = build_env(SimConfig(workload="dapo-math", gpus=48, steps=3, seed=0))
    stats = env.stats(0)
    hetero = env.planned(stats, hetero=True, step=0)
    uniform = env.planned(stats, hetero=False, step=0)
    assert len(hetero.mix) > 1 and len(uniform.mix) == 1
    sim = Simulation(SYSTEMS["libra-cmlfq"], env, layout=uniform)
    sim.steps = 1
    sim.run()
    ctl = sim.controller
    assert isinstance(ctl, Replanner)
    tree = sim.fleet.policy.tree  # type: ignore[union-attr]
    nodes = tree.nodes
    measured = sim.done[0] - sim.released[0]
    signals = Signals(step=0, rollout_s=measured, train_s=sim.t_end[0] - sim.t_start[0])
    ran = evaluate_plan(uniform.plan, env.model, env.hw, stats, env.settings)
    replays: dict = {}
    timed, factors = ctl.predict(hetero, stats, 0, (1.0, 1.0), signals, replays)
    mine, now = replays[Replanner.key(hetero)], replays[Replanner.key(uniform)]
    assert math.isfinite(mine) and math.isfinite(now)
    assert timed.t_rollout == pytest.approx(measured * mine / now)
    model = evaluate_plan(hetero.plan, env.model, env.hw, stats, env.settings)
    assert factors[1] == pytest.approx(timed.t_rollout / model.t_rollout)
    assert factors[1] > 1.0  # the replay is slower than the mix's model
    assert nodes > 1 and sim.fleet.policy.tree.nodes == nodes  # type: ignore[union-attr]
    # a layout that has run is its model times its own factors, no replay
    ctl.calib.add(Replanner.key(uniform), (1.0, 1.0))
    own, _ = ctl.predict(uniform, stats, 0, (1.0, 1.0), signals, {})
    assert own.t_rollout == pytest.approx(ran.t_rollout)


def test_a_hybrid_is_held_in_a_step_only_when_the_iteration_gets_shorter():
    # measured on r2e-gym, 24 GPUs: a TP-4 hybrid (of 12 rollout GPUs) cut a 1,614-s
    # step to 1,211 s, and the next batch's rollout grew from ~1,490 s to 2,083 s
    without = _iteration(1614.0, 1488.0, 0, 12)
    assert without == 1614.0
    assert _iteration(1211.0, 1488.0, 4, 12) > without  # not worth holding
    # training far behind rollout: holding one pays
    assert _iteration(2250.0, 1000.0, 4, 12) < _iteration(3000.0, 1000.0, 0, 12)
    # the rollout never finishes faster than the step that holds its GPUs plus the rest
    assert _iteration(100.0, 1000.0, 12, 12) == 1100.0
