"""`libra simulate`: the cluster simulator for one or more systems on a workload."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from libra.cli.common import add_json_flag, count, print_json, progress, routing_options, seed
from libra.errors import ConfigError

MAX_GPUS = 4096
"""The largest cluster `libra simulate` takes (a typo of a few more digits ran for ever)."""


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help="simulate RL post-training systems on a cluster (discrete events, virtual time)",
        description=(
            "Run systems (Libra, its ablation ladder and the baselines of docs/baselines.md) "
            "on one workload on a simulated cluster: continuous-batching inference "
            "instances and training steps timed by the planner's cost model, tools with "
            "their recorded latencies, the real routing policies and planner. Reports "
            "throughput (generated token/s), time for the steps and GPU use by role."
        ),
    )
    p.add_argument(
        "--workload",
        default="search-r1",
        help="search-r1 | r2e-gym | dapo-math | search-r1-causal (generated, drifting with "
        "the step) or a "
        "TRACE.jsonl[.gz] of trajectory records grouped by their step (default search-r1)",
    )
    p.add_argument("--gpus", type=int, default=48, help="GPUs in the cluster (default 48)")
    p.add_argument(
        "--hardware",
        default="a800-80g",
        help="a800-80g | h100-80g | h200-141g | ascend-910b3 | a profile .toml (default a800-80g)",
    )
    p.add_argument(
        "--model",
        default="qwen3-14b",
        help="qwen3-4b | qwen3-14b | qwen3-32b | qwen3-30b-a3b | a folder with config.json "
        "(default qwen3-14b)",
    )
    p.add_argument("--steps", type=count, default=100, help="training steps (default 100)")
    p.add_argument(
        "--systems",
        default="all",
        help="all | baselines | ladder | NAME,... (names: verl-colocated, "
        "verl-static-uniform, verl-greedy-heuristic, areal-static-optimal, "
        "best-static-colocated, libra-homogeneous, libra-hetero-tp, libra-cmlfq, libra, "
        "ceiling, and the diagnostics libra-oracle-routing, libra-oracle-from-first-return; "
        "all = every one but the diagnostics)",
    )
    p.add_argument("--seed", type=seed, default=0, help="seed of a generated workload")
    p.add_argument(
        "--prompts",
        type=count,
        default=None,
        help="prompts per step (default 32 for search-r1, 16 otherwise)",
    )
    p.add_argument("--group", type=count, default=16, help="samples per prompt (default 16)")
    p.add_argument(
        "--staleness",
        type=count,
        default=1,
        help="asynchronous systems: steps an episode's weights may lag (default 1)",
    )
    p.add_argument(
        "--pipeline",
        choices=("batch", "stream"),
        default="batch",
        help="batch: a step's rollout starts after the previous one's (the planner's "
        "model, default); stream: as soon as staleness allows",
    )
    p.add_argument(
        "--dispatch",
        choices=("spill", "exact"),
        default="spill",
        help="spill: an episode runs on the least-loaded instance of its routed bucket or a "
        "larger one (default); exact: of its routed bucket only",
    )
    p.add_argument(
        "--jobs",
        type=count,
        default=None,
        help="worker processes simulating systems side by side (default: min(2, CPUs))",
    )
    p.add_argument(
        "--routing",
        action="append",
        metavar="KEY=VALUE",
        help="routing option of every system, e.g. objective=accuracy (repeatable; "
        "RoutingConfig, docs/cmlfq.md)",
    )
    p.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write PNG plots to DIR")
    add_json_flag(p)
    return p


def run(args: argparse.Namespace) -> int:
    from libra.config import build
    from libra.sim.config import SimConfig
    from libra.sim.runner import keep_freed_memory, ran, simulate
    from libra.sim.systems import resolve

    if args.gpus < 2:
        raise ConfigError(f"--gpus must be >= 2: one to train, one to roll out (got {args.gpus})")
    if args.gpus > MAX_GPUS:
        raise ConfigError(f"--gpus {args.gpus}: the simulator runs clusters of at most "
                          f"{MAX_GPUS} GPUs (its layout searches grow with the count: 1,024 "
                          "take about a minute); `libra plan` plans any size")  # fmt: skip
    if args.plot is not None:
        if args.plot.exists() and not args.plot.is_dir():
            raise ConfigError(f"--plot {str(args.plot)!r} is a file; pass a directory")
        try:  # now, not after the simulation
            args.plot.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--plot {str(args.plot)!r} cannot be made ({e.strerror or e}); "
                              "pass a directory this user can write") from None  # fmt: skip
    fields = ("workload", "gpus", "hardware", "model", "steps", "seed", "prompts", "group",
              "staleness", "pipeline", "dispatch")  # fmt: skip
    values = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    if args.routing:
        values["routing"] = routing_options(args.routing)
    cfg = build(SimConfig, values)
    systems = resolve(args.systems)
    if args.plot is not None:
        from libra.sim.plot import _pyplot

        _pyplot()  # fail before simulating, not after
    jobs = args.jobs or min(2, os.cpu_count() or 1)
    keep_freed_memory()  # this process only simulates
    result = simulate(cfg, systems, jobs=jobs, progress=progress)
    if not ran(result["systems"]):
        why = "; ".join(f"{r['system']}: {r['error']}" for r in result["systems"])
        raise ConfigError(
            f"no system can run {cfg.model} on {cfg.gpus} x {cfg.hardware} ({why}); give more "
            "--gpus or a smaller --model"
        )
    if args.plot is not None:
        from libra.sim.plot import write_plots

        for f in write_plots(result, args.plot):
            progress(f"wrote {f}")
    if args.json:
        print_json(result)
    else:
        print(render(result))
    return 0


def render(result: dict[str, Any]) -> str:
    c, w = result["config"], result["workload"]
    systems = result["systems"]
    ref = next((r for r in systems if r["system"] == "libra" and "error" not in r), None)
    lines = [
        f"simulate: {w['name']} ({w['episodes_per_step']} episodes/step, p50 "
        f"{w['total_tokens_p50']:,} / max {w['total_tokens_max']:,} tokens), {c['model']} on "
        f"{c['gpus']} x {c['hardware']}, {c['steps']} steps, {c['pipeline']} pipeline, "
        f"staleness {c['staleness']}",
        f"  {'system':<22} {'token/s':>8} {'libra /' if ref else '':>8} {'time (h)':>9}"
        f"   GPU use: {'rollout':>7} {'train':>6} {'reconf':>6} {'idle':>6}"
        f"   {'moves/ep':>8} {'migrated':>8}",
    ]
    for r in systems:
        if "error" in r:
            lines.append(f"  {r['system']:<22} cannot run: {r['error']}")
            continue
        u = r["utilization"]
        moves = sum(r["routing"]["moves_per_episode"].values())
        ratio = f"{ref['throughput'] / r['throughput']:.2f}x" if ref else ""
        lines.append(
            f"  {r['system']:<22} {r['throughput']:>8,.0f} {ratio:>8} {r['time_s'] / 3600:>9.2f}"
            f"            {u['rollout']:>7.1%} {u['training']:>6.1%} {u['reconfiguration']:>6.1%}"
            f" {u['idle']:>6.1%}   {moves:>8.2f} {r['routing']['migrated_token_ratio']:>8.1%}"
        )
    if ref:
        lines.append(
            "  libra / : Libra's throughput divided by the row's (above 1.00x: Libra finished "
            "faster); GPU use: share of GPU-time per activity"
        )
    h = result.get("headroom")
    if h:
        captured = "none to capture" if h["captured"] is None else f"{h['captured']:.0%}"
        lines.append(
            f"  headroom: best baseline {h['best_baseline']}; libra / it "
            f"{h['libra_over_best_baseline']:.2f}x, ceiling / it "
            f"{h['ceiling_over_best_baseline']:.2f}x; Libra captured {captured} of the headroom"
        )
    t = result["timing"]
    lines.append(
        f"  simulated in {t['cpu_s']:.1f} s CPU, {t['wall_s']:.1f} s wall ({t['jobs']} jobs)"
    )
    return "\n".join(lines)
