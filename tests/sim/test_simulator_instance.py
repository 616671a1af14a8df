"""The simulator's inference instance against a token-by-token reference.

The instance advances a whole batch between events in closed form; these tests step the
same batch one decode step at a time with the planner's step time and check that the
closed form lands on the same completion times, that admission follows vLLM's rules
(max_num_seqs, KV capacity, first come first served), that a KV overflow preempts the
newest sequence without losing its tokens, and that prefill stalls the batch.
"""

from __future__ import annotations

import dataclasses

import pytest

from libra.planner import instance_cost, load_hardware, load_model, prefill_time
from libra.routing import Bucket, PlannerCost
from libra.sim.fleet import FleetMoveCost
from libra.sim.instance import Instance
from libra.sim.loop import Loop

MODEL, HW = load_model("qwen3-14b"), load_hardware("a800-80g")


class Seq:
    """The sequence protocol an instance drives (what `fleet.Run` provides)."""

    def __init__(self, name: str, ctx: int, seg: int, pre: int = 0):
        self.name, self.ctx, self.seg = name, ctx, seg
        self.pre_tokens, self.pre_ctx = pre, ctx - pre
        self.d_end = self.kv_off = 0.0
        self.generated = 0

    def progress(self, done: int) -> None:
        done = max(0, min(done, self.seg))
        self.ctx += done
        self.seg -= done
        self.generated += done
        self.pre_tokens, self.pre_ctx = self.ctx, 0


def harness(tp: int = 4, max_seqs: int = 256, kv_cap: int | None = None):
    loop, finished = Loop(), {}
    cost = instance_cost(MODEL, HW, tp)
    if kv_cap is not None:
        cost = dataclasses.replace(cost, kv_capacity=kv_cap)

    def done(inst, seq, now):
        seq.generated += seq.seg
        finished[seq.name] = (now, seq.generated)

    inst = Instance(1, cost, max_seqs, loop.at, done)
    inst.role = "live"
    return loop, inst, cost, finished


def reference(cost, seqs):
    """Token-by-token: (name, join time, context, tokens) -> finish time."""
    pending = sorted(seqs, key=lambda s: s[1])
    active: dict[str, list[float]] = {}
    t, out = 0.0, {}
    while pending or active:
        while pending and pending[0][1] <= t:
            name, _, ctx, n = pending.pop(0)
            active[name] = [ctx, n]
        if not active:
            t = pending[0][1]
            continue
        b = len(active)
        t += cost.step_time(b, sum(v[0] for v in active.values()))
        for name in list(active):
            active[name][0] += 1
            active[name][1] -= 1
            if active[name][1] <= 0:
                out[name] = t
                del active[name]
    return out


def test_step_time_and_prefill_time_are_the_planner_functions():
    for tp in (1, 2, 4, 8):
        ic = instance_cost(MODEL, HW, tp)
        for b, k in [(1, 0.0), (7, 3e4), (256, 4e6)]:
            assert ic.step_time(b, k) == pytest.approx(float(ic.step_s(float(b), k)), rel=1e-12)
        assert ic.prefill_time(5000, 12000) == pytest.approx(
            prefill_time(MODEL, HW, tp, 5000, 12000), rel=1e-12
        )


def test_move_cost_prices_moves_as_planner_cost_does():
    costs = {tp: instance_cost(MODEL, HW, tp) for tp in (2, 8)}
    mine, theirs = FleetMoveCost(costs), PlannerCost("qwen3-14b", "a800-80g")
    for b in (Bucket("tp2", 2, 5000), Bucket("tp8", 8, 40960)):
        assert mine.prefill_s(b, 9000) == pytest.approx(theirs.prefill_s(b, 9000), rel=1e-12)
        assert mine.decode_s_per_token(b, 12000) == pytest.approx(
            theirs.decode_s_per_token(b, 12000), rel=1e-12
        )


