"""The baselines C-MLFQ is measured against, in the same interface."""

from __future__ import annotations

from libra.record import Trajectory, Turn
from libra.routing import Bucket, Decision, EpisodeState, make_policy

BUCKETS = [Bucket("tp2", 2, 5_000), Bucket("tp4", 4, 15_000), Bucket("tp8", 8, 40_960)]


def state(tokens, bucket, task="q", ids=(), prompt=200):
    return EpisodeState("e", task, prompt, tokens, (), bucket, 1, tuple(ids))


def finished(task, total, step=0, ids=()):
    turn = Turn(start=0, model_tokens=total - 200, tool_tokens=0, bucket="", endpoint="",
                policy_version=step)  # fmt: skip
    return Trajectory(
        id=f"{task}/{step}", batch_id="b", task_id=task, group_id=task, env="e", step=step,
        prompt_token_ids=list(ids), prompt_tokens=200, total_tokens=total, turns=[turn],
    )  # fmt: skip


def test_mlfq_demotes_one_bucket_each_time_the_context_reaches_the_bound():
    p = make_policy("mlfq", BUCKETS)
    assert p.on_start(state(200, "")) == "tp2"
    assert p.on_start(state(6_000, "", prompt=6_000)) == "tp4"  # a prompt that needs it
    assert p.on_tool_return(state(4_999, "tp2")) == "tp2"
    moved = p.on_tool_return(state(5_000, "tp2"))
    assert isinstance(moved, Decision) and moved.bucket == "tp4"
    assert moved.reason.startswith("overflow")
    assert p.on_tool_return(state(39_000, "tp4")).bucket == "tp8"  # one level at a time
    assert p.on_tool_return(state(40_000, "tp8")) == "tp8"


def test_predictor_learns_per_prompt_history_and_routes_only_at_the_start():
    p = make_policy("predictor", BUCKETS)
    assert p.on_start(state(200, "", task="long-1")) == "tp2"  # knows nothing yet
    for step in range(2):  # a second epoch: the prompts come back
        for i in range(20):
            p.on_finish(finished(f"long-{i}", 20_000, step=step))
            p.on_finish(finished(f"short-{i}", 2_000, step=step))
        p.end_step(step)
    assert p.on_start(state(200, "", task="long-1")) == "tp8"
    assert p.on_start(state(200, "", task="short-1")) == "tp2"
    assert p.on_tool_return(state(4_999, "tp2", task="long-1")) == "tp2"


def test_predictor_reads_prompt_tokens_when_the_engine_passes_them():
    p = make_policy("predictor", BUCKETS)
    long_ids, short_ids = list(range(16)) * 4, list(range(16, 32)) * 4
    for i in range(40):  # every prompt new: only its tokens tell long from short
        p.on_finish(finished(f"a{i}", 20_000, ids=long_ids))
        p.on_finish(finished(f"b{i}", 2_000, ids=short_ids))
    p.end_step(0)
    assert p.on_start(state(200, "", task="new-a", ids=long_ids)) == "tp8"
    assert p.on_start(state(200, "", task="new-b", ids=short_ids)) == "tp2"


def test_static_never_moves_and_every_policy_takes_end_step():
    for name in ("cmlfq", "mlfq", "predictor", "static"):
        p = make_policy(name, BUCKETS)
        p.on_finish(finished("q", 3_000))
        p.end_step(0)  # the engine calls it on any policy
    p = make_policy("static", BUCKETS)
    assert p.on_tool_return(state(30_000, "tp2")) == "tp2"
