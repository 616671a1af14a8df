"""Libra against its baselines and the ceiling over a grid of simulated cells.

A cell is a workload x a GPU count x a batch size (the default prompts per step, or a
multiple); each runs every system (`--systems`, default all) on several generator seeds,
the same seeds for every system of the cell, so ratios are paired. Per cell: each
system's throughput (mean, min, max over seeds), Libra / each baseline and the ceiling /
the best baseline (per seed, then mean and spread), and the share of the headroom between
the best baseline and the ceiling that Libra captured. Over the grid: the worst cell, the
geometric mean of Libra / best baseline beside the ceiling's. Cells x seeds run in worker
processes (`--jobs`); results do not depend on it.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from libra.cli.common import count

DEFAULT_STEPS = 10
"""Steps per run: what the full grid affords in about 20 CPU-minutes (docs/simulation.md)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="search-r1,r2e-gym,dapo-math")
    p.add_argument("--gpus", default="24,48,96", help="GPU counts (comma-separated)")
    p.add_argument(
        "--prompt-scales", default="1,4", help="multiples of the workload's default prompts"
    )
    p.add_argument("--seeds", type=count, default=3, help="generator seeds per cell (0..N-1)")
    p.add_argument("--steps", type=count, default=DEFAULT_STEPS, help="steps per run")
    p.add_argument("--systems", default="all", help="as libra simulate --systems")
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--hardware", default="a800-80g")
    p.add_argument(
        "--jobs", type=count, default=None, help="worker processes (default: min(2, CPUs))"
    )


def _job(job: tuple[dict[str, Any], str]) -> dict[str, Any]:
    from libra.sim.config import SimConfig
    from libra.sim.runner import ran, simulate
    from libra.sim.systems import resolve

    fields, systems = job
    c0 = time.process_time()
    out = simulate(SimConfig(**fields), resolve(systems))
    libra = next((r for r in out["systems"] if r["system"] == "libra"), None)
    fm = libra.get("forward_model") if libra else None
    return {
        **fields,
        "throughput": {r["system"]: r["throughput"] for r in ran(out["systems"])},
        # systems that cannot run on this cluster: no bar in this cell (`run_system`)
        "cannot_run": {r["system"]: r["error"] for r in out["systems"] if "error" in r},
        # Libra's predictions, each made before its layout ran, against the simulation
        "libra_forecast_errors": [x["rel_error"] for x in fm["scores"]] if fm else [],
        "cpu_s": time.process_time() - c0,
    }


def _spread(xs: list[float], digits: int = 3) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(xs), digits),
        "min": round(min(xs), digits),
        "max": round(max(xs), digits),
    }


