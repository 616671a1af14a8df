"""`libra workload NAME --out FILE`: write a generated trace (one record per line).

The records are what `libra.sim.workloads.sample` returns, step after step; `libra
eval-routing`, `libra plan` and the simulator read them. A FILE ending in `.gz` is
gzip-compressed.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

from libra.cli.common import (
    add_json_flag,
    output_file,
    parse_pairs,
    print_json,
    progress,
    replaced,
    seed,
)
from libra.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help="write a generated workload trace (JSONL)",
        description=(
            "Write a generated trace of one workload (search-r1, r2e-gym, dapo-math, "
            "search-r1-causal, or the oracle-scored families oracle-search and oracle-swe, "
            "whose law is written beside the trace as FILE.law.json): "
            "STEPS training steps of PROMPTS prompts x GROUP samples, as trajectory "
            "records. Same arguments, same file."
        ),
    )
    p.add_argument(
        "name",
        metavar="NAME",
        help="search-r1 | r2e-gym | dapo-math | search-r1-causal | oracle-search | oracle-swe",
    )
    p.add_argument("--out", required=True, type=Path, help="output .jsonl (or .jsonl.gz)")
    p.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    p.add_argument("--first-step", type=int, default=0, help="first step number (default 0)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (default 32)")
    p.add_argument("--group", type=int, default=16, help="samples per prompt (default 16)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument(
        "--param",
        action="append",
        metavar="FIELD=VALUE",
        help="override a numeric field of the workload spec, e.g. dataset_size=512 "
        "(repeatable; see docs/workloads.md)",
    )
    add_json_flag(p)
    return p


def law_path(trace: Path) -> Path:
    """Where an oracle family's law is written beside its trace."""
    return trace.with_name(trace.name + ".law.json")


def _params(pairs: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, raw in parse_pairs(pairs, "--param", "FIELD=VALUE, e.g. dataset_size=512"):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            raise ConfigError(f"--param {key}={raw}: VALUE must be a number") from None
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"--param {key}={raw}: VALUE must be a number")
        out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    from libra.sim import workloads
    from libra.sim.workloads import oracle

    if args.steps < 1 or args.first_step < 0:
        raise ConfigError("--steps must be >= 1 and --first-step >= 0")
    params = _params(args.param)
    law = oracle.law_of(args.name, params) if args.name in oracle.FAMILIES else None
    out = output_file(args.out, "--out")
    if args.name not in oracle.FAMILIES:
        workloads.spec(args.name, params)  # a bad name or field: an error before any write
    opener: Any = gzip.open if out.suffix == ".gz" else open
    n = 0
    with replaced(out, opener) as f:
        for step in range(args.first_step, args.first_step + args.steps):
            if law is not None:
                docs = oracle.sample_oracle(law, args.prompts, args.group, step=step,
                                            seed=args.seed)  # fmt: skip
                for doc in docs:
                    doc["seq"] = n
                    n += 1
                    f.write(json.dumps(doc, separators=(",", ":")).encode() + b"\n")
                progress(f"step {step}: {len(docs)} episodes")
                continue
            batch = workloads.sample(
                args.name, args.prompts, args.group, step=step, seed=args.seed, params=params
            )
            for rec in batch:
                rec.seq = n
                n += 1
                f.write(rec.model_dump_json(exclude_defaults=True).encode() + b"\n")
            progress(f"step {step}: {len(batch)} episodes")
    if law is not None:  # the law beside the trace, for `libra eval-routing --oracle`
        sidecar = law_path(args.out)
        sidecar.write_text(json.dumps({"law": law.to_dict(), "seed": args.seed}, indent=1))
    summary = {"workload": args.name, "out": str(args.out), "records": n, "params": params}
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {n} records to {args.out}")
    return 0
