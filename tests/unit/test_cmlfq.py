"""C-MLFQ decisions: what it learns from finished episodes and where it sends the next."""

from __future__ import annotations

import pytest

from libra.errors import ConfigError
from libra.record import ToolReturn, Trajectory, Turn
from libra.routing import Bucket, Decision, EpisodeState, ToolState, make_policy

BUCKETS = [Bucket("tp2", 2, 5_000), Bucket("tp4", 4, 15_000), Bucket("tp8", 8, 40_960)]
PROMPT = 200


def record(task, turns, *, step=0, status="ok", prompt=PROMPT):
    """`turns`: (model_tokens, [(tool, status, payload), ...]); a tool's tokens are its
    payload plus 10 template tokens."""
    out, start = [], 0
    for model, rets in turns:
        tool_tokens = sum(p + 10 for _, _, p in rets)
        out.append(
            Turn(
                start=start, model_tokens=model, tool_tokens=tool_tokens, bucket="",
                endpoint="", policy_version=step,
                tool_returns=[ToolReturn(tool=t, status=s, payload_tokens=p, latency_s=0.1)
                              for t, s, p in rets],
            )
        )  # fmt: skip
        start += model + tool_tokens
    return Trajectory(
        id=f"{task}-{step}-{len(turns)}", batch_id="b", task_id=task, group_id=task, env="e",
        step=step, status=status, prompt_tokens=prompt, total_tokens=prompt + start, turns=out,
    )  # fmt: skip


def long_after_error(task="q", step=0):
    """An error from `search` at the first return; then ten long turns (~21K total)."""
    return record(task, [(1000, [("search", "error", 300)])] + [(1900, [])] * 10, step=step)


def short_after_ok(task="q", step=0):
    """A good first search; the answer follows (~2K total)."""
    return record(task, [(1000, [("search", "ok", 300)]), (500, [])], step=step)


def at_first_return(status, *, task="q", bucket="tp2", ctx=PROMPT + 1310, turn=1):
    return EpisodeState("e", task, PROMPT, ctx, (ToolState("search", status, 300),), bucket, turn)


def policy(**options):
    options.setdefault("min_samples", 4)
    return make_policy("cmlfq", BUCKETS, options)


def teach(p, records, step=0):
    for r in records:
        p.on_finish(r)
    p.end_step(step)


def test_a_learned_causal_signal_moves_the_episode_once_at_its_first_return():
    p = policy()
    assert p.on_start(at_first_return("error")) == "tp2"
    assert p.on_tool_return(at_first_return("error")) == "tp2"  # nothing learned yet
    teach(p, [long_after_error() for _ in range(8)] + [short_after_ok() for _ in range(8)])
    moved = p.on_tool_return(at_first_return("error"))
    assert isinstance(moved, Decision) and moved.bucket == "tp8"
    assert "cmlfq (agree)" in moved.reason and "re-prefill" in moved.reason
    assert p.on_tool_return(at_first_return("ok")) == "tp2"
    # an unseen prompt is routed from the pooled tree
    assert p.on_tool_return(at_first_return("error", task="other")).bucket == "tp8"


def test_between_steps_holds_updates_until_the_step_ends_online_does_not():
    held, online = policy(), policy(update="online")
    for p in (held, online):
        for _ in range(8):
            p.on_finish(long_after_error())
    assert held.on_tool_return(at_first_return("error")) == "tp2"
    assert online.on_tool_return(at_first_return("error")).bucket == "tp8"
    # a record of a later step closes the earlier one even without end_step
    held.on_finish(short_after_ok(step=1))
    assert held.on_tool_return(at_first_return("error")).bucket == "tp8"


def test_failed_or_aborted_episodes_teach_nothing():
    p = policy()
    teach(p, [record("q", [(30_000, [])], status=s) for s in ("error", "aborted")])
    assert p.tree.episodes == 0


def _mixed(p):
    """After one ok search, 60% of episodes run to ~15.5K tokens, 40% end at ~2K."""
    longs = [record("q", [(1000, [("search", "ok", 300)])] + [(1400, [])] * 10) for _ in range(6)]
    teach(p, longs + [short_after_ok() for _ in range(4)])


def test_disagreeing_predictions_wait_unless_an_overflow_is_next():
    p = policy(kv_aware=False)
    _mixed(p)
    assert p.on_tool_return(at_first_return("ok")) == "tp2"  # mean tp4, p90 tp8: wait
    # 4,000 tokens after one turn: the next turn will cross 5,000, and 60% of such
    # episodes end beyond it -> move now to the likeliest larger bucket
    near = at_first_return("ok", ctx=4_000)
    moved = p.on_tool_return(near)
    assert moved.bucket == "tp8" and "deadline" in moved.reason
    assert policy(kv_aware=False, deadline=False).on_tool_return(near) == "tp2"


