"""`libra eval-routing TRACE --bounds B1,B2,... --policy P`: replay a trace through a
routing policy and score it (definitions in `libra.routing.replay` and docs/cmlfq.md)."""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path
from typing import Any

from libra.cli.common import add_json_flag, int_list, parse_pairs, print_json, routing_options
from libra.errors import ConfigError

SHOWN_BAD_LINES = 20


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help="replay trajectory records through a routing policy and score it",
        description=(
            "Replay a JSONL trace (optionally .gz) of trajectory records through routing "
            "policies, step by step (episodes of step s are routed with what was learned "
            "from steps < s), and report single-shot accuracy, per-bucket recall, the "
            "migrated-token ratio, moves per episode and decision latency."
        ),
    )
    p.add_argument("trace", type=Path, metavar="TRACE", help="trajectory records, JSONL")
    p.add_argument(
        "--bounds",
        default="5000,15000,40960",
        help="ascending bucket bounds (total context tokens), comma-separated; buckets get "
        "TP 2, 4, 8 (default 5000,15000,40960: the paper's Search-R1 layout)",
    )
    p.add_argument(
        "--bucket",
        action="append",
        metavar="NAME=TP:BOUND",
        help="declare a bucket instead of --bounds (repeatable)",
    )
    p.add_argument(
        "--policy",
        default="cmlfq",
        help="cmlfq | mlfq | predictor | static, or several comma-separated (default cmlfq)",
    )
    p.add_argument(
        "--routing",
        action="append",
        metavar="KEY=VALUE",
        help="routing option, e.g. min_samples=8 or kv_aware=false (repeatable; "
        "see RoutingConfig in docs/cmlfq.md)",
    )
    p.add_argument(
        "--oracle",
        action="store_true",
        help="score against the Bayes oracle of an oracle-scored family (`libra workload "
        "oracle-search|oracle-swe` writes its law beside the trace as TRACE.law.json): "
        "adds the oracle's row and each policy's share of its single-shot accuracy",
    )
    add_json_flag(p)
    return p


def buckets_from_args(args: argparse.Namespace) -> list[Any]:
    from libra.routing import Bucket

    if args.bucket:
        out = []
        for name, spec in parse_pairs(args.bucket, "--bucket", "NAME=TP:BOUND, e.g. tp4=4:15000"):
            tp, sep, bound = spec.partition(":")
            if not sep or not _whole(tp) or not _whole(bound):
                raise ConfigError(
                    f"--bucket {name}={spec}: expected NAME=TP:BOUND, both whole numbers "
                    ">= 1, e.g. tp4=4:15000"
                )
            out.append(Bucket(name, int(tp), int(bound)))
        if len({b.name for b in out}) < len(out) or len({b.bound for b in out}) < len(out):
            raise ConfigError("--bucket: names and bounds must be distinct")
        return out
    bounds = int_list(args.bounds, "--bounds", 1, "5000,15000,40960")
    if bounds != sorted(set(bounds)):
        raise ConfigError(
            f"--bounds {args.bounds!r}: expected strictly ascending positive integers"
        )
    tps = [2 ** min(i + 1, 3) for i in range(len(bounds))]
    names = (
        [f"tp{t}" for t in tps] if len(set(tps)) == len(tps) else [f"b{i}" for i in range(len(tps))]
    )
    return [Bucket(n, t, b) for n, t, b in zip(names, tps, bounds, strict=True)]


def _whole(text: str) -> bool:
    """An ASCII whole number >= 1 (`str.isdigit` takes "²", which `int` refuses)."""
    return text.isascii() and text.isdigit() and int(text) >= 1


def _read(path: Path) -> bytes:
    if not path.is_file():
        raise ConfigError(f"trace {str(path)!r} not found; pass a JSONL file of trajectory records")
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise ConfigError(f"{path}: broken gzip file: {e}") from None
    return data


