"""`libra rollout [CONFIG] [flags]`: one batch of episodes, trajectories to a JSONL file."""

from __future__ import annotations

import argparse
import logging
import sys

from libra.cli.common import (
    add_fleet_flags,
    add_json_flag,
    add_ray_flag,
    add_set_flag,
    apply_bucket_flags,
    config_of,
    fleet_overrides,
    overrides,
    print_json,
    ray_overrides,
    seed,
)
from libra.errors import ConfigError

EPILOG = """\
examples:
  libra rollout examples/cpu-rollout.toml
  libra rollout --env arith --group-size 4 --endpoint tp1=http://127.0.0.1:8000
  libra rollout --env examples/openai_agent.py:run --endpoint tp1=http://127.0.0.1:8000
  libra rollout --env my_envs.py:Adder --tasks tasks.jsonl --model ./tiny \\
      --endpoint tp1=http://127.0.0.1:8000 --endpoint tp2=http://127.0.0.1:8001 \\
      --bucket tp1=1:2048 --bucket tp2=2:4096

Without endpoints (and without [[buckets]] in the config) one embedded engine is started
for bucket tp1 and stopped at the end. Records are appended to --out (default
runs/rollout.jsonl) as each episode finishes; a summary goes to stdout (--json: one JSON
document).
"""


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help="run one batch of episodes against endpoints",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="TOML config (flags override its keys)")
    p.add_argument(
        "--env",
        help="env id (`libra envs`), file.py:Class / package.module:Class, or an agent "
        "function file.py:run (async def run(task, client: openai.AsyncOpenAI))",
    )
    p.add_argument("--tasks", help="tasks file (.jsonl, .json, .parquet); default: the env's")
    p.add_argument("--num-tasks", type=int, metavar="N", help="use only the first N tasks (N >= 1)")
    p.add_argument("--group-size", type=int, help="samples per task (GRPO G)")
    p.add_argument("--concurrency", type=int, help="episodes in flight")
    p.add_argument("--workers", type=int, metavar="N",
                   help="processes that run episodes, each with its own event loop "
                   "(default 1: this process)")  # fmt: skip
    p.add_argument(
        "--out", help="JSONL file the records are appended to (default runs/rollout.jsonl)"
    )
    p.add_argument("--batch-id", help="batch id stamped on records")
    add_fleet_flags(p)
    add_ray_flag(p)
    add_set_flag(p, "--set limits.episode_timeout_s=600 --set launch.vllm.device=cpu")
    p.add_argument("--seed", type=seed, help="sampling seed (per episode: seed + index)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    add_json_flag(p)
    return p


def run(args: argparse.Namespace) -> int:
    from libra import config as cfgmod
    from libra.rollout.config import RolloutConfig
    from libra.rollout.run import rollout, run_sync

    logging.basicConfig(level=logging.WARNING, format="libra: %(message)s", stream=sys.stderr)
    if args.num_tasks is not None and args.num_tasks < 1:
        raise ConfigError(
            f"--num-tasks {args.num_tasks}: give the number of tasks to run (1 or more), "
            "or leave it out to run every task"
        )
    flags = {
        "env": args.env,
        "tasks": args.tasks,
        "num_tasks": args.num_tasks,
        "group_size": args.group_size,
        "concurrency": args.concurrency,
        "workers": args.workers,
        "out": args.out,
        "batch_id": args.batch_id,
        "sampling.seed": args.seed,
        **fleet_overrides(args),
        **ray_overrides(args),
    }
    with config_of("rollout", args.config):
        cfg = cfgmod.load(RolloutConfig, args.config, overrides(args.set, flags))
    apply_bucket_flags(cfg, args)
    summary = run_sync(rollout(cfg, progress=not args.quiet))
    if args.json:
        print_json(summary)
    else:
        st = ", ".join(f"{k} {v}" for k, v in summary["status"].items())
        print(
            f"{summary['episodes']} episodes ({st}), mean reward {summary['mean_reward']:.3f}, "
            f"{summary['model_tokens']} model tokens at {summary['tokens_per_s']:,.0f} tok/s, "
            f"{summary['migrations']} migrations, {summary['tool_errors']}/{summary['tool_calls']} "
            f"tool errors, {summary['wall_s']:.1f} s -> {summary['out']}"
        )
    return 0