def test_start_bucket_comes_from_the_prompts_root_when_it_is_sure():
    sure, paper = policy(), policy(start="smallest")
    for p in (sure, paper):
        teach(p, [long_after_error("always-long") for _ in range(8)])
        teach(p, [short_after_ok(f"s{i}") for i in range(8)], step=1)
    fresh = EpisodeState("e", "always-long", PROMPT, PROMPT, (), "", 0)
    assert sure.on_start(fresh) == "tp8"
    assert paper.on_start(fresh) == "tp2"
    assert sure.on_start(EpisodeState("e", "unknown", PROMPT, PROMPT, (), "", 0)) == "tp2"


def test_kv_aware_refuses_a_move_its_re_prefill_does_not_pay_for():
    short_tail = [record("q", [(3800, [("search", "ok", 300)]), (40, [])]) for _ in range(8)]
    state = at_first_return("ok", bucket="tp8", ctx=4_300)  # predicted total ~4,350: tp2
    aware, blind = policy(start="smallest"), policy(start="smallest", kv_aware=False)
    teach(aware, short_tail)
    teach(blind, short_tail)
    assert aware.on_tool_return(state) == "tp8"
    assert blind.on_tool_return(state).bucket == "tp2"


def test_payload_size_classes_follow_the_configured_thresholds():
    assert policy().key(ToolState("search", "ok", 300)) == ("search", "small", "ok")
    p = policy(small_payload=100, large_payload=250)
    assert p.key(ToolState("search", "ok", 300)) == ("search", "large", "ok")
    assert p.key(ToolState("search", "ok", 200)) == ("search", "medium", "ok")
    with pytest.raises(ConfigError, match="large_payload"):
        policy(small_payload=600, large_payload=500)


def test_the_tree_persists_across_runs(tmp_path):
    path = tmp_path / "tree.json"
    first = policy(tree_path=str(path))
    teach(first, [long_after_error() for _ in range(8)])
    first.save()
    second = policy(tree_path=str(path))
    assert second.on_tool_return(at_first_return("error")).bucket == "tp8"
    with pytest.raises(ConfigError, match="payload thresholds"):
        policy(tree_path=str(path), small_payload=100)
    path.write_text("{}")
    with pytest.raises(ConfigError, match="not a C-MLFQ tree file"):
        policy(tree_path=str(path))
    with pytest.raises(ConfigError, match="no tree path"):
        policy().save()


def test_unknown_options_and_policies_are_one_clear_error():
    with pytest.raises(ConfigError, match="min_sample: unknown key"):
        make_policy("cmlfq", BUCKETS, {"min_sample": 3})
    with pytest.raises(ConfigError, match="known: cmlfq, mlfq, predictor, static"):
        make_policy("fifo", BUCKETS)


def test_the_planners_cost_model_prices_moves_when_named():
    pytest.importorskip("libra.planner.rollout_cost")
    from libra.routing.cost import PlannerCost, TPScaledCost

    planner = PlannerCost("qwen3-14b", "a800-80g")
    for cost in (planner, TPScaledCost()):
        # a wider instance decodes faster; prefill grows with the context
        assert cost.decode_s_per_token(BUCKETS[2], 8_000) < cost.decode_s_per_token(
            BUCKETS[0], 8_000
        )
        assert cost.prefill_s(BUCKETS[1], 8_000) > cost.prefill_s(BUCKETS[1], 1_000) > 0
    p = policy(cost_profile="qwen3-14b@a800-80g")
    assert isinstance(p.cost, PlannerCost)
    teach(p, [long_after_error() for _ in range(8)])
    assert p.on_tool_return(at_first_return("error")).bucket == "tp8"
    with pytest.raises(ConfigError, match="MODEL@HARDWARE"):
        policy(cost_profile="qwen3-14b")
    with pytest.raises(ConfigError, match="unknown hardware"):
        policy(cost_profile="qwen3-14b@tpu-v9")


