"""The `search-r1-causal` family: its agent's mechanisms, its frozen files' calibration,
and what `libra eval-routing` shows on them (docs/cmlfq.md, "search-r1-causal").

C-MLFQ does *not* beat MLFQ and the predictor on single-shot accuracy on this family
(docs/cmlfq.md), so no test claims it; the replay test checks what the policies do.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import orjson
import pytest

from libra.routing import Bucket, make_policy
from libra.routing.replay import parse_lines, replay
from libra.sim import workloads
from libra.sim.workloads.agents import (
    OUTCOME_MISS,
    OUTCOME_RETRY,
    OUTCOME_USEFUL,
    Call,
    SearchAgent,
)

DATA = Path(__file__).parents[1] / "data"
FROZEN = ["search-r1-causal-v1.jsonl.gz", "search-r1-causal-heldout-v1.jsonl.gz"]
BUCKETS = [Bucket("tp2", 2, 5_000), Bucket("tp4", 4, 15_000), Bucket("tp8", 8, 40_960)]
TOOLS = workloads.spec("search-r1-causal").tools


def _calibration():
    spec = importlib.util.spec_from_file_location("calibration", DATA / "calibration.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _agent(skill: float, stuck: bool = False, need: int = 1) -> SearchAgent:
    return SearchAgent(TOOLS, need, skill, 0.0, stuck)


def test_a_question_the_web_cannot_serve_gets_empty_result_lists_and_reformulations():
    rng = np.random.default_rng(0)
    hard, easy = _agent(0.0), _agent(1.0)
    calls = [hard.act(rng) for _ in range(2_000)]
    empty = sum(c.tool.name == "search-empty" for c in calls) / len(calls)
    assert empty == pytest.approx(TOOLS[1].weight, abs=0.03)
    assert all(easy.act(rng).tool.name == "search" for _ in range(200))
    # an empty list is a miss (the agent searches again); a result list for an easy
    # question is the evidence, and the agent answers next
    assert hard.observe(Call(TOOLS[1]), "ok", rng) == OUTCOME_MISS
    assert not hard.done
    assert easy.observe(easy.act(rng), "ok", rng) == OUTCOME_USEFUL
    assert easy.done and easy.solved


def test_a_degenerate_episode_emits_malformed_actions_and_never_stops_on_them():
    rng = np.random.default_rng(1)
    stuck, healthy = _agent(0.9, stuck=True), _agent(0.9)
    calls = [stuck.act(rng) for _ in range(2_000)]
    share = sum(c.fails and c.tool.name == "invalid" for c in calls) / len(calls)
    assert share == pytest.approx(TOOLS[2].weight, abs=0.03)
    for _ in range(10):
        assert stuck.observe(calls[0], "error", rng) == OUTCOME_RETRY
    assert not stuck.done  # runs into the turn or context limit
    for _ in range(3):
        healthy.observe(calls[0], "error", rng)
    assert healthy.done  # three failures in a row: a healthy agent answers


def test_episodes_record_every_return_as_the_search_tool_with_what_it_returned():
    recs = workloads.sample_data("search-r1-causal", 8, 8, step=0, seed=3)
    returns = [x for r in recs for t in r["turns"] for x in t.get("tool_returns", [])]
    assert {x["tool"] for x in returns} == {"search"}
    sizes: dict[str, list[int]] = {}
    for x in returns:
        sizes.setdefault(x["status"], []).append(x["payload_tokens"])
    ok = np.array(sizes["ok"])
    # result lists (hundreds of tokens) and empty ones (tens) both come back ok
    assert (ok < 100).any() and (ok > 500).any()
    assert max(sizes["error"]) < 100  # the invalid-action message


@pytest.mark.parametrize("file", FROZEN)
def test_frozen_files_hold_the_calibrated_statistics(file):
    # docs/workloads.md, "Calibration check": T1 (first-bucket share, the paper's MLFQ
    # score) is calibrated on the main file only; T2's floor (the paper's prompt-only
    # predictor, 65.2%) holds for both.
    with gzip.open(DATA / file) as f:
        s = _calibration().stats([orjson.loads(line) for line in f], [5_000, 15_000, 40_960])
    assert s["episodes"] == 8_192
    assert s["group_majority_share"] >= 0.652
    if file == FROZEN[0]:
        assert s["first_bucket_share"] == pytest.approx(0.448, abs=0.015)
        assert s["group_majority_share"] == pytest.approx(0.70, abs=0.02)


@pytest.mark.parametrize("file", FROZEN)
def test_eval_routing_on_the_frozen_family(file):
    with gzip.open(DATA / file) as f:
        records, bad = parse_lines(f)
    assert not bad
    first = sum(r.total_tokens <= 5_000 for r in records) / len(records)
    got = {
        name: replay(records, make_policy(name, BUCKETS), BUCKETS).as_dict()
        for name in ("static", "mlfq", "cmlfq")
    }
    # static and classic MLFQ score exactly the first-bucket share, by definition
    for name in ("static", "mlfq"):
        assert got[name]["single_shot_accuracy"] == pytest.approx(first)
    # C-MLFQ moves episodes before they outgrow their bucket: far fewer overflow
    # demotions than MLFQ, whose every move is one, and fewer re-prefilled tokens
    c, m = got["cmlfq"], got["mlfq"]
    assert c["overflow_moves_per_episode"] < 0.5 * m["overflow_moves_per_episode"]
    assert c["migrated_token_ratio"] < m["migrated_token_ratio"]
