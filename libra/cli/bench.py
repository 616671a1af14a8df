"""`libra bench NAME [--json]`: run one benchmark, print its figures."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from typing import Any

from libra.bench import BENCHMARKS
from libra.cli.common import add_json_flag, print_json


def _available() -> dict[str, str]:
    return {
        name: f"libra.bench.{mod}"
        for name, mod in BENCHMARKS.items()
        if importlib.util.find_spec(f"libra.bench.{mod}") is not None
    }


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="run one benchmark", description="Run one benchmark.")
    bsub = p.add_subparsers(dest="bench", metavar="NAME", required=True)
    for bname, module_name in _available().items():
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or bname).strip().splitlines()[0]
        bp = bsub.add_parser(bname, help=doc, description=module.__doc__)
        add_json_flag(bp)
        module.add_arguments(bp)
        bp.set_defaults(_bench=module)
    return p


def run(args: argparse.Namespace) -> int:
    result = args._bench.run(args)
    if args.json:
        print_json(result)
    else:
        _print_table(result)
    # a benchmark of several parts lists those that failed (their errors are printed)
    return 1 if isinstance(result, dict) and result.get("failed") else 0


def _print_table(doc: Any, prefix: str = "") -> None:
    if isinstance(doc, dict):
        for k, v in doc.items():
            if isinstance(v, dict | list):
                print(f"{prefix}{k}:")
                _print_table(v, prefix + "  ")
            else:
                print(f"{prefix}{k}: {_fmt(v)}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            if isinstance(v, dict | list):
                print(f"{prefix}- [{i}]")
                _print_table(v, prefix + "    ")
            else:
                print(f"{prefix}- {_fmt(v)}")
    else:
        print(f"{prefix}{_fmt(doc)}")


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
