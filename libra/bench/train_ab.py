"""Train A/B: does the planner make `libra train` faster than keeping its first split?

The same config runs in paired arms on the same seeds:

- `planner`: as configured (with `fleet.hybrid_start = "plan"` the planner places the
  hybrids at start, then moves them and measures what it did);
- `fixed`: every hybrid in rollout from the start, kept for the whole run
  (`planner.adapt = false`, `fleet.hybrid_start = "rollout"`);
- `fixed-train` (optional, `--arms`): every hybrid in training from the start, kept: with
  `fixed`, the two static splits of a one-hybrid fleet (the short sweep).

The warm start is deterministic (`model.seed`), so it runs once and every arm starts
from its folder (`model.path`, `sft.steps = 0`). Arms alternate their order from seed
to seed so a drift of the machine's load does not favour one. Each run is a real
`libra train` process. Per arm: mean wall seconds per step (all steps, and after the
first, which fills the pipeline), generated tokens per second, reward and validation at
equal steps, role switches and reverts. Per pair: planner / fixed step time; over
pairs: mean and spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from libra.cli.common import count, progress

ARMS = {
    "planner": [],
    "fixed": ["--set", "planner.adapt=false", "--set", 'fleet.hybrid_start="rollout"'],
    "fixed-train": ["--set", "planner.adapt=false", "--set", 'fleet.hybrid_start="train"'],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a libra train config (examples/cpu-train-ab.toml)")
    p.add_argument("--seeds", default="0,1,2", help="paired seeds (default 0,1,2)")
    p.add_argument("--steps", type=count, default=None, help="GRPO steps per run (config's)")
    p.add_argument("--arms", default="planner,fixed", help=f"of {', '.join(ARMS)}")
    p.add_argument("--out", default="runs/train-ab", help="where the runs go")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from libra.errors import ConfigError

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or "planner" not in arms or len(arms) < 2:
        raise ConfigError(f"--arms {args.arms}: name `planner` and at least one of "
                          f"{', '.join(a for a in ARMS if a != 'planner')}")  # fmt: skip
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {args.seeds}: expected integers, e.g. 0,1,2") from None
    out = Path(args.out)
    start = _warm_start(args.config, out / "warm-start")
    common = [] if start is None else ["--set", f'model.path="{start}"', "--set", "sft.steps=0"]
    if args.steps is not None:
        common += ["--steps", str(args.steps)]
    runs: dict[str, dict[int, dict[str, Any]]] = {a: {} for a in arms}
    for i, seed in enumerate(seeds):
        order = arms if i % 2 == 0 else arms[::-1]
        for arm in order:
            folder = out / f"{arm}-s{seed}"
            progress(f"bench train-ab: {arm}, seed {seed} -> {folder}")
            runs[arm][seed] = _one(args.config, folder, seed, common + ARMS[arm])
    return _compare(runs, seeds, arms)


def _warm_start(config: str, out: Path) -> Path | None:
    """The warm-started model every arm starts from (made once, kept in `out` for a
    later invocation); None when the config has no warm start."""
    from libra.train import load_config

    cfg = load_config(config, {"out": str(out)})
    if cfg.sft.steps == 0:
        return None
    done = out / "sft"
    if not (done / "config.json").is_file():
        progress(f"bench train-ab: warm start ({cfg.sft.steps} steps) -> {done}")
        asyncio.run(_fit(cfg, out))
    return done.resolve()


async def _fit(cfg: Any, out: Path) -> Path:
    from libra.chat import ChatTokenizer
    from libra.rollout.run import load_env
    from libra.train.build import train_tasks
    from libra.train.display import Display, View
    from libra.train.report import Report
    from libra.train.setup import prepare_model, warm_start

    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    base = await prepare_model(cfg, out)
    env = load_env(cfg.data.env, cfg.data.env_options)
    report = Report(out)
    try:
        tasks, _ = train_tasks(cfg, env)
        start, _ = await warm_start(cfg, out, base, env, ChatTokenizer(base), tasks, View(),
                                    Display("off"), report, lambda: False)  # fmt: skip
    finally:
        report.close()
        await env.close()
    return start


def _one(config: str, out: Path, seed: int, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "libra", "train", config, "--out", str(out), "--seed",
           str(seed), "--fresh", "--display", "off", "--json", *extra]  # fmt: skip
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=os.environ.copy())
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {' | '.join(tail)}")
    rows = _rows(out / "metrics.jsonl")
    events = _rows(out / "events.jsonl")
    decisions = _rows(out / "decisions.jsonl")
    steps = [x["step_s"] for x in rows]
    validation = [e for e in events if e["event"] == "validation"]
    applied = [d for d in decisions if d.get("apply") and d.get("trigger") != "initial"]
    gen = sum(x["gen_tokens_per_s"] * x["step_s"] for x in rows)
    return {
        "wall_s": time.monotonic() - t0,
        "steps": len(rows),
        "step_s": statistics.fmean(steps),
        "step_s_after_first": statistics.fmean(steps[1:]) if len(steps) > 1 else None,
        "gen_tokens_per_s": gen / sum(steps) if steps else 0.0,
        "reward": [round(x["reward"], 3) for x in rows],
        "reward_mean": statistics.fmean(x["reward"] for x in rows),
        "validation": {str(e["version"]): e["reward"] for e in validation},
        "switches": sum(e["event"] == "switch-done" for e in events),
        "reverts": [d["step"] for d in decisions if d.get("revert")],
        "applied": [(d["step"], d["candidate"].get("hybrids_training")) for d in applied],
    }


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _compare(
    runs: dict[str, dict[int, dict[str, Any]]], seeds: list[int], arms: list[str]
) -> dict[str, Any]:
    per_arm = {
        a: {
            "step_s_mean": statistics.fmean(runs[a][s]["step_s"] for s in seeds),
            "gen_tokens_per_s_mean": statistics.fmean(
                runs[a][s]["gen_tokens_per_s"] for s in seeds
            ),
            "reward_mean": statistics.fmean(runs[a][s]["reward_mean"] for s in seeds),
        }
        for a in arms
    }
    ratios: dict[str, dict[str, Any]] = {}
    for a in arms:
        if a == "planner":
            continue
        r = [runs["planner"][s]["step_s"] / runs[a][s]["step_s"] for s in seeds]
        ratios[f"planner/{a}"] = {
            "step_s_ratio_per_seed": [round(x, 3) for x in r],
            "mean": statistics.fmean(r),
            "min": min(r),
            "max": max(r),
        }
    best_fixed = min((a for a in arms if a != "planner"), key=lambda a: per_arm[a]["step_s_mean"])
    return {
        "seeds": seeds,
        "arms": per_arm,
        "ratios": ratios,
        "best_fixed": best_fixed,
        "planner_not_slower_than_fixed": per_arm["planner"]["step_s_mean"]
        <= per_arm["fixed"]["step_s_mean"]
        if "fixed" in per_arm
        else None,
        "runs": {a: {str(s): runs[a][s] for s in seeds} for a in arms},
    }


__all__ = ["add_arguments", "run"]
