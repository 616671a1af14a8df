"""`libra rollout [CONFIG] [flags]`: one batch of episodes, trajectories to a JSONL file."""

from __future__ import annotations

import argparse
import logging
import sys

from libra.cli.common import add_json_flag, parse_pairs, print_json

EPILOG = """\
examples:
  libra rollout examples/cpu-rollout.toml
  libra rollout --env arith --group-size 4 --endpoint tp1=http://127.0.0.1:8000
  libra rollout --env examples/openai_agent.py:run --endpoint tp1=http://127.0.0.1:8000
  libra rollout --env my_envs.py:Adder --tasks tasks.jsonl --model ./tiny \\
      --endpoint tp1=http://127.0.0.1:8000 --endpoint tp2=http://127.0.0.1:8001 \\
      --bucket tp1=1:2048 --bucket tp2=2:4096

Without endpoints (and without [[buckets]] in the config) one embedded engine is started
for bucket tp1 and stopped at the end. Records are appended to --out as each episode
finishes; a summary goes to stdout (--json: one JSON document).
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
    p.add_argument("--model", help="model folder (default: the tiny default model)")
    p.add_argument(
        "--env",
        help="env id (`libra envs`), file.py:Class / package.module:Class, or an agent "
        "function file.py:run (async def run(task, client: openai.AsyncOpenAI))",
    )
    p.add_argument("--tasks", help="tasks file (.jsonl, .json, .parquet); default: the env's")
    p.add_argument("--num-tasks", type=int, help="use only the first N tasks")
    p.add_argument("--group-size", type=int, help="samples per task (GRPO G)")
    p.add_argument("--concurrency", type=int, help="episodes in flight")
    p.add_argument("--out", help="JSONL file the records are appended to")
    p.add_argument("--batch-id", help="batch id stamped on records")
    p.add_argument("--policy", help="routing policy (static, cmlfq, mlfq, predictor)")
    p.add_argument(
        "--endpoint", action="append", metavar="BUCKET=URL", help="add an endpoint (repeatable)"
    )
    p.add_argument(
        "--bucket", action="append", metavar="NAME=TP:BOUND", help="declare a bucket (repeatable)"
    )
    p.add_argument("--launch", type=int, metavar="N", help="embedded engines to start per bucket")
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-tokens", type=int, help="tokens per model turn")
    p.add_argument("--max-turns", type=int, help="override the env's max_turns")
    p.add_argument("--max-context", type=int, help="largest total context per episode")
    p.add_argument("--seed", type=int, help="sampling seed (per episode: seed + index)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    add_json_flag(p)
    return p


def run(args: argparse.Namespace) -> int:
    from libra import config as cfgmod
    from libra.rollout.config import RolloutConfig
    from libra.rollout.fleet import merge_bucket_flags
    from libra.rollout.run import rollout, run_sync

    logging.basicConfig(level=logging.WARNING, format="libra: %(message)s", stream=sys.stderr)
    overrides = {
        "model": args.model,
        "env": args.env,
        "tasks": args.tasks,
        "num_tasks": args.num_tasks,
        "group_size": args.group_size,
        "concurrency": args.concurrency,
        "out": args.out,
        "batch_id": args.batch_id,
        "policy": args.policy,
        "sampling.temperature": args.temperature,
        "sampling.max_tokens": args.max_tokens,
        "sampling.seed": args.seed,
        "limits.max_turns": args.max_turns,
        "limits.max_context": args.max_context,
    }
    cfg = cfgmod.load(RolloutConfig, args.config, overrides)
    endpoints = parse_pairs(args.endpoint, "--endpoint", "BUCKET=URL")
    bucket_flags = parse_pairs(args.bucket, "--bucket", "NAME=TP:BOUND")
    if endpoints or bucket_flags:
        cfg.buckets = merge_bucket_flags(cfg.buckets, endpoints, bucket_flags)
    if args.launch is not None:
        from libra.endpoints.config import BucketConfig

        if not cfg.buckets:
            cfg.buckets = [BucketConfig(name="tp1", tp=1)]
        for b in cfg.buckets:
            b.launch = args.launch
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
