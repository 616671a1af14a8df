"""The warm start of a `libra train` config, over several made models: held-out P(demo)
every 100 steps, and the step at which `sft.target` would have stopped it.

    python scripts/warm_start_sweep.py examples/cpu-train.toml --seeds 0,1,2,3,4,5
    python scripts/warm_start_sweep.py examples/cpu-train.toml --seeds 3 --set sft.batch=16

Each seed makes the config's model with `model.seed` = seed, draws the demonstrations as
`libra train` does, and runs the warm start to its last step (the target only reported),
one torch thread per process; `--jobs` runs seeds side by side. One JSON line per seed.
The figures in docs/train.md ("Why a target, a decay and 32 per step") come from it.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import tempfile
from pathlib import Path
from typing import Any


def sweep_one(config: str, overrides: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    from libra.chat import ChatTokenizer
    from libra.rollout.run import load_env
    from libra.train import load_config
    from libra.train.build import train_tasks
    from libra.train.setup import prepare_model, warm_start_demos
    from libra.trainer.sft import EVAL_EVERY, run_sft

    torch.set_num_threads(1)
    cfg = load_config(config, {**overrides, "model.seed": seed})
    s = cfg.sft
    with tempfile.TemporaryDirectory(prefix="libra-sweep-") as tmp:
        base = asyncio.run(prepare_model(cfg, Path(tmp)))
        env = load_env(cfg.data.env, cfg.data.env_options)
        try:
            tasks, _ = train_tasks(cfg, env)
            demos = asyncio.run(warm_start_demos(cfg, env, ChatTokenizer(base), tasks))
        finally:
            asyncio.run(env.close())
        curve: list[tuple[int, float, float]] = []

        def seen(p: Any) -> None:
            curve.append((p.step, round(p.loss, 4), round(p.seq_prob or 0.0, 3)))

        res = run_sft(
            base, demos, Path(tmp) / "sft", steps=s.steps, batch=s.batch, lr=s.lr,
            target=None, seed=seed,
            on_progress=seen,
        )  # fmt: skip
    evals = [c for c in curve if c[0] % EVAL_EVERY == 0 or c[0] == s.steps]
    reached = next((st for st, _, prob in evals if s.target and prob >= s.target), None)
    return {
        "seed": seed,
        "steps": s.steps,
        "batch": s.batch,
        "lr": s.lr,
        "target": s.target,
        "target_reached_at": reached,
        "p_demo_every_100": [prob for st, _, prob in evals if st % 100 == 0],
        "final_p_demo": res.seq_prob,
        "wall_s": round(res.wall_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--seeds", default="0,1,2", help="model seeds, comma-separated")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    from libra.cli.train import _settings

    overrides = dict(_settings(args.set))  # as `libra train --set` reads them
    seeds = [int(x) for x in args.seeds.split(",")]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(sweep_one, args.config, overrides, s) for s in seeds]
        for f in futures:
            print(json.dumps(f.result()), flush=True)


if __name__ == "__main__":
    main()
