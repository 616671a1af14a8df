"""Routing policies on the frozen traces in tests/data (written before any tuning).

These pin what docs/cmlfq.md reports: where C-MLFQ beats the baselines on these traces
and where it does not (the held-out family and the multi-epoch subset favour the
predictor; see the doc for why).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from libra.routing import Bucket, make_policy
from libra.routing.replay import parse_lines, replay

DATA = Path(__file__).parents[1] / "data"
LAYOUTS = {
    "search-r1": (5_000, 15_000, 40_960),  # the paper's Search-R1 buckets
    "r2e-gym": (4_000, 12_000, 40_960),  # reference r2e_gym config (last: max length)
    "dapo-math": (3_000, 6_000, 32_768),  # reference dapo_math_cmlfq config
}


def evaluate(trace: str, layout: str, policies=("cmlfq", "mlfq", "predictor", "static")):
    buckets = [Bucket(f"tp{2 ** (i + 1)}", 2 ** (i + 1), b) for i, b in enumerate(LAYOUTS[layout])]
    with gzip.open(DATA / f"{trace}.jsonl.gz") as f:
        records, bad = parse_lines(f.read().splitlines())
    assert not bad
    out = {p: replay(records, make_policy(p, buckets), buckets).as_dict() for p in policies}
    totals = np.array([r.total_tokens for r in records])
    return out, float((totals <= buckets[0].bound).mean())


def test_search_r1_cmlfq_beats_both_baselines():
    s, first_share = evaluate("search-r1", "search-r1")
    acc = {p: r["single_shot_accuracy"] for p, r in s.items()}
    # static and MLFQ score exactly the share of episodes that belong in the first bucket
    assert acc["static"] == acc["mlfq"] == pytest.approx(first_share)
    assert acc["cmlfq"] > acc["mlfq"] + 0.02 and acc["cmlfq"] > acc["predictor"] + 0.02
    assert s["cmlfq"]["migrated_token_ratio"] < s["mlfq"]["migrated_token_ratio"]
    # most of its moves are its own decisions, not overflows
    assert s["cmlfq"]["overflow_moves_per_episode"] < 0.2 < s["mlfq"]["overflow_moves_per_episode"]


def test_dapo_math_cmlfq_starts_long_prompts_where_they_end():
    s, _ = evaluate("dapo-math", "dapo-math", ("cmlfq", "mlfq", "predictor"))
    acc = {p: r["single_shot_accuracy"] for p, r in s.items()}
    assert acc["cmlfq"] > max(acc["mlfq"], acc["predictor"])
    assert s["cmlfq"]["migrated_token_ratio"] < 0.1 < s["mlfq"]["migrated_token_ratio"]


def test_r2e_gym_cmlfq_beats_mlfq_and_halves_its_migrated_tokens():
    s, _ = evaluate("r2e-gym", "r2e-gym", ("cmlfq", "mlfq"))
    assert s["cmlfq"]["single_shot_accuracy"] > s["mlfq"]["single_shot_accuracy"] + 0.1
    assert s["cmlfq"]["migrated_token_ratio"] < 0.5 * s["mlfq"]["migrated_token_ratio"]


def test_paper_rule_alone_is_what_the_extensions_improve_on():
    # The paper's rule (start small, move only when mean and P90 agree) against the
    # default (root-node start, deadline moves) on the held-out family.
    buckets = [
        Bucket(f"tp{2 ** (i + 1)}", 2 ** (i + 1), b) for i, b in enumerate(LAYOUTS["search-r1"])
    ]
    with gzip.open(DATA / "search-r1-heldout.jsonl.gz") as f:
        records, _ = parse_lines(f.read().splitlines())
    paper = make_policy("cmlfq", buckets, {"start": "smallest", "deadline": False})
    default = make_policy("cmlfq", buckets)
    a = replay(records, paper, buckets).as_dict()["single_shot_accuracy"]
    b = replay(records, default, buckets).as_dict()["single_shot_accuracy"]
    assert b > a + 0.05
