"""Issue #16: Libra's planner may choose the colocated (time-shared) plan, and the
simulator runs it for Libra the way it runs the colocated baselines.

- Where the cost model predicts the time-shared plan finishes the run sooner, Libra starts
  on it, and runs exactly as best-static-colocated does on the same layout (rollout and
  training alternate: no batch is released before the previous step trained).
- A move to the colocated plan that then measures slower than the layout it left is
  reverted, and the simulation switches back to overlapped rollout and training.
"""

from __future__ import annotations

import math

from libra.sim.cluster import Simulation
from libra.sim.config import SimConfig
from libra.sim.control import Replanner
from libra.sim.layout import Env
from libra.sim.runner import build_env
from libra.sim.search import best_static
from libra.sim.systems import SYSTEMS


def test_libra_runs_the_colocated_plan_where_the_model_says_it_finishes_sooner():
    """search-r1 on 24 GPUs, 128 prompts: rollout and training are near balance, so over
    a short run the split pays its unoverlapped end and the time-shared plan wins (the
    best baseline of this cell is colocated)."""
    env = build_env(SimConfig(workload="search-r1", gpus=24, prompts=128, steps=3, seed=0))
    libra = Simulation(SYSTEMS["libra"], env)
    first = libra.initial_layout
    assert first.shared and libra.sync and libra.k == 0
    split = env.planned(env.initial, hetero=False, step=0)
    assert first.plan is not None and split.plan is not None
    assert first.plan.run_s(3) < split.plan.run_s(3)
    libra.run()
    for s in range(1, libra.steps):  # time-shared: batch s starts once step s - 1 trained
        assert libra.released[s] >= libra.t_end[s - 1]
    found = best_static(env, colocated=True).best
    if (found.mix, found.train) == (libra.layout.mix, libra.layout.train):
        static = Simulation(SYSTEMS["best-static-colocated"], env)
        static.run()
        assert math.isclose(libra.t_end[-1], static.t_end[-1], rel_tol=1e-9)


def test_a_move_to_the_colocated_plan_that_measured_slower_is_reverted(monkeypatch):
    """Libra starts on the uniform split; the colocated plan's prediction is flattered 3x
    until a time-shared layout has run, so Libra moves to it; once it ran a step wholly
    it measures slower than the split it left, and Libra moves back to overlapped
    rollout and training."""
    env = build_env(SimConfig(workload="dapo-math", gpus=24, steps=10, seed=0))
    split = env.planned(env.stats(0), hetero=False, step=0)
    real_planned, real_predict = Env.planned, Replanner.predict

    def planned(self, stats, *, hetero, step=None, colocated=False):
        return real_planned(self, stats, hetero=False, step=step, colocated=colocated)

    def predict(self, layout, *args):
        t, f = real_predict(self, layout, *args)
        if layout.shared and not any(k[-1] for k in self.calib.factors):  # none ran
            return type(t)(t.t_train / 3, t.t_rollout / 3, t.t_sync, t.sync), f
        return t, f

    monkeypatch.setattr(Env, "planned", planned)
    monkeypatch.setattr(Replanner, "predict", predict)
    sim = Simulation(SYSTEMS["libra-cmlfq"], env, layout=split)
    sim.run()
    applied = [d for d in sim.decisions if d["apply"]]
    assert len(applied) == 2, sim.decisions
    assert applied[0]["candidate"].get("colocated")
    assert applied[1].get("revert") and not applied[1]["candidate"].get("colocated")
    assert math.isfinite(applied[1]["current_t_iter"])  # measured slower, not infeasible
    assert Replanner.key(sim.layout) == Replanner.key(split)
    assert not sim.sync and sim.k == env.cfg.staleness
    # While it was time-shared, a batch waited for the step before it to train.
    moved = next(s for s in range(sim.steps) if sim.t_end[s] >= applied[0]["t"])
    back = next(s for s in range(sim.steps) if sim.t_end[s] >= applied[1]["t"])
    assert any(sim.released[s] >= sim.t_end[s - 1] for s in range(moved + 2, back + 1))