def test_the_distribution_rule_moves_to_the_likeliest_final_bucket():
    """After one ok search 60% of episodes end in tp8 and 40% in tp2: the paper's rule
    waits (mean in tp4, P90 in tp8); the distribution rule moves to tp8, the bucket most
    likely to be final; with the gate it needs the paper's agreement and waits too."""
    accuracy = policy(objective="accuracy")
    _mixed(accuracy)
    moved = accuracy.on_tool_return(at_first_return("ok"))
    assert isinstance(moved, Decision) and moved.bucket == "tp8"
    p = float(moved.reason.split("P=")[1].split(")")[0])
    assert 0.5 < p <= 0.6 and "re-prefill" not in moved.reason  # accuracy: no cost judge
    for waits in (policy(objective="accuracy", gate=True), policy(kv_aware=False, deadline=False)):
        _mixed(waits)
        assert waits.on_tool_return(at_first_return("ok")) == "tp2"
    cost = policy(objective="cost", kv_aware=False)  # cost: the judge, whatever kv_aware says
    _mixed(cost)
    judged = cost.on_tool_return(at_first_return("ok"))
    assert isinstance(judged, Decision) and "re-prefill" in judged.reason
    # Mostly short after an ok search: the current bucket is the likeliest; stay.
    stays = policy(objective="accuracy")
    longs = [record("q", [(1000, [("search", "ok", 300)])] + [(1400, [])] * 10) for _ in range(3)]
    teach(stays, longs + [short_after_ok() for _ in range(7)])
    assert stays.on_tool_return(at_first_return("ok")) == "tp2"
    assert policy(objective="accuracy", rule="paper").config.decision_rule == "paper"


def test_accuracy_waits_for_a_return_that_will_tell_and_moves_once():
    """After a first ok search, 45% of episodes end in tp8, 30% in tp2, 25% in tp4: tp8 is
    the likeliest, but the second return tells them apart (an error: tp8; ok: tp2 or
    tp4), so objective = accuracy waits for it, then moves once; it moves at once when
    the next turn would overflow tp2 (no second chance), and never twice."""

    def two(second, tail):
        return record("q", [(1000, [("search", "ok", 300)]), (1000, [("search", second, 300)])]
                      + tail)  # fmt: skip

    p = policy(objective="accuracy")
    teach(p, [two("error", [(1900, [])] * 10) for _ in range(9)]
          + [two("ok", [(500, [])]) for _ in range(6)]
          + [two("ok", [(1500, [])] * 5) for _ in range(5)])  # fmt: skip
    assert p.on_tool_return(at_first_return("ok")) == "tp2"  # wait: the next return tells
    rets = (ToolState("search", "ok", 300), ToolState("search", "error", 300))
    second = EpisodeState("e", "q", PROMPT, PROMPT + 2620, rets, "tp2", 2)
    moved = p.on_tool_return(second)
    assert isinstance(moved, Decision) and moved.bucket == "tp8"
    assert p.on_tool_return(EpisodeState("e", "q", PROMPT, PROMPT + 2620, rets, "tp8", 2)) == "tp8"
    # 4,000 tokens after one turn: the next one crosses 5,000, so it is now or never (and
    # from 4,000 tokens on, the short and medium episodes both end in tp4: 55%).
    near = EpisodeState("e2", "q", PROMPT, 4_000, (ToolState("search", "ok", 300),), "tp2", 1)
    assert p.on_tool_return(near).bucket == "tp4"
    # objective = cost does not look ahead: it moves to the likeliest bucket at once.
    cost = policy(objective="cost")
    teach(cost, [two("error", [(1900, [])] * 10) for _ in range(9)]
          + [two("ok", [(500, [])]) for _ in range(6)]
          + [two("ok", [(1500, [])] * 5) for _ in range(5)])  # fmt: skip
    assert cost.on_tool_return(at_first_return("ok")).bucket == "tp8"


def test_blend_weighs_the_prompts_own_node_against_the_pooled_one():
    """Prompt q's own four episodes say short (3 of 4) after an ok search; the pooled
    tree, 36 episodes of other prompts more, says long. `deepest` takes q's node alone
    and stays; `blend` weighs it 4 / (4 + min_samples) and moves to tp8."""
    long = [(1000, [("search", "ok", 300)])] + [(1900, [])] * 10
    short = [(1000, [("search", "ok", 300)]), (500, [])]
    mine = [record("q", short) for _ in range(3)] + [record("q", long)]
    others = [record(f"o{i}", long) for i in range(36)]
    for objective in ("accuracy", "cost"):
        deepest = policy(objective=objective, kv_aware=False)
        blend = policy(objective=objective, backoff="blend")
        for p in (deepest, blend):
            teach(p, mine + others)
        assert deepest.on_tool_return(at_first_return("ok")) == "tp2"
        moved = blend.on_tool_return(at_first_return("ok"))
        assert isinstance(moved, Decision) and moved.bucket == "tp8", objective
        assert "P=0.59" in moved.reason  # 0.5 x 0.25 + 0.5 x 37/40
