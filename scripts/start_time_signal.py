"""What a router could know before an episode's first turn, and what it would be worth.

1. Per workload, the share of the variance of log(final length) that the prompt explains:
   its length (deciles: all a router sees of a generated prompt) and its GRPO group's
   mean (the most any predictor of the prompt's difficulty could know).
2. Per cell, on one fixed mixed layout (the `ceiling` search's), the run's time routed
   by: the oracle from the start (each episode's own length), the oracle knowing each
   prompt's typical length at the start and the episode's own from its first return
   (`SystemSpec.oracle_start = "prompt"`), the oracle from the first return, C-MLFQ.

    python scripts/start_time_signal.py search-r1:48:0 dapo-math:48:1 ...

docs/simulation.md, "What a start-time predictor could know", has the figures.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import replace

import numpy as np

from libra.sim import workloads
from libra.sim.cluster import Simulation
from libra.sim.config import SimConfig
from libra.sim.runner import build_env
from libra.sim.search import ceiling
from libra.sim.systems import SYSTEMS


def explained(name: str, prompts: int = 256, group: int = 16) -> tuple[float, float, float]:
    """(variance of log final length, share explained by prompt-length deciles, share
    explained by the group's mean) over one generated batch."""
    recs = workloads.sample_data(name, prompts, group, step=0, seed=0)
    y = np.log([r["total_tokens"] for r in recs])
    var = float(y.var())

    def share(keys: list[object]) -> float:
        by: dict[object, list[float]] = defaultdict(list)
        for yi, k in zip(y, keys, strict=True):
            by[k].append(yi)
        fit = np.array([np.mean(by[k]) for k in keys])
        return float(1 - ((y - fit) ** 2).mean() / var)

    lengths = np.array([r["prompt_tokens"] for r in recs])
    deciles = np.digitize(lengths, np.quantile(lengths, np.linspace(0, 1, 11)[1:-1]))
    return var, share(list(deciles)), share([r["group_id"] for r in recs])


def cell(workload: str, gpus: int, seed: int) -> None:
    env = build_env(SimConfig(workload=workload, gpus=gpus, steps=10, seed=seed))
    layout = ceiling(env).best
    print(f"{workload} {gpus} GPUs seed {seed}: {layout.describe()['rollout']}")
    base = SYSTEMS["ceiling"]
    for label, spec in (
        ("oracle, each episode's length from the start", base),
        ("oracle, the prompt's at the start, the episode's from return 1",
         replace(base, oracle_from=1, oracle_start="prompt")),
        ("oracle from return 1", replace(base, oracle_from=1)),
        ("C-MLFQ", replace(base, routing="cmlfq")),
    ):  # fmt: skip
        sim = Simulation(spec, env, layout)
        sim.run()
        print(f"  {label:64s} {sim.loop.now:7.0f} s")


def main(cells: list[str]) -> None:
    for name in ("search-r1", "dapo-math", "r2e-gym"):
        var, by_length, by_group = explained(name)
        print(f"{name}: var(log length) {var:.3f}; explained by the prompt's length "
              f"{by_length:.2f}, by its group's mean {by_group:.2f}")  # fmt: skip
    for c in cells:
        workload, gpus, seed = c.split(":")
        cell(workload, int(gpus), int(seed))


if __name__ == "__main__":
    main(sys.argv[1:])
