"""`libra train CONFIG`: planner-controlled agentic RL on the configured fleet."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from libra.cli.common import add_json_flag, add_set_flag, config_of, overrides, print_json

EPILOG = """\
examples:
  libra train examples/cpu-train.toml                     # the CPU default, end to end
  libra train examples/cpu-train.toml --seed 1 --out runs/seed1
  libra train examples/cpu-train.toml                     # again after Ctrl-C: resumes
  libra train examples/search-r1-gpu48.toml --dry-run     # validate, show the layout
  libra train examples/cpu-train.toml --set planner.adapt=false   # any key, as TOML

The run folder (`out`) gets metrics.jsonl, decisions.jsonl, events.jsonl, plots/*.png,
checkpoint/ (sharded, to resume), model/ (the final weights as an HF folder: serve it
with libra serve-engine --model OUT/model) and summary.json.
An existing run there is resumed from its last checkpoint; --fresh starts over.

exit status: 0 trained to `steps`; 3 nothing ran: the run in `out` was already at
`steps` (--fresh starts over, --steps N or --set steps=N trains further); 130
interrupted (the same command resumes); 2 one line `libra: error: ...` naming the
cause and the fix: bad input, or a run stopped for a cause it names (episodes that
all fail, a gradient that is not finite, a full disk, a core replica lost: fix it and
the same command resumes); 1 a crash.
"""


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help="the main job: planner-controlled agentic RL (GRPO) on the configured fleet",
        description=(
            "Warm-start the model on expert demonstrations, then run asynchronous GRPO "
            "with bounded staleness (enforced when an episode is admitted), dynamic "
            "sampling and periodic validation, publishing weights to the inference engines "
            "after every step, while the planner moves hybrid workers between rollout and "
            "training. Every key of CONFIG is documented in libra/train/config.py."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="TOML config (examples/cpu-train.toml on a CPU machine)")
    p.add_argument("--out", help="run folder (overrides `out`)")
    p.add_argument("--seed", type=int, help="seed (overrides `seed`)")
    p.add_argument("--steps", type=int, help="GRPO steps (overrides `steps`)")
    p.add_argument("--display", choices=("auto", "live", "lines", "off"), help="progress display")
    p.add_argument("--fresh", action="store_true", help="delete a run in `out` and start over")
    add_set_flag(p, "--set planner.adapt=false --set rollout.group_size=4")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config, print the layout a run starts with (and, for a GPU fleet, "
        "the global planner's split as advice); start nothing",
    )
    add_json_flag(p)
    return p


def run(args: argparse.Namespace) -> int:
    import os

    # transformers' "Loading weights" bars (this process and the trainer's) would tear
    # the live display; set before transformers is imported anywhere.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from libra.train import load_config

    logging.basicConfig(level=logging.WARNING, format="libra: %(message)s", stream=sys.stderr)
    flags = {"out": args.out, "seed": args.seed, "steps": args.steps,
             "report.display": args.display}  # fmt: skip
    with config_of("train", args.config):
        cfg = load_config(args.config, overrides(args.set, flags))
    if args.dry_run:
        from libra.train.dryrun import describe, render

        doc = describe(cfg)
        print_json(doc) if args.json else print(render(doc))
        # A problem any machine has (no such env, tasks file, hardware) fails the check;
        # a layout this host cannot run (a GPU config planned here) is shown, not failed.
        return 2 if doc["problems"] else 0
    if args.json and cfg.report.display == "auto":
        cfg.report.display = "lines"
    from libra.train.run import run_cli

    summary, code = run_cli(cfg, fresh=args.fresh)
    if summary["outcome"] == "already-done":
        # nothing ran: say so first (on stderr beside --json), then the last run's summary
        print(_nothing_ran(summary, _same_run(args)), file=sys.stderr if args.json else sys.stdout)
        if not args.json:
            summary = summary | {"outcome": f"last run {summary['last_outcome']}"}
    if args.json:
        print_json(summary)
    else:
        print(_render(summary))
    return code


def _same_run(args: argparse.Namespace) -> str:
    """The command's config and the flags that name this run and its config (`--out`,
    `--seed`, `--set`, less `steps`), quoted for a shell: the hints that dropped them
    named the config's own `out` (which `--fresh` would delete) and another config."""
    import shlex

    words = [args.config]
    if args.out is not None:
        words += ["--out", args.out]
    if args.seed is not None:
        words += ["--seed", str(args.seed)]
    for pair in args.set:
        if pair.partition("=")[0].strip() != "steps":
            words += ["--set", pair]
    return " ".join(shlex.quote(w) for w in words)


def _nothing_ran(s: dict[str, Any], run: str) -> str:
    n = s["trained_steps"]
    return "\n".join([
        f"nothing ran: {s['out']} holds a run already trained to step {n} "
        f"(steps = {s['requested_steps']}); exit status 3",
        f"  start over:    libra train {run} --fresh   (deletes {s['out']})",
        f"  train further: libra train {run} --steps N   (or --set steps=N), N > {n}",
    ])  # fmt: skip


def _render(s: dict) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    lines = [
        f"{s['outcome']}: {s['steps']} steps in {s['wall_s'] / 60:.1f} min "
        f"(CPU {s['cpu_s'] / 60:.1f} min) -> {s['out']}",
        f"  reward: first 20% of steps {f(s['reward_first_20pct'])}, "
        f"last 20% {f(s['reward_last_20pct'])}; held-out validation {f(s['val_first'])} -> "
        f"{f(s['val_last'])}",
        f"  role switches {s['switches']}; planner decisions {s['decisions']}, applied "
        f"{len(s['applied_decisions'])}",
    ]
    for d in s["applied_decisions"]:
        lines.append(
            f"    step {d['step']}: predicted gain {d['predicted_gain_s']:,.1f} s > "
            f"cost {d['reconfig_cost_s']:,.1f} s ({d['trigger']})"
        )
    if s.get("model"):
        lines.append(f"  model: {s['model']} (libra serve-engine --model {s['model']})")
    if s["checkpoint"]:
        lines.append(f"  checkpoint: {s['checkpoint']} (the same command resumes from it)")
    if s["plots"]:
        lines.append(f"  plots: {', '.join(s['plots'])}")
    return "\n".join(lines)
