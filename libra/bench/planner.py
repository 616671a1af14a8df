"""Planner solve time at 48 / 512 / 4,096 GPUs, and pruned vs exhaustive search on 8-32 GPUs.

Qwen3-14B on A800s, a Search-R1 batch of 64 prompts x 16 samples (the workload
generator, seed 0). Solve times are medians over `--repeats` runs in this process; the
goals are <= 0.1 s at 48 GPUs and <= 10 s at 4,096, and the pruned search must return
exactly the exhaustive search's t_iter.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

GOALS_S = {48: 0.1, 4096: 10.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=5, help="solves per size (median reported)")
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--hardware", default="a800-80g")
    p.add_argument("--workload", default="search-r1")
    p.add_argument(
        "--quick", action="store_true", help="48 GPUs and 8/16-GPU exhaustive checks only"
    )


def _timed(fn: Any, repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from libra.cli.common import progress
    from libra.cli.plan import load_workload
    from libra.planner import PlannerSettings, load_hardware, load_model, plan

    model, hw = load_model(args.model), load_hardware(args.hardware)
    stats = load_workload(args.workload, 64, 16, 0, 0)
    sizes = (48,) if args.quick else (48, 512, 4096)
    small = (8, 16) if args.quick else (8, 16, 24, 32)
    solve_rows = []
    for sync in (False, True):
        settings = PlannerSettings(sync=sync)
        for gpus in sizes:
            progress(f"planner: {gpus} GPUs {'sync' if sync else 'async'} ...")
            median, p = _timed(
                lambda g=gpus, s=settings: plan(model, hw, stats, g, s), args.repeats
            )
            goal = GOALS_S.get(gpus) if not sync else None
            solve_rows.append(
                {
                    "gpus": gpus,
                    "mode": "sync" if sync else "async",
                    "solve_s": round(median, 4),
                    "goal_s": goal,
                    "meets_goal": None if goal is None else median <= goal,
                    "t_iter_s": round(p.t_iter, 3),
                    "train_gpus": p.train_gpus,
                    "rollout_mix": {str(k): v for k, v in p.rollout.mix().items()},
                    "rollout_dp_solves": p.search.get("rollout_dp_solves", 0),
                    "train_configs_timed": p.search.get("train_evaluated", 0),
                }
            )
    exact_rows = []
    for sync in (False, True):
        settings = PlannerSettings(sync=sync)
        for gpus in small:
            progress(
                f"planner: pruned vs exhaustive, {gpus} GPUs {'sync' if sync else 'async'} ..."
            )
            t_p, pruned = _timed(lambda g=gpus, s=settings: plan(model, hw, stats, g, s), 1)
            t_x, full = _timed(
                lambda g=gpus, s=settings: plan(model, hw, stats, g, s, exhaustive=True), 1
            )
            exact_rows.append(
                {
                    "gpus": gpus,
                    "mode": "sync" if sync else "async",
                    "t_iter_pruned_s": pruned.t_iter,
                    "t_iter_exhaustive_s": full.t_iter,
                    "equal": pruned.t_iter == full.t_iter,
                    "solve_pruned_s": round(t_p, 4),
                    "solve_exhaustive_s": round(t_x, 3),
                    "speedup": round(t_x / max(t_p, 1e-9), 1),
                    "train_configs_timed": [
                        pruned.search.get("train_evaluated", 0),
                        full.search.get("train_evaluated", 0),
                    ],
                    "rollout_plans_timed_exhaustive": full.search.get(
                        "rollout_segmentations_evaluated", 0
                    ),
                }
            )
    return {
        "model": model.id,
        "hardware": hw.id,
        "workload": {"name": args.workload, "prompts": 64, "group": 16, **stats.summary()},
        "bins": PlannerSettings().bins,
        "repeats": args.repeats,
        "solve_time": solve_rows,
        "pruned_vs_exhaustive": exact_rows,
        "exact": all(r["equal"] for r in exact_rows),
        "goals_met": all(r["meets_goal"] for r in solve_rows if r["meets_goal"] is not None),
    }
