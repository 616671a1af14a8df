"""The pure parts of the elastic protocol: control slots, epochs, donor choice."""

from __future__ import annotations

import pytest

from libra.trainer.membership import ControlLayout, Epoch, Member, assign_donors, next_epoch


def test_control_slots_sum_like_the_all_reduce():
    lay = ControlLayout(8)
    a = lay.encode(tokens=5_000_123, samples=7, metrics={"loss": 1.5}, admit=2, slot=0,
                   ready=True)  # fmt: skip
    b = lay.encode(tokens=4095, samples=1, metrics={"loss": -0.5}, slot=3, leave=True, ready=True)
    c = lay.encode(tokens=1, samples=0, metrics={})  # a shard rank > 0: no flags
    summed = [x + y + z for x, y, z in zip(a, b, c, strict=True)]
    s = lay.decode(summed)
    assert s.tokens == 5_000_123 + 4095 + 1
    assert s.samples == 8 and s.metrics["loss"] == pytest.approx(1.0)
    assert s.admit == 2 and s.leaving == {3} and s.ready == {0, 3}


def test_token_count_stays_exact_in_float32_sums():
    """hi/lo split: float32 sums of large counts are exact (a single float32 is not)."""
    import torch

    lay = ControlLayout(2)
    counts = [16_777_217, 33_554_435, 9]  # above 2**24
    vecs = torch.tensor([lay.encode(tokens=n, samples=0, metrics={}) for n in counts])
    total = vecs.sum(0, dtype=torch.float32).tolist()
    assert lay.decode(total).tokens == sum(counts)
    assert int(torch.tensor(float(sum(counts)), dtype=torch.float32)) != sum(counts)


def test_slot_beyond_max_replicas_is_refused():
    with pytest.raises(ValueError, match="max_replicas"):
        ControlLayout(2).encode(tokens=0, samples=0, metrics={}, slot=2)


def test_next_epoch_and_donors_prefer_ready_hybrids():
    core = (Member("c0", "core"), Member("c1", "core"))
    e0 = Epoch(0, "e0", 1, core, frozenset({"c0", "c1"}))
    h1 = Member("h1", "hybrid", 1, ("127.0.0.1:1",))
    e1 = next_epoch(e0, leaving=set(), joins=[h1], ready={"c0", "c1"}, start=5)
    assert e1.name == "e1" and e1.start == 5 and e1.ids() == ["c0", "c1", "h1"]
    assert e1.donor_of("h1") == "c0"  # no ready hybrid yet: the first core replica
    h2, h3 = (Member(f"h{i}", "hybrid", i, ("127.0.0.1:2",)) for i in (2, 3))
    e2 = next_epoch(e1, leaving=set(), joins=[h2, h3], ready={"c0", "c1", "h1"}, start=9)
    assert e2.donors == (("h2", "h1"), ("h3", "c0"))  # a ready hybrid first, then spread
    # h2 still catching up when h4 joins: its snapshot is in flight, so only h4 gets a donor
    h4 = Member("h4", "hybrid", 4, ("127.0.0.1:4",))
    e2b = next_epoch(e2, leaving=set(), joins=[h4], ready={"c0", "c1", "h1", "h3"}, start=10)
    assert e2b.donors == (("h4", "h1"),) and "h2" not in e2b.ready
    e3 = next_epoch(e2, leaving={"h1"}, joins=[], ready={"c0", "c1", "h2", "h3"}, start=12)
    assert e3.ids() == ["c0", "c1", "h2", "h3"] and e3.donors == ()
    assert Epoch.from_json(e2.to_json()) == e2
    with pytest.raises(RuntimeError):
        assign_donors(core, set(), ["c0"])