def test_one_sequence_finishes_when_its_decode_steps_are_done():
    loop, inst, cost, finished = harness()
    inst.submit(Seq("a", 2000, 3000), 0.0)
    loop.run(lambda: False)
    expected = reference(cost, [("a", 0.0, 2000, 3000)])["a"]
    assert finished["a"][0] == pytest.approx(expected, rel=1e-6)
    assert finished["a"][1] == 3000


def test_batch_with_joins_matches_token_by_token_reference():
    loop, inst, cost, finished = harness()
    plan = [("a", 0.0, 1000, 4000), ("b", 0.0, 30000, 1500), ("c", 7.3, 500, 2500)]
    for name, t0, ctx, n in plan:
        loop.at(t0, inst.submit, Seq(name, ctx, n), t0)
    loop.run(lambda: False)
    ref = reference(cost, plan)
    for name in ref:
        # joins land mid-step in the fluid model: within a step or two of the reference
        assert finished[name][0] == pytest.approx(ref[name], abs=0.1), name
    assert finished["b"][0] < finished["c"][0] < finished["a"][0]


def test_admission_caps_the_batch_at_max_num_seqs():
    loop, inst, cost, finished = harness(max_seqs=2)
    for name in "abc":
        inst.submit(Seq(name, 100, 1000), 0.0)
    assert len(inst.active) == 2 and len(inst.queue) == 1
    loop.run(lambda: False)
    # c starts only when a and b finish, then runs alone
    alone = reference(cost, [("c", 0.0, 100, 1000)])["c"]
    assert finished["c"][0] == pytest.approx(finished["a"][0] + alone, rel=1e-3)


def test_kv_overflow_preempts_the_newest_and_keeps_its_tokens():
    loop, inst, _cost, finished = harness(kv_cap=6000)
    inst.submit(Seq("old", 1000, 3000), 0.0)
    inst.submit(Seq("new", 1000, 3000), 0.0)  # both fit at the start, not at the end
    loop.run(lambda: False)
    assert inst.preemptions >= 1
    assert finished["old"][1] == 3000 and finished["new"][1] == 3000
    assert finished["old"][0] < finished["new"][0]


def test_prefill_stalls_the_running_batch():
    loop, inst, cost, finished = harness()
    inst.submit(Seq("a", 1000, 2000), 0.0)
    loop.run(lambda: False)
    plain = finished["a"][0]
    loop, inst, cost, finished = harness()
    inst.submit(Seq("a", 1000, 2000), 0.0)
    stall = float(cost.prefill_s(8000, 8000 * 8000 / 2.0))
    loop.at(1.0, inst.submit, Seq("b", 8000, 1, pre=8000), 1.0)
    loop.run(lambda: False)
    assert finished["a"][0] - plain == pytest.approx(stall, rel=0.05, abs=0.02)


def test_evicted_sequences_keep_what_they_generated():
    loop, inst, _cost, _finished = harness()
    s = Seq("a", 1000, 5000)
    inst.submit(s, 0.0)
    loop.run(lambda: False, horizon=10.0)
    out = inst.evict_all(10.0)
    assert out == [s] and 0 < s.generated < 5000
    assert s.seg == 5000 - s.generated and s.pre_tokens == s.ctx == 1000 + s.generated


def test_sequences_finishing_together_finish_in_admission_order():
    """Equal finish marks are broken by admission order, never by where the sequences
    happen to sit in memory: a run must not depend on what ran before it in the same
    process (a simulator grid runs many cells per worker process)."""
    loop, order = Loop(), []
    inst = Instance(1, instance_cost(MODEL, HW, 4), 64, loop.at,
                    lambda inst, seq, now: order.append(seq.name))  # fmt: skip
    inst.role = "live"
    seqs = sorted((Seq(f"s{i}", ctx=500, seg=40) for i in range(8)), key=id, reverse=True)
    for seq in seqs:  # admitted from the highest address down
        inst.submit(seq, 0.0)
    loop.run(lambda: len(order) == len(seqs))
    assert order == [s.name for s in seqs]
