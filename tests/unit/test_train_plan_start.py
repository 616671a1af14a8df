"""`fleet.hybrid_start = "plan"` without a warm start (a run from an already warm-started
model, `sft.steps = 0`): the planner still places the hybrids at start, on a step's
worth of the expert's demonstrations; an env without an expert starts them in rollout.
(The planner's choice itself: tests/unit/test_train_planning.py; what it is worth in a
run: docs/benchmarks.md, "Does the planner pay?")."""

from __future__ import annotations

from pathlib import Path

from libra.chat import ChatTokenizer
from libra.rollout.run import load_env
from libra.train import load_config
from libra.train.build import train_tasks
from libra.train.setup import planning_demos
from tests.conftest import ROOT


async def test_without_a_warm_start_the_plan_gets_a_steps_worth_of_demonstrations(
    tiny_model: Path,
) -> None:
    cfg = load_config(ROOT / "examples/cpu-train-ab.toml", {"sft.steps": 0})
    assert cfg.fleet.hybrid_start == "plan"
    env = load_env(cfg.data.env, cfg.data.env_options)
    tasks, _ = train_tasks(cfg, env)
    demos = await planning_demos(cfg, env, ChatTokenizer(tiny_model), tasks)
    per_step = cfg.rollout.batch_groups * cfg.rollout.group_size
    assert 0 < len(demos) <= per_step and all(d.reward > 0 for d in demos)
    assert all(d.response_token_ids for d in demos)  # lengths the planner can use
    # an expert that does not resolve: no demonstrations, the hybrids start in rollout
    other = load_config(ROOT / "examples/cpu-train-ab.toml", {"sft.expert": "nowhere:expert"})
    assert await planning_demos(other, env, ChatTokenizer(tiny_model), tasks) == []
