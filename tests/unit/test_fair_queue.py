"""Fair admission across batches (libra.service.fair): pure, simulated slot by slot."""

from __future__ import annotations

from collections import Counter, deque

import pytest

from libra.service.fair import FairQueue


def simulate(q: FairQueue[str], slots: int, steps: int) -> list[tuple[str, str]]:
    """Fill `slots`, then repeatedly finish the oldest running item and admit the next."""
    running: deque[tuple[str, str]] = deque()
    admitted = []
    for _ in range(steps):
        while len(running) < slots and (item := q.pop()) is not None:
            running.append(item)
            admitted.append(item)
        if not running:
            break
        batch, _ = running.popleft()
        q.release(batch)
    return admitted


def test_a_batch_alone_uses_every_slot_in_submit_order() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", [f"a{i}" for i in range(10)])
    assert [q.pop() for _ in range(4)] == [("a", "a0"), ("a", "a1"), ("a", "a2"), ("a", "a3")]
    assert q.running("a") == 4 and q.pending("a") == 6


def test_a_late_small_batch_gets_an_equal_share_at_once() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("big", [f"big{i}" for i in range(1000)])
    first = [q.pop() for _ in range(8)]  # big fills all 8 slots
    assert {b for b, _ in first} == {"big"}
    q.push("small", [f"small{i}" for i in range(8)])
    # Each freed slot goes to the batch with fewer running until both hold 4.
    for b, _ in first[:4]:
        q.release(b)
    nxt = [q.pop() for _ in range(4)]
    assert [b for b, _ in nxt] == ["small"] * 4
    assert q.running("big") == 4 and q.running("small") == 4
    # FIFO would have made `small` wait for 1000 episodes; here it is done within 8 rounds.
    admitted = simulate(q, slots=8, steps=20)
    done_at = max(i for i, (b, _) in enumerate(admitted) if b == "small")
    assert done_at < 12


def test_three_batches_share_evenly_and_ties_rotate() -> None:
    q: FairQueue[str] = FairQueue()
    for name in "abc":
        q.push(name, [f"{name}{i}" for i in range(100)])
    admitted = simulate(q, slots=6, steps=60)
    counts = Counter(b for b, _ in admitted)
    assert max(counts.values()) - min(counts.values()) <= 1, counts
    assert [b for b, _ in admitted[:3]] == ["a", "b", "c"]


def test_drop_returns_the_queued_items_and_the_batch_is_forgotten_once_idle() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", ["a0", "a1", "a2"])
    q.push("b", ["b0"])
    assert q.pop() == ("a", "a0")
    assert q.drop("a") == ["a1", "a2"]
    assert q.pending("a") == 0 and q.running("a") == 1
    assert q.pop() == ("b", "b0")  # a has nothing queued any more
    q.release("a")
    q.release("b")
    assert q.pop() is None and q.pending() == 0 and q.running() == 0


def test_weights_split_the_slots_in_proportion_while_both_are_busy() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("train", [f"t{i}" for i in range(300)], weight=3.0)
    q.push("eval", [f"e{i}" for i in range(300)], weight=1.0)
    first = Counter(b for b, _ in (q.pop() for _ in range(8)))
    assert first == {"train": 6, "eval": 2}
    # Slot by slot, each freed slot keeps the split at 3:1; `eval` never waits for `train`.
    q2: FairQueue[str] = FairQueue()
    q2.push("train", [f"t{i}" for i in range(300)], weight=3.0)
    q2.push("eval", [f"e{i}" for i in range(300)], weight=1.0)
    admitted = simulate(q2, slots=8, steps=200)
    counts = Counter(b for b, _ in admitted)
    assert abs(counts["train"] - 3 * counts["eval"]) <= 3, counts
    assert counts["eval"] > 40


def test_a_weighted_batch_alone_still_uses_every_slot_and_weight_is_checked() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("eval", [f"e{i}" for i in range(10)], weight=0.25)
    assert [b for b, _ in (q.pop() for _ in range(6))] == ["eval"] * 6  # work-conserving
    q.push("eval", ["late"], weight=8.0)  # the first push set the weight
    q.push("train", [f"t{i}" for i in range(10)])
    assert q.pop() == ("train", "t0")  # 0 running of weight 1 against 6 of weight 0.25
    with pytest.raises(ValueError, match="weight must be > 0"):
        q.push("bad", ["x"], weight=0.0)
