"""`libra eval-routing`: the replay semantics and scores the issue defines."""

from __future__ import annotations

import gzip
import json

import orjson
import pytest

from libra.cli import main
from libra.routing import Bucket, Decision, make_policy
from libra.routing.replay import ReplayRecord, replay

BUCKETS = [Bucket("tp2", 2, 5_000), Bucket("tp4", 4, 15_000), Bucket("tp8", 8, 40_960)]


def rec(task, turns, step=0, prompt=200):
    """`turns`: (model_tokens, tool_tokens, n_returns)."""
    return {
        "id": f"{task}/{step}", "task_id": task, "step": step, "prompt_tokens": prompt,
        "total_tokens": prompt + sum(m + t for m, t, _ in turns),
        "turns": [
            {"model_tokens": m, "tool_tokens": t,
             "tool_returns": [{"tool": "x", "status": "ok", "payload_tokens": t}] * n}
            for m, t, n in turns
        ],
    }  # fmt: skip


LONG = rec("long", [(4_000, 300, 1), (12_000, 0, 0)])  # 16,500 tokens: tp8
SHORT = rec("short", [(1_000, 300, 1), (500, 0, 0)])  # 2,000 tokens: tp2


def scores(records, policy, buckets=BUCKETS):
    return replay([ReplayRecord.model_validate(r) for r in records], policy, buckets).as_dict()


def test_static_scores_the_first_bucket_share_and_pays_every_overflow():
    s = scores([LONG, SHORT], make_policy("static", BUCKETS))
    assert s["single_shot_accuracy"] == 0.5
    assert s["per_bucket"]["tp2"]["recall"] == 1.0 and s["per_bucket"]["tp8"]["recall"] == 0.0
    assert s["per_bucket"]["tp4"]["recall"] is None  # no episode belongs there
    # the long one overflows mid-turn twice: re-prefilled at 5,000 and at 15,000
    assert s["migrated_token_ratio"] == pytest.approx(20_000 / 18_500)
    assert s["moves_per_episode"] == s["overflow_moves_per_episode"] == 1.0
    assert s["per_bucket"]["tp8"]["ended_in_bucket"] == 1.0


class Oracle:
    """Moves each episode to the bucket it will end in, at its first tool return."""

    name = "oracle"

    def __init__(self, truth, moves=1):
        self.truth, self.moves, self.seen = truth, moves, {}

    def on_start(self, state):
        return "tp2"

    def on_tool_return(self, state):
        n = self.seen[state.episode_id] = self.seen.get(state.episode_id, 0) + 1
        if n > self.moves:  # flip-flop: go back down, then up again
            return Decision("tp2" if state.bucket != "tp2" else self.truth[state.task_id])
        return Decision(self.truth[state.task_id], "knows")

    def on_finish(self, record):
        pass


def test_one_predictive_move_before_the_bound_is_single_shot():
    s = scores([LONG, SHORT], Oracle({"long": "tp8", "short": "tp2"}))
    assert s["single_shot_accuracy"] == 1.0
    assert s["migrated_token_ratio"] == pytest.approx(4_500 / 18_500)  # moved at 4,500
    assert s["policy_moves_per_episode"] == 0.5 and s["overflow_moves_per_episode"] == 0


def test_two_moves_are_not_single_shot_even_when_the_episode_ends_right():
    flip = rec("long", [(1_000, 300, 1), (1_000, 300, 1), (1_000, 300, 1), (14_000, 0, 0)])
    s = scores([flip], Oracle({"long": "tp8"}, moves=1))
    assert s["policy_moves_per_episode"] == 3 and s["single_shot_accuracy"] == 0.0
    assert s["per_bucket"]["tp8"]["ended_in_bucket"] == 1.0


