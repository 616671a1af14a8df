"""The staleness gate: no group is started that would be trained too stale; the long tail
is waited for (never dropped for staleness); fast groups overtake slow ones."""

from __future__ import annotations

import random

import pytest

from libra.train.admission import StalenessGate


def test_admission_stops_at_the_staleness_bound() -> None:
    g = StalenessGate(batch_groups=2, max_staleness=1)
    steps = [g.admit(f"g{i}") for i in range(5)]
    assert steps == [0, 0, 1, 1, None]  # 2 steps x 2 slots, then wait
    assert g.in_flight() == 4


def test_synchronous_when_staleness_is_zero() -> None:
    g = StalenessGate(batch_groups=2, max_staleness=0)
    assert [g.admit("a"), g.admit("b"), g.admit("c")] == [0, 0, None]
    g.finish("a")
    assert g.ready() is None  # b still running: the step waits for its tail
    g.finish("b")
    assert sorted(g.ready() or []) == ["a", "b"]
    g.trained()
    assert g.admit("c") == 1


def test_a_slow_group_is_overtaken_within_its_deadline_and_never_dropped() -> None:
    g = StalenessGate(batch_groups=1, max_staleness=2)
    assert [g.admit("slow"), g.admit("f1"), g.admit("f2")] == [0, 1, 2]
    g.finish("f1")
    assert g.ready() == ["f1"]  # f1 overtakes; slow moves to step 1
    g.trained()
    g.finish("f2")
    assert g.ready() == ["f2"]  # slow (deadline 0 + 2 = 2) moves to step 2
    g.trained()
    assert g.ready() is None  # now slow is due: the step waits for it
    assert g.staleness_of("slow") == 2
    g.finish("slow")
    assert g.ready() == ["slow"]


def test_dynamic_sampling_frees_the_slot_until_replacements_run_out() -> None:
    g = StalenessGate(batch_groups=1, max_staleness=0, max_replacements=2)
    g.admit("a")
    assert not g.keep_equal("a")
    g.drop("a")
    assert g.admit("b") == 0  # the replacement takes the freed slot
    g.drop("b")
    g.admit("c")
    assert g.keep_equal("c")  # two drops booked to step 0: keep what comes


@pytest.mark.parametrize("seed", range(20))
def test_random_schedules_respect_the_bound(seed: int) -> None:
    """Random finish orders and drops: every trained group's staleness <= k, every
    batch is full, admission never books beyond version + k."""
    rng = random.Random(seed)
    k, b = rng.randint(0, 3), rng.randint(1, 4)
    g = StalenessGate(batch_groups=b, max_staleness=k, max_replacements=3)
    running: list[str] = []
    n = 0
    for _ in range(400):
        while (s := g.free_step()) is not None:
            key = f"g{n}"
            n += 1
            assert g.admit(key) == s and g.version <= s <= g.version + k
            running.append(key)
        if running and rng.random() < 0.7:
            key = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.2 and not g.keep_equal(key):
                g.drop(key)
            else:
                g.finish(key)
        batch = g.ready()
        if batch is not None:
            assert len(batch) == b
            assert all(g.staleness_of(x) <= k for x in batch)
            assert all(g.bookings[x].admitted_version >= g.version - k for x in batch)
            g.trained()
    assert g.version > 3
