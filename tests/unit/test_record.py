"""The trajectory record is a public contract: its schema file is checked in."""

from __future__ import annotations

import json
from pathlib import Path

from libra.record import Trajectory, json_schema

SCHEMA = Path(__file__).resolve().parents[2] / "libra" / "trajectory.schema.json"


def test_checked_in_schema_matches_the_model() -> None:
    assert json.loads(SCHEMA.read_text()) == json_schema(), (
        "libra/trajectory.schema.json is stale; regenerate it with "
        "`python -m libra.record > libra/trajectory.schema.json`"
    )


def test_contract_fields_present() -> None:
    props = json_schema()["properties"]
    for field in [
        "id",
        "batch_id",
        "task_id",
        "group_id",
        "env",
        "step",
        "seq",
        "status",
        "reward",
        "reward_info",
        "answer",
        "prompt_token_ids",
        "prompt_tokens",
        "response_token_ids",
        "loss_mask",
        "logprobs",
        "total_tokens",
        "turns",
        "migrations",
        "timings",
    ]:
        assert field in props, field
    turn = json_schema()["$defs"]["Turn"]["properties"]
    for field in [
        "start",
        "model_tokens",
        "tool_tokens",
        "bucket",
        "endpoint",
        "policy_version",
        "finish_reason",
        "tool_calls",
        "tool_returns",
    ]:
        assert field in turn, field


def test_round_trip_and_traces_without_token_ids() -> None:
    rec = Trajectory(id="e", batch_id="b", task_id="t", group_id="g", env="arith", prompt_tokens=3)
    assert Trajectory.from_json(rec.to_json()) == rec
    sparse = Trajectory.from_json(
        b'{"id":"e","batch_id":"b","task_id":"t","group_id":"g","env":"x","step":2,'
        b'"prompt_tokens":10,"total_tokens":50,"turns":[{"start":0,"model_tokens":20,'
        b'"tool_tokens":20,"bucket":"tp1","endpoint":"","policy_version":0,'
        b'"tool_returns":[{"tool":"search","status":"ok","payload_tokens":20,"latency_s":0.1}]}]}'
    )
    assert sparse.response_token_ids == [] and sparse.turns[0].tool_returns[0].tool == "search"


def test_libra_rollout_writes_an_error_record_for_one_it_cannot_write(tmp_path) -> None:
    """`libra rollout`'s JSONL sink: a record nested deeper than pydantic and orjson
    write (about 254 levels) raised out of the sink and ended the job; now its
    episode's `error` record stands in and the next records follow."""
    from libra.record import Trajectory, read_jsonl
    from libra.rollout.sink import JsonlSink

    def rec(i: int) -> Trajectory:
        return Trajectory(id=f"b/t{i}/0", batch_id="b", task_id=f"t{i}", group_id=f"b/t{i}",
                          env="arith", response_token_ids=[1, 2])  # fmt: skip

    deep: object = 1
    for _ in range(300):
        deep = [deep]
    bad = rec(1)
    bad.reward_info = {"trace": deep}
    sink = JsonlSink(tmp_path / "out.jsonl")
    written = [sink(r) for r in (rec(0), bad, rec(2))]
    sink.close()
    back = read_jsonl(tmp_path / "out.jsonl")
    assert [r.id for r in back] == [r.id for r in written] == ["b/t0/0", "b/t1/0", "b/t2/0"]
    assert [r.status for r in back] == ["ok", "error", "ok"] and written[1].status == "error"
    assert "record could not be written" in (back[1].error or "")