def test_a_move_after_the_context_reached_the_bound_is_an_overflow():
    # the tool response pushes the context to 5,200: the next turn cannot start in tp2
    late = rec("late", [(4_000, 1_000, 1), (3_000, 0, 0)])
    for name in ("mlfq", "static"):
        s = scores([late], make_policy(name, BUCKETS))
        assert s["overflow_moves_per_episode"] == 1 and s["policy_moves_per_episode"] == 0
        assert s["migrated_token_ratio"] == pytest.approx(5_200 / 8_200)
        assert s["single_shot_accuracy"] == 0.0
    s = scores([late], Oracle({"late": "tp4"}))  # even when it lands right
    assert s["overflow_moves_per_episode"] == 1 and s["single_shot_accuracy"] == 0.0


class Recorder:
    name = "recorder"

    def __init__(self):
        self.learned, self.log = [], []

    def on_start(self, state):
        self.log.append((state.task_id, tuple(self.learned)))
        return "tp2"

    def on_tool_return(self, state):
        return state.bucket

    def on_finish(self, record):
        self.learned.append(record.task_id)

    def end_step(self, step):
        self.learned.append(f"end {step}")


def test_episodes_of_a_step_are_routed_with_what_earlier_steps_taught():
    p = Recorder()
    records = [rec("b1", [(10, 0, 0)], step=1), rec("a0", [(10, 0, 0)], step=0),
               rec("b2", [(10, 0, 0)], step=1), rec("c5", [(10, 0, 0)], step=5)]  # fmt: skip
    scores(records, p)
    assert p.log == [
        ("a0", ()),
        ("b1", ("a0", "end 0")),
        ("b2", ("a0", "end 0")),
        ("c5", ("a0", "end 0", "b1", "b2", "end 1")),
    ]


def _write(path, lines):
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def test_eval_routing_skips_malformed_lines_and_names_them(tmp_path, capsys):
    trace = tmp_path / "t.jsonl.gz"
    bad_tokens = dict(SHORT, prompt_tokens=-5)
    no_task = {k: v for k, v in SHORT.items() if k != "task_id"}
    _write(trace, [orjson.dumps(LONG), b"{not json", orjson.dumps(no_task),
                   orjson.dumps(bad_tokens), b"", orjson.dumps(SHORT)])  # fmt: skip
    assert main(["eval-routing", str(trace), "--policy", "static,mlfq", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["malformed_lines"] == 3
    assert [d["line"] for d in doc["skipped"]] == [2, 3, 4]
    assert "task_id" in doc["skipped"][1]["problem"]
    assert f"{trace}:2: skipped" in err
    assert doc["results"]["static"]["episodes"] == 2
    assert doc["results"]["mlfq"]["single_shot_accuracy"] == 0.5
    assert [b["bound"] for b in doc["buckets"]] == [5000, 15000, 40960]


def test_eval_routing_prints_a_table_and_takes_buckets_and_options(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    _write(trace, [orjson.dumps(LONG), orjson.dumps(SHORT)])
    args = ["eval-routing", str(trace), "--bucket", "small=1:3000", "--bucket", "big=8:40000"]
    assert main([*args, "--policy", "cmlfq", "--routing", "min_samples=2"]) == 0
    out = capsys.readouterr().out
    assert "2 episodes" in out and "recall small/big" in out and out.count("\n") == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bounds", "5000,abc"], "expected integers"),
        (["--bounds", "15000,5000"], "strictly ascending"),
        (["--policy", "fifo"], "unknown; known: cmlfq, mlfq, predictor, static"),
        (["--bucket", "a=x:5"], "expected NAME=TP:BOUND"),
        (["--bucket", "a=1:\u00b2"], "expected NAME=TP:BOUND"),  # isdigit, not int: a traceback
        (["--bucket", "a=1:0"], "both whole numbers >= 1"),  # a bucket serving nothing
        (["--routing", "nope=1"], "nope: unknown key"),
    ],
)
def test_eval_routing_bad_arguments_are_one_line(tmp_path, capsys, args, message):
    trace = tmp_path / "t.jsonl"
    _write(trace, [orjson.dumps(SHORT)])
    assert main(["eval-routing", str(trace), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_eval_routing_needs_a_trace_with_records(tmp_path, capsys):
    assert main(["eval-routing", str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    _write(empty, [b"[1, 2]"])
    assert main(["eval-routing", str(empty)]) == 2
    assert "no trajectory records" in capsys.readouterr().err
