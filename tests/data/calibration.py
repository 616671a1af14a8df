"""The workload statistics a trace family is calibrated to, and those only reported.

    .venv/bin/python tests/data/calibration.py tests/data/search-r1-causal-v1.jsonl.gz 5000,15000,40960

No routing policy runs here: these are properties of the trace itself.

- first-bucket share: the share of episodes whose total fits the first bound; static
  routing and classic MLFQ score exactly this (the paper's 44.8% on Search-R1);
- group-majority share: the share of each GRPO group's episodes (same prompt, same
  step) that fall in the group's most common bucket. It is what a start-time router
  that knew the prompt perfectly would get in-sample, so it bounds any prompt-only
  predictor from above (the paper's embedding predictor: 65.2%);
- bucket shares, total-length percentiles, tool calls per episode and the mix of tool
  returns by (status, payload size class at 500 / 5,000 tokens).
"""

from __future__ import annotations

import bisect
import gzip
import sys
from collections import Counter, defaultdict
from typing import Any

import numpy as np
import orjson


def _size(n: int) -> str:
    return "small" if n <= 500 else "medium" if n <= 5000 else "large"


def stats(recs: list[dict[str, Any]], bounds: list[int]) -> dict[str, Any]:
    last = len(bounds) - 1
    buckets = [min(bisect.bisect_left(bounds, r["total_tokens"]), last) for r in recs]
    groups: dict[str, list[int]] = defaultdict(list)
    for r, b in zip(recs, buckets, strict=True):
        groups[r["group_id"]].append(b)
    majority = sum(Counter(g).most_common(1)[0][1] for g in groups.values())
    shares = Counter(buckets)
    totals = np.array([r["total_tokens"] for r in recs])
    calls = [sum(len(t.get("tool_returns", [])) for t in r["turns"]) for r in recs]
    mix = Counter(
        f"{x['status']}/{_size(x['payload_tokens'])}"
        for r in recs
        for t in r["turns"]
        for x in t.get("tool_returns", [])
    )
    n_ret = sum(mix.values())
    return {
        "episodes": len(recs),
        "prompts": len({r["task_id"] for r in recs}),
        "first_bucket_share": shares[0] / len(recs),
        "group_majority_share": majority / len(recs),
        "bucket_shares": [shares[i] / len(recs) for i in range(len(bounds))],
        "total_p50_p90_p99": [int(np.percentile(totals, q)) for q in (50, 90, 99)],
        "tool_calls_per_episode": float(np.mean(calls)),
        "return_mix": {k: v / n_ret for k, v in sorted(mix.items())},
        "truncated_share": sum(r.get("status") == "truncated" for r in recs) / len(recs),
    }


def show(name: str, s: dict[str, Any]) -> None:
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    print(
        f"{name}: {s['episodes']} episodes, {s['prompts']} prompts; "
        f"first-bucket share {pct(s['first_bucket_share'])}, "
        f"group-majority share {pct(s['group_majority_share'])}; "
        f"buckets {' / '.join(pct(x) for x in s['bucket_shares'])}; "
        f"total p50/p90/p99 {' / '.join(map(str, s['total_p50_p90_p99']))}; "
        f"tool calls/episode {s['tool_calls_per_episode']:.2f}; "
        f"truncated {pct(s['truncated_share'])}"
    )
    print("  returns: " + ", ".join(f"{k} {pct(v)}" for k, v in s["return_mix"].items()))


if __name__ == "__main__":
    path, bounds = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
    with gzip.open(path) as f:
        show(path, stats([orjson.loads(line) for line in f], bounds))
