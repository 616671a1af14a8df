"""How much do a trace's tool returns reveal? A rough ceiling for causal routing.

    .venv/bin/python tests/data/ceiling.py tests/data/search-r1.jsonl.gz 5000,15000,40960

A lookup-table policy that sees everything C-MLFQ could use at a tool return -- the full
ordered sequence of tool states, the context length (to a quarter octave), the prompt
being irrelevant here -- and learns between steps exactly like `libra eval-routing`:
at each tool return it moves (once) to the final bucket most frequent among earlier
episodes in the same cell (at least 8 of them). Overflows end its chances as they do in
the replay. It is not a strict upper bound (a cleverer policy could do better), but a
routing rule that only sees tool-return states and lengths will not do much better on
the same trace. docs/cmlfq.md reports its numbers next to C-MLFQ's.
"""

from __future__ import annotations

import bisect
import gzip
import sys
from collections import Counter, defaultdict

import numpy as np
import orjson


def _size(n: int) -> str:
    return "small" if n <= 500 else "medium" if n <= 5000 else "large"


def _points(rec: dict) -> list[tuple[tuple, int]]:
    ctx, states, out = rec["prompt_tokens"], [], []
    turns = rec["turns"]
    for i, t in enumerate(turns):
        ctx += t["model_tokens"] + t.get("tool_tokens", 0)
        rets = t.get("tool_returns", [])
        states += [(r["tool"], _size(r["payload_tokens"]), r["status"]) for r in rets]
        if rets and i < len(turns) - 1:
            out.append(((tuple(states), int(np.log2(ctx) * 4)), ctx))
    return out


def ceiling(path: str, bounds: list[int]) -> float:
    with gzip.open(path) as f:
        recs = [orjson.loads(line) for line in f]
    by_step: dict[int, list[dict]] = defaultdict(list)
    for r in recs:
        by_step[r.get("step", 0)].append(r)
    last = len(bounds) - 1
    cells: dict[tuple, Counter] = defaultdict(Counter)
    right = 0
    for step in sorted(by_step):
        for r in by_step[step]:
            true = min(bisect.bisect_left(bounds, r["total_tokens"]), last)
            cur, moved, overflow = 0, False, False
            for key, ctx in _points(r):
                if cur < last and ctx >= bounds[cur]:
                    overflow = True
                    break
                seen = cells.get(key)
                if not moved and seen and sum(seen.values()) >= 8:
                    best = seen.most_common(1)[0][0]
                    if best != cur:
                        cur, moved = best, True
            overflow = overflow or r["total_tokens"] > bounds[cur]
            right += not overflow and cur == true
        for r in by_step[step]:
            true = min(bisect.bisect_left(bounds, r["total_tokens"]), last)
            for key, _ in _points(r):
                cells[key][true] += 1
    return right / len(recs)


if __name__ == "__main__":
    trace, bounds = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
    print(f"{trace}: lookup-table ceiling {100 * ceiling(trace, bounds):.1f}% single-shot")