def cell_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from its paired runs (one per seed)."""
    from libra.sim.systems import BASELINES

    # a system that cannot run on the cell's cluster does so in every seed (the cluster,
    # model and hardware are the cell's); the cell compares those that ran
    names = [n for n in runs[0]["throughput"] if all(n in r["throughput"] for r in runs)]
    bases = [n for n in BASELINES if n in names]
    out: dict[str, Any] = {
        "throughput": {n: _spread([r["throughput"][n] for r in runs], 1) for n in names},
    }
    cannot = {n: e for r in runs for n, e in r.get("cannot_run", {}).items()}
    if cannot:
        out["cannot_run"] = cannot
    errors = [e for r in runs for e in r.get("libra_forecast_errors", [])]
    if errors:
        out["libra_forecast"] = {"scored": len(errors), "median_rel_error": _median(errors)}
    if "libra" not in names or not bases:
        return out
    best = [max(r["throughput"][n] for n in bases) for r in runs]
    libra = [r["throughput"]["libra"] for r in runs]
    out["libra_over"] = {
        n: _spread([lb / r["throughput"][n] for lb, r in zip(libra, runs, strict=True)])
        for n in bases
    }
    out["libra_over_best_baseline"] = _spread([lb / b for lb, b in zip(libra, best, strict=True)])
    if "ceiling" in names:
        top = [r["throughput"]["ceiling"] for r in runs]
        out["ceiling_over_best_baseline"] = _spread([c / b for c, b in zip(top, best, strict=True)])
        lib, ceil = (
            out["libra_over_best_baseline"]["mean"],
            out["ceiling_over_best_baseline"]["mean"],
        )
        out["captured"] = round((lib - 1) / (ceil - 1), 3) if ceil > 1 else None
    return out


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def grid_summary(
    cells: list[dict[str, Any]], runs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The worst cell, geometric means, the mean captured headroom; with `runs`, the
    median error of Libra's predictions over the whole grid."""
    rated = [c for c in cells if "libra_over_best_baseline" in c]
    errors = [e for r in runs or [] for e in r.get("libra_forecast_errors", [])]
    # every layout Libra chose, scored on its first step run wholly in it against the
    # prediction made before it ran (`libra.sim.metrics.forward_model`); a prediction the
    # model could not make (infinite) counts as larger than any other
    forecast = {
        "libra_forecasts_scored": len(errors),
        "libra_forecast_median_rel_error": _median(errors) if errors else None,
        "libra_forecasts_within_10pct": round(sum(e <= 0.1 for e in errors) / len(errors), 3)
        if errors
        else None,
        "libra_forecasts_infinite": sum(1 for e in errors if math.isinf(e)),
    }
    if not rated:
        return forecast if errors else {}
    worst = min(rated, key=lambda c: c["libra_over_best_baseline"]["mean"])

    def geo(key: str) -> float | None:
        xs = [c[key]["mean"] for c in rated if key in c]
        return round(math.exp(statistics.fmean(math.log(x) for x in xs)), 4) if xs else None

    captured = [c["captured"] for c in rated if c.get("captured") is not None]
    g_lib, g_ceil = geo("libra_over_best_baseline"), geo("ceiling_over_best_baseline")
    return {
        "cells": len(rated),
        "worst_cell": {k: worst[k] for k in ("workload", "gpus", "prompts")}
        | {"libra_over_best_baseline": worst["libra_over_best_baseline"]["mean"]},
        "cells_libra_below_0.99": sum(
            1 for c in rated if c["libra_over_best_baseline"]["mean"] < 0.99
        ),
        "geomean_libra_over_best_baseline": g_lib,
        "geomean_ceiling_over_best_baseline": g_ceil,
        # A cell with little headroom makes its share huge either way: the pooled share
        # (of the geometric means) is the steadier figure.
        "pooled_captured": round((g_lib - 1) / (g_ceil - 1), 3)
        if g_lib is not None and g_ceil is not None and g_ceil > 1
        else None,
        "mean_captured": round(statistics.fmean(captured), 3) if captured else None,
        "cells_without_headroom": sum(
            1 for c in rated if "captured" in c and c["captured"] is None
        ),
        **forecast,
    }


def run_grid(
    workloads: list[str],
    gpus: list[int],
    scales: list[int],
    seeds: int,
    steps: int,
    *,
    systems: str = "all",
    model: str = "qwen3-14b",
    hardware: str = "a800-80g",
    jobs: int = 1,
    progress: Any = None,
) -> dict[str, Any]:
    from libra.sim.config import DEFAULT_PROMPTS
    from libra.sim.systems import resolve

    resolve(systems)  # a bad name fails before anything runs
    say = progress or (lambda msg: None)
    w0, c0 = time.perf_counter(), time.process_time()
    cells = [
        {"workload": w, "gpus": g, "prompts": DEFAULT_PROMPTS.get(w, 16) * k, "scale": k}
        for w in workloads
        for g in gpus
        for k in scales
    ]
    todo: list[tuple[dict[str, Any], str]] = [
        ({"workload": c["workload"], "gpus": c["gpus"], "prompts": c["prompts"], "seed": s,
          "steps": steps, "model": model, "hardware": hardware}, systems)
        for c in cells
        for s in range(seeds)
    ]  # fmt: skip
    todo.sort(key=lambda j: -j[0]["prompts"] * j[0]["gpus"])  # biggest first: even finish
    say(f"sim-grid: {len(cells)} cells x {seeds} seeds, {steps} steps per run, {jobs} jobs")
    done: list[dict[str, Any]] = []
    if jobs == 1:
        for j in todo:
            done.append(_job(j))
            say(f"  {_where(done[-1])} ({done[-1]['cpu_s']:.1f} s CPU)")
    else:
        with ProcessPoolExecutor(jobs, mp_context=get_context("fork")) as pool:
            for r in pool.map(_job, todo):
                done.append(r)
                say(f"  {_where(r)} ({r['cpu_s']:.1f} s CPU)")
    out = []
    for c in cells:
        runs = sorted(
            (r for r in done if all(r[k] == c[k] for k in ("workload", "gpus", "prompts"))),
            key=lambda r: r["seed"],
        )
        out.append({**c, "seeds": [r["seed"] for r in runs], **cell_summary(runs)})
    child = os.times()
    return {
        "steps": steps,
        "seeds": seeds,
        "model": model,
        "hardware": hardware,
        "systems": [s.name for s in resolve(systems)],
        "cells": out,
        "summary": grid_summary(out, done),
        "timing": {
            "cpu_s": round(
                time.process_time() - c0 + child.children_user + child.children_system, 1
            ),
            "wall_s": round(time.perf_counter() - w0, 1),
            "jobs": jobs,
        },
    }


