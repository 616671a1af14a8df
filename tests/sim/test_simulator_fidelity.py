"""The simulator against the planner's rollout model, on one batch at paper scale.

The planner's segment time is max(work bound, critical path), its critical path charging
the longest episode a full batch's step time for every token. So it is exact when the
tail is made of tool waits or of a segment whose batch stays full (a narrow length range
per TP size, what the planner builds when routing is exact), and an upper bound when a
wide range drains and the tail decodes nearly alone (docs/simulation.md).
"""

from __future__ import annotations

import pytest

from libra.planner import plan
from libra.sim.config import SimConfig
from libra.sim.runner import build_env
from libra.sim.validate import compare


@pytest.fixture(scope="module", params=["search-r1", "r2e-gym"])
def env(request):
    return build_env(SimConfig(workload=request.param, steps=1))


def test_planner_plan_with_exact_routing_takes_what_the_planner_predicts(env):
    mix = plan(env.model, env.hw, env.stats(0), 48).rollout.mix()
    (row,) = compare(env, [mix])
    assert row["simulated_s"] == pytest.approx(row["planner_s"], rel=0.05)


def test_uniform_fleet_is_bounded_by_the_planner(env):
    for row in compare(env, [{2: 12}, {8: 3}]):
        assert row["simulated_s"] <= row["planner_s"] * 1.01, row
    if env.workload.name == "r2e-gym":  # tool waits set the tail: the bound is tight
        for row in compare(env, [{8: 3}]):
            assert row["planner_over_simulated"] < 1.1
