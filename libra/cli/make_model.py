"""`libra make-model DIR [--seed S] [--force]`: write the tiny default model folder."""

from __future__ import annotations

import argparse

from libra.cli.common import add_json_flag, print_json, progress


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help="write the tiny default model folder (offline, seeded)",
        description=(
            "Write a tiny Qwen2-architecture model folder offline: seeded random weights "
            "(model.safetensors), a byte-level BPE tokenizer trained locally, a Qwen2.5-style "
            "chat template with tools, config. Loadable by transformers and vLLM; the same "
            "seed gives the same bytes. Checkpoints of different seeds share the tokenizer."
        ),
    )
    p.add_argument("dir", metavar="DIR", help="folder to create (must be new or empty)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--force", action="store_true", help="replace DIR if it is not empty")
    add_json_flag(p)
    return p


def run(args: argparse.Namespace) -> int:
    from libra.engine.model_maker import FILES, make_model

    path = make_model(args.dir, seed=args.seed, force=args.force)
    if args.json:
        print_json({"path": str(path), "seed": args.seed, "files": list(FILES)})
    else:
        progress(f"wrote tiny model (seed {args.seed}) to {path}")
        print(path)
    return 0
