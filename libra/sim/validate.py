"""One batch of a workload on a fixed layout: the simulated rollout makespan next to the
planner's prediction (`evaluate_rollout`), for docs/simulation.md and the tests.

The planner's segment model is the max of a work bound and a critical path that charges
the longest episode the step time of a full batch for all of its tokens; the simulator
replays the batch step by step, so in a batch that drains the tail decodes faster than
that. Where they agree and where they do not is the measure of what the bound leaves out.
"""

from __future__ import annotations

from typing import Any

from libra.planner import evaluate_rollout
from libra.sim.cluster import Simulation
from libra.sim.layout import Env, Layout
from libra.sim.systems import SystemSpec


def rollout_makespan(env: Env, layout: Layout, *, oracle: bool = False) -> float:
    """Seconds the simulator takes to roll out step 0's batch on `layout`: one bucket per
    TP size, each episode to the least-loaded instance of the smallest bucket that fits
    its prompt, or with `oracle` of the bucket of its final length (the assignment the
    planner assumes)."""
    spec = SystemSpec("validate", "", split="even", routing="oracle" if oracle else "static")
    sim = Simulation(spec, env, layout)
    sim.steps = 1
    sim.run()
    return sim.done[0] - sim.released[0]


def compare(env: Env, mixes: list[dict[int, int]], train_gpus: int = 8) -> list[dict[str, Any]]:
    """Planner vs simulator for instance mixes on step 0's batch (mixes of several TP
    sizes are routed by the oracle, as the planner assumes). `train_gpus` only has to
    hold the model's training: the one-batch makespan does not depend on it."""
    stats = env.stats(0)
    rows = []
    for mix in mixes:
        predicted = evaluate_rollout(env.model, env.hw, stats, mix, env.settings)
        bounds = {g.tp: g.max_tokens for g in predicted.groups}
        bounds[max(bounds)] = env.max_context
        layout = Layout(env.best_train(stats, train_gpus), mix, bounds)
        simulated = rollout_makespan(env, layout, oracle=len(mix) > 1)
        rows.append(
            {
                "mix": {f"tp{tp}": n for tp, n in sorted(mix.items())},
                "planner_s": round(predicted.time_s, 1),
                "simulated_s": round(simulated, 1),
                "planner_over_simulated": round(predicted.time_s / simulated, 2),
            }
        )
    return rows


__all__ = ["compare", "rollout_makespan"]
