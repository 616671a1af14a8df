"""`libra plan`: the planner's choice for a cluster, a model and a workload."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from libra.cli.common import add_json_flag, count, print_json, progress, seed
from libra.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help="plan GPUs between training and rollout for a model and workload",
        description=(
            "Split a GPU budget between training and rollout: training parallelism "
            "(TP/PP/DP/EP, micro-batch, ZeRO) and the mix of rollout instances by TP size "
            "with the request lengths each serves, minimising the predicted iteration time."
        ),
    )
    p.add_argument("--gpus", type=count, required=True, help="GPUs in the cluster")
    p.add_argument(
        "--hardware",
        default="a800-80g",
        help="a800-80g | h100-80g | h200-141g | ascend-910b3 | local (measured here) | "
        "a profile .toml (default: a800-80g)",
    )
    p.add_argument(
        "--model",
        default="qwen3-14b",
        help="qwen3-4b | qwen3-14b | qwen3-32b | qwen3-30b-a3b | a folder with config.json "
        "(default: qwen3-14b)",
    )
    p.add_argument(
        "--workload",
        default="search-r1",
        help="search-r1 | r2e-gym | dapo-math | search-r1-causal (generated) or a "
        "TRACE.jsonl of trajectory "
        "records (default: search-r1)",
    )
    p.add_argument(
        "--batch",
        type=count,
        default=None,
        help="prompts per step (default 64; for a trace: all of its episodes)",
    )
    p.add_argument("--group", type=count, default=None, help="samples per prompt (default 16)")
    p.add_argument("--step", type=int, default=0, help="training step of a generated workload")
    p.add_argument("--seed", type=seed, default=0, help="seed of a generated workload")
    p.add_argument(
        "--sync",
        action="store_true",
        help="synchronous RL: t_iter = t_rollout + t_train + weight sync (default: async, max)",
    )
    p.add_argument(
        "--colocated",
        action="store_true",
        help="also consider the time-shared plan (every GPU trains, then every GPU rolls "
        "out) and print it when its iteration is shorter; libra train cannot run it",
    )
    p.add_argument(
        "--exhaustive", action="store_true", help="search without pruning (for verification)"
    )
    p.add_argument(
        "--bins",
        type=count,
        default=None,
        help="length bins for the rollout assignment (default 32)",
    )
    add_json_flag(p)
    return p


GENERATED = 16_384
"""Episodes generated at most for a step: a larger batch is this sample resampled to its
size (`WorkloadStats.resample`: the same length distribution, tail included), since
generating a million episodes took minutes and gigabytes for the same figures."""
MAX_EPISODES = 1 << 22
"""Episodes a step may have (--batch x --group)."""


def load_workload(spec: str, batch: int | None, group: int | None, step: int, seed: int) -> Any:
    """Trajectory records -> WorkloadStats, from a trace file or a named generator."""
    from libra.planner import WorkloadStats

    prompts, samples = batch or 64, group or 16
    if prompts * samples > MAX_EPISODES:
        raise ConfigError(
            f"--batch {prompts} x --group {samples} is {prompts * samples:,} episodes a step; "
            f"the planner models at most {MAX_EPISODES:,}"
        )

    path = Path(spec)
    if spec.endswith((".jsonl", ".jsonl.gz")) or path.is_file():
        from libra.record import read_jsonl

        if not path.is_file():
            raise ConfigError(f"--workload {spec!r}: no such trace file")
        try:
            stats = WorkloadStats.from_records(read_jsonl(path))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if batch is not None or group is not None:
            stats = stats.resample(prompts * samples)
        return stats
    try:
        from libra.sim import workloads
    except ImportError:
        raise ConfigError(
            f"--workload {spec!r}: the workload generators (libra.sim.workloads) are not "
            "available in this installation; pass a TRACE.jsonl of trajectory records"
        ) from None
    if spec not in workloads.WORKLOADS:
        known = ", ".join(workloads.WORKLOADS)
        raise ConfigError(f"unknown workload {spec!r}; known: {known} (or a TRACE.jsonl file)")
    if prompts * samples <= GENERATED:
        return WorkloadStats.from_records(
            workloads.sample(spec, prompts, samples, step=step, seed=seed)
        )
    few = min(samples, GENERATED)  # a sample of the step's prompts and their groups
    records = workloads.sample(spec, max(1, GENERATED // few), few, step=step, seed=seed)
    return WorkloadStats.from_records(records).resample(prompts * samples)


def run(args: argparse.Namespace) -> int:
    from libra.config import build
    from libra.planner import PlannerSettings, calibrate_local, load_hardware, load_model, plan

    model = load_model(args.model)
    if args.hardware == "local":
        progress(f"calibrating this machine as {args.gpus} devices ...")
        hw = calibrate_local(
            devices=args.gpus, hidden=model.hidden, intermediate=model.intermediate or None
        )
    else:
        hw = load_hardware(args.hardware)
    stats = load_workload(args.workload, args.batch, args.group, args.step, args.seed)
    given = {"sync": args.sync, **({"bins": args.bins} if args.bins else {})}
    settings = build(PlannerSettings, given, "flags")
    result = plan(
        model,
        hw,
        stats,
        args.gpus,
        settings,
        exhaustive=args.exhaustive,
        clock=time.perf_counter,
        colocated=args.colocated,
    )
    if args.json:
        print_json({"workload": {"source": args.workload, **stats.summary()}, **result.as_dict()})
        return 0
    print(render(result, args.workload, stats.summary()))
    return 0


def render(p: Any, workload: str, summary: dict[str, Any]) -> str:
    """The plan as a short report."""
    c, t = p.train.config, p.train
    mode = {
        "colocated": "colocated (time-shared: all GPUs train, then all roll out)",
        "sync": "synchronous",
        "async": "asynchronous",
    }[p.mode]
    gpus = "devices" if p.hardware == "local" else "GPUs"
    lines = [
        f"plan: {p.model} on {p.gpus} x {p.hardware}, {workload} "
        f"({summary['episodes']} episodes, p50 {summary['total_tokens_p50']:,} / "
        f"max {summary['total_tokens_max']:,} tokens), {mode} RL",
        f"  t_iter {p.t_iter:.1f} s   (t_train {p.t_train:.1f} s, t_rollout {p.t_rollout:.1f} s"
        + (f", weight sync {p.sync_s:.1f} s)" if p.sync else ")"),
        f"  training: {c.gpus} {gpus}  TP {c.tp} x PP {c.pp} x DP {c.dp}"
        + (f" (EP {c.ep})" if c.ep > 1 else "")
        + f", micro-batch {c.micro_batch_tokens:,} tokens ({t.micro_batches} per rank), "
        f"ZeRO-{c.zero}, recompute {'on' if c.recompute else 'off'}, "
        f"{t.memory_bytes / 2**30:.1f} of {t.memory_limit / 2**30:.1f} GiB",
        f"  rollout: {p.rollout_gpus} {gpus}",
        "     TP  instances  GPUs  episodes   final context (tokens)   t (s)",
    ]
    for g in p.rollout.groups:
        lines.append(
            f"   {g.tp:>4}  {g.instances:>9}  {g.gpus:>4}  {g.episodes:>8}"
            f"   {g.min_tokens:>9,} - {g.max_tokens:<9,}   {g.time_s:7.1f}"
        )
    if p.idle_gpus:
        lines.append(f"  idle: {p.idle_gpus} {gpus} (more would not shorten the iteration)")
    s = p.search
    lines.append(
        f"  search{' (exhaustive)' if s.get('exhaustive') else ''}: "
        f"{s.get('train_evaluated', 0)} training configs timed, "
        f"pruned {s.get('train_pruned_memory', 0)} by memory, "
        f"{s.get('train_pruned_dominated', 0)} dominated, "
        f"{s.get('train_pruned_divisibility', 0)} by divisibility, "
        f"{s.get('train_gpu_counts_bounded', 0)} {gpus[:-1]} counts by bound; "
        + (
            f"{s.get('rollout_mixes_evaluated', 0)} rollout mixes x segmentations"
            if s.get("exhaustive")
            else f"{s.get('rollout_dp_solves', 0)} rollout DP solves"
        )
        + f"; solve {s['solve_s']:.3f} s"
    )
    return "\n".join(lines)
