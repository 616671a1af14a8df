"""Oracle-scored trace families (issue 17): a written-down law, traces drawn from it by
`libra workload`, and its Bayes oracle scored beside the policies by `libra eval-routing
--oracle`."""

from __future__ import annotations

import json

import pytest

from libra.cli import main
from libra.errors import ConfigError
from libra.routing import Bucket, EpisodeState, ToolState
from libra.routing.replay import parse_lines
from libra.sim.workloads.oracle import OraclePolicy, law_of, sample_oracle

BUCKETS = [Bucket("tp2", 2, 5_000), Bucket("tp4", 4, 15_000), Bucket("tp8", 8, 40_960)]


def test_a_family_is_its_law_same_arguments_same_records() -> None:
    law = law_of("oracle-search")
    a = sample_oracle(law, 8, 4, step=2, seed=3)
    assert a == sample_oracle(law, 8, 4, step=2, seed=3)
    assert a != sample_oracle(law, 8, 4, step=2, seed=4)
    records, bad = parse_lines(json.dumps(d).encode() for d in a)
    assert not bad and len(records) == 32
    for d in a:  # every turn but the last ends in one tool call; lengths add up
        assert all(len(t["tool_returns"]) == 1 for t in d["turns"][:-1])
        used = sum(t["model_tokens"] + t["tool_tokens"] for t in d["turns"])
        assert d["total_tokens"] == d["prompt_tokens"] + used <= law.max_context
    assert law_of("oracle-swe", {"drift": 0.02}).drift == 0.02
    with pytest.raises(ConfigError, match="no numeric field 'bogus'"):
        law_of("oracle-search", {"bogus": 1})
    with pytest.raises(ConfigError, match="max_turns must be an integer"):
        law_of("oracle-search", {"max_turns": 2.5})


def test_the_oracle_reads_the_returns_as_the_law_says() -> None:
    law = law_of("oracle-search")
    oracle = OraclePolicy(law, 0, BUCKETS)

    def at(*payloads: int, status: str = "ok") -> EpisodeState:
        rets = tuple(ToolState("search", status, p) for p in payloads)
        return EpisodeState("e", "oracle-search-3", 260, 260 + 1200 * len(rets), rets, "tp2", 1)

    # Long episodes' searches come back thin (median 250 tokens), short ones' full (700).
    assert oracle._class_posterior("oracle-search-3", at(150).tool_returns) > \
        oracle._class_posterior("oracle-search-3", at(1200).tool_returns)  # fmt: skip
    # Errors are 5x likelier in a long episode; so is getting to a 4th return at all.
    assert oracle._class_posterior("oracle-search-3", at(400, status="error").tool_returns) > \
        oracle._class_posterior("oracle-search-3", at(400).tool_returns)  # fmt: skip
    assert oracle._class_posterior("oracle-search-3", at(400, 400, 400, 400).tool_returns) > \
        oracle._class_posterior("oracle-search-3", at(400).tool_returns)  # fmt: skip
    probs = oracle.probs(at(150, 150, 150))
    assert abs(sum(probs) - 1.0) < 1e-9 and probs[0] < max(probs)


def test_eval_routing_scores_policies_as_a_share_of_the_oracle(tmp_path, capsys) -> None:
    trace = tmp_path / "os.jsonl"
    assert main(["workload", "oracle-search", "--out", str(trace), "--steps", "4",
                 "--prompts", "16", "--group", "8", "--seed", "1"]) == 0  # fmt: skip
    assert (tmp_path / "os.jsonl.law.json").is_file()
    capsys.readouterr()
    assert main(["eval-routing", str(trace), "--oracle", "--policy", "mlfq,cmlfq", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    oracle = results["oracle"]
    assert oracle["share_of_oracle"] == 1.0
    for name in ("mlfq", "cmlfq"):
        r = results[name]
        assert r["share_of_oracle"] == pytest.approx(
            r["single_shot_accuracy"] / oracle["single_shot_accuracy"]
        )
    # The oracle knows the law: MLFQ, which only reacts to overflows, does worse.
    assert oracle["single_shot_accuracy"] > results["mlfq"]["single_shot_accuracy"]
    (tmp_path / "os.jsonl.law.json").unlink()
    assert main(["eval-routing", str(trace), "--oracle"]) == 2
    assert "no law at" in capsys.readouterr().err
