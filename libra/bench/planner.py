"""Planner solve time at 48 / 512 / 4,096 GPUs, and pruned vs exhaustive search on 8-32 GPUs.

`--validate` prints the cost model's validation instead (docs/cost-model.md).

Qwen3-14B on A800s, a Search-R1 batch of 64 prompts x 16 samples (the workload
generator, seed 0). Solve times are medians over `--repeats` runs in this process, wall
and CPU (process) time; the goals are <= 0.1 s at 48 GPUs and <= 10 s at 4,096, and the
pruned search must return exactly the exhaustive search's t_iter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from libra.cli.common import count

GOALS_S = {48: 0.1, 4096: 10.0}


def _load() -> list[float] | None:
    try:
        return [round(x, 1) for x in os.getloadavg()]
    except OSError:
        return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=count, default=5, help="solves per size (median reported)")
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--hardware", default="a800-80g")
    p.add_argument("--workload", default="search-r1")
    p.add_argument(
        "--quick", action="store_true", help="48 GPUs and 8/16-GPU exhaustive checks only"
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="instead: the cost model against published vLLM measurements, the paper's "
        "1K -> 32K asymmetry, and the plan's sensitivity to each efficiency",
    )


def _timed(fn: Any, repeats: int) -> tuple[float, float, Any]:
    """Median wall and CPU (process) seconds of `fn` over `repeats` calls, and its result.
    On a shared machine CPU time is what the solve costs; wall time adds waiting."""
    wall, cpu, out = [], [], None
    for _ in range(max(1, repeats)):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu), out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from libra.cli.common import progress
    from libra.cli.plan import load_workload
    from libra.planner import PlannerSettings, load_hardware, load_model, plan

    model, hw = load_model(args.model), load_hardware(args.hardware)
    stats = load_workload(args.workload, 64, 16, 0, 0)
    if args.validate:
        from libra.planner import validation

        progress("planner: validation (decode, KV log, sequence length, sensitivity) ...")
        return {
            "decode_vs_vllm": validation.decode_table(),
            "kv_cache_vs_vllm_log": validation.kv_log_check(),
            "sequence_length_1k_to_32k": validation.sequence_length_table(),
            "sensitivity": {
                "model": model.id,
                "workload": args.workload,
                "gpus": 48,
                **validation.sensitivity(model, hw, stats, 48),
            },
        }
    sizes = (48,) if args.quick else (48, 512, 4096)
    small = (8, 16) if args.quick else (8, 16, 24, 32)
    solve_rows = []
    for sync in (False, True):
        settings = PlannerSettings(sync=sync)
        for gpus in sizes:
            progress(f"planner: {gpus} GPUs {'sync' if sync else 'async'} ...")
            wall, cpu, p = _timed(
                lambda g=gpus, s=settings: plan(model, hw, stats, g, s), args.repeats
            )
            goal = GOALS_S.get(gpus) if not sync else None
            solve_rows.append(
                {
                    "gpus": gpus,
                    "mode": "sync" if sync else "async",
                    "solve_s": round(wall, 4),
                    "solve_cpu_s": round(cpu, 4),
                    "goal_s": goal,
                    "meets_goal_cpu": None if goal is None else cpu <= goal,
                    "meets_goal_wall": None if goal is None else wall <= goal,
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
            _, t_p, pruned = _timed(lambda g=gpus, s=settings: plan(model, hw, stats, g, s), 1)
            _, t_x, full = _timed(
                lambda g=gpus, s=settings: plan(model, hw, stats, g, s, exhaustive=True), 1
            )
            exact_rows.append(
                {
                    "gpus": gpus,
                    "mode": "sync" if sync else "async",
                    "t_iter_pruned_s": pruned.t_iter,
                    "t_iter_exhaustive_s": full.t_iter,
                    "equal": pruned.t_iter == full.t_iter,
                    "solve_pruned_cpu_s": round(t_p, 4),
                    "solve_exhaustive_cpu_s": round(t_x, 3),
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
        "load_average": _load(),
        "goals_met_cpu": all(
            r["meets_goal_cpu"] for r in solve_rows if r["meets_goal_cpu"] is not None
        ),
    }