def run(args: argparse.Namespace) -> int:
    from libra.config import build
    from libra.routing import POLICIES, RoutingConfig, make_policy
    from libra.routing.replay import parse_lines, replay

    buckets = buckets_from_args(args)
    names = [n.strip() for n in args.policy.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"--policy names no policy; known: {', '.join(POLICIES)}")
    for n in names:
        if n not in POLICIES:
            raise ConfigError(f"--policy {n!r}: unknown; known: {', '.join(POLICIES)}")
    config = build(RoutingConfig, routing_options(args.routing), "--routing")
    records, bad = parse_lines(_read(args.trace).splitlines())
    for lineno, problem in bad[:SHOWN_BAD_LINES]:
        print(f"{args.trace}:{lineno}: skipped: {problem}", file=sys.stderr)
    if len(bad) > SHOWN_BAD_LINES:
        print(f"... and {len(bad) - SHOWN_BAD_LINES} more malformed lines", file=sys.stderr)
    if not records:
        raise ConfigError(f"{args.trace}: no trajectory records to replay")
    results = {}
    for n in names:
        policy = make_policy(n, buckets, config)
        results[n] = replay(records, policy, buckets, name=n).as_dict()
    if args.oracle:
        oracle = _oracle(args.trace, buckets)
        oracle.step = min(r.step for r in records)
        results["oracle"] = replay(records, oracle, buckets, name="oracle").as_dict()
        best = results["oracle"]["single_shot_accuracy"] or 0.0
        for r in results.values():
            acc = r["single_shot_accuracy"]
            r["share_of_oracle"] = None if acc is None or not best else acc / best
    doc = {
        "trace": str(args.trace),
        "buckets": [{"name": b.name, "tp": b.tp, "bound": b.bound} for b in buckets],
        "malformed_lines": len(bad),
        "skipped": [{"line": ln, "problem": pr} for ln, pr in bad],
        "results": results,
    }
    if args.json:
        print_json(doc)
    else:
        _print(doc)
    return 0


def _oracle(trace: Path, buckets: list[Any]) -> Any:
    import json

    from libra.cli.workload import law_path
    from libra.sim.workloads.oracle import OraclePolicy, law_from_dict

    path = law_path(trace)
    if not path.is_file():
        raise ConfigError(
            f"--oracle: no law at {str(path)!r}; it is written by `libra workload "
            "oracle-search|oracle-swe --out TRACE` (other traces have no known law)"
        )
    try:
        doc = json.loads(path.read_text())
        return OraclePolicy(law_from_dict(doc["law"]), int(doc["seed"]), buckets)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a law file ({e})") from None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _print(doc: dict[str, Any]) -> None:
    first = next(iter(doc["results"].values()))
    buckets = " ".join(f"{b['name']}<={b['bound']}" for b in doc["buckets"])
    print(f"{doc['trace']}: {first['episodes']} episodes, {first['steps']} steps, "
          f"{doc['malformed_lines']} malformed lines skipped; buckets {buckets}")  # fmt: skip
    names = [b["name"] for b in doc["buckets"]]
    head = f"{'policy':<10} {'single-shot':>11} {'recall ' + '/'.join(names):>24} "
    head += f"{'migrated':>9} {'moves/ep':>9} {'overflow/ep':>11} {'p50 us':>7} {'p99 us':>7}"
    oracle = "oracle" in doc["results"]
    print(head + (f" {'of oracle':>9}" if oracle else ""))
    for name, r in doc["results"].items():
        recall = "/".join(_pct(r["per_bucket"][b]["recall"]) for b in names)
        lat = r["decision_latency_us"]
        print(
            f"{name:<10} {_pct(r['single_shot_accuracy']):>11} {recall:>24} "
            f"{_pct(r['migrated_token_ratio']):>9} {r['moves_per_episode']:>9.3f} "
            f"{r['overflow_moves_per_episode']:>11.3f} {lat['p50']:>7.1f} {lat['p99']:>7.1f}"
            + (f" {_pct(r.get('share_of_oracle')):>9}" if oracle else "")
        )