def _where(r: dict[str, Any]) -> str:
    return f"{r['workload']} {r['gpus']} GPUs {r['prompts']} prompts seed {r['seed']}"


def render(doc: dict[str, Any]) -> str:
    """The grid as a table (what `run` prints to stderr)."""
    lines = [
        f"sim-grid: {doc['model']} on {doc['hardware']}, {doc['steps']} steps, seeds "
        f"0..{doc['seeds'] - 1} paired; libra / best baseline and ceiling / best baseline: "
        "mean [min, max] over seeds",
        f"  {'workload':<10} {'GPUs':>4} {'prompts':>7}  {'best baseline':<22} "
        f"{'libra / best':>20} {'ceiling / best':>20} {'captured':>8}",
    ]
    for c in doc["cells"]:
        if "libra_over_best_baseline" not in c:
            continue
        means = {n: c["throughput"][n]["mean"] for n in c["libra_over"]}
        best = max(means, key=lambda n: means[n])
        lo, ce = c["libra_over_best_baseline"], c.get("ceiling_over_best_baseline")
        cap = c.get("captured")
        lines.append(
            f"  {c['workload']:<10} {c['gpus']:>4} {c['prompts']:>7}  {best:<22} "
            f"{lo['mean']:>6.3f} [{lo['min']:.3f}, {lo['max']:.3f}] "
            + (f"{ce['mean']:>6.3f} [{ce['min']:.3f}, {ce['max']:.3f}] " if ce else " " * 21)
            + (f"{cap:>8.0%}" if cap is not None else f"{'-':>8}")
        )
        if c.get("cannot_run"):
            lines.append(f"    cannot run on this cluster: {', '.join(sorted(c['cannot_run']))}")
    s = doc["summary"]
    if "worst_cell" in s:
        w = s["worst_cell"]
        lines.append(
            f"  worst cell: {w['workload']} {w['gpus']} GPUs {w['prompts']} prompts, libra / "
            f"best baseline {w['libra_over_best_baseline']:.3f}; cells below 0.99: "
            f"{s['cells_libra_below_0.99']} of {s['cells']}"
        )
        lines.append(
            f"  geometric mean: libra / best baseline {s['geomean_libra_over_best_baseline']}, "
            f"ceiling / best baseline {s['geomean_ceiling_over_best_baseline']}; captured "
            f"headroom: pooled {s['pooled_captured']}, mean over cells {s['mean_captured']} "
            f"({s['cells_without_headroom']} cells without any)"
        )

    if s.get("libra_forecasts_scored"):
        lines.append(
            f"  Libra's forward model: median |predicted - simulated| / simulated iteration "
            f"{s['libra_forecast_median_rel_error']} over {s['libra_forecasts_scored']} "
            f"layouts it chose, each predicted before it ran "
            f"({s['libra_forecasts_within_10pct']:.0%} within 10%, "
            f"{s['libra_forecasts_infinite']} infinite)"
        )
    t = doc["timing"]
    lines.append(f"  {t['cpu_s']:.0f} s CPU, {t['wall_s']:.0f} s wall ({t['jobs']} jobs)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from libra.cli.common import int_list, progress
    from libra.sim.runner import keep_freed_memory

    keep_freed_memory()  # this process only simulates
    doc = run_grid(
        [w.strip() for w in args.workloads.split(",") if w.strip()],
        int_list(args.gpus, "--gpus", 2, "24,48,96"),  # one GPU to train, one to roll out
        int_list(args.prompt_scales, "--prompt-scales", 1, "1,4"),
        args.seeds,
        args.steps,
        systems=args.systems,
        model=args.model,
        hardware=args.hardware,
        jobs=args.jobs or min(2, os.cpu_count() or 1),
        progress=progress,
    )
    progress(render(doc))
    return doc
