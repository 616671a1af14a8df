"""`libra envs` / `libra tools`: what is registered, with where it came from."""

from __future__ import annotations

import argparse

from libra.cli.common import add_json_flag, print_json


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    what = {"envs": "environments", "tools": "tools"}[name]
    p = sub.add_parser(
        name,
        help=f"list registered {what}",
        description=f"List registered {what} (built-ins and entry points).",
    )
    add_json_flag(p)
    return p


def run(args: argparse.Namespace) -> int:
    from libra import registry

    reg = registry.envs if args.command == "envs" else registry.tools
    entries = reg.entries()
    if args.json:
        print_json([{"id": e.id, "target": e.target, "source": e.source} for e in entries])
        return 0
    width = max((len(e.id) for e in entries), default=2)
    for e in entries:
        print(f"{e.id:<{width}}  {e.source:<12}  {e.target}")
    return 0
