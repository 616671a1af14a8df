"""`libra bench elastic`'s analysis on hand-made member logs with known answers."""

from __future__ import annotations

import argparse

import pytest

from libra.bench.elastic import analyse
from libra.errors import LibraError


def _core(slow: dict[int, float], hashes: dict[int, str]) -> list[dict]:
    rows = []
    for u in range(1, 41):
        members = ["core0", "core1", "hybrid"] if 10 <= u <= 15 else ["core0", "core1"]
        row = {"update": u, "members": members, "timings": {"total_s": slow.get(u, 0.2)}}
        if u in hashes:
            row["hash"] = hashes[u]
        rows.append(row)
    return rows


def _hybrid(*, joins: bool = True) -> list[dict]:
    rows = []
    for u in range(10, 16):  # admitted at 10, current after 11, trains 12-15, leaves at 15
        ready = joins and u >= 11
        rows.append({
            "update": u, "cycle": 0, "since_register_s": 0.1 * (u - 9),
            "became_ready": ready and u == 11, "contributed": ready and u >= 12,
            "left": u == 15, "reason": None if joins else "no snapshot",
        })  # fmt: skip
    return rows


def test_stall_ratios_latency_and_hashes():
    args = argparse.Namespace(cycles=1)
    logs = {
        "core0-0": _core({11: 0.3, 16: 0.26, 25: 0.24}, {20: "a", 30: "b"}),
        "core1-0": _core({}, {20: "a", 30: "c"}),
        "hybrid-0": _hybrid(),
    }
    out = analyse(logs, "core0", args)
    assert out["median_step_ms"] == 200.0
    assert out["join_stall_ratio"] == 1.5  # update 11, inside the join window 9-12
    assert out["leave_stall_ratio"] == 1.3  # update 16: the epoch switch after the leave
    assert (out["join_stall_ratio_median"], out["leave_stall_ratio_median"]) == (1.5, 1.3)
    assert out["cycles"][0]["join_window_ms"] == [200.0, 200.0, 300.0, 200.0]
    assert out["join_latency_s"] == pytest.approx(0.2)  # registration to became_ready
    assert out["cycles"][0]["join_updates"] == 2  # admitted at 10, first real gradient at 12
    # steady windows of 4 updates: only those holding update 25 read 1.2; most read 1.0
    assert out["steady_window_ratio"] == 1.0
    assert (out["hash_mismatches"], out["hash_checks"]) == (1, 2)


def test_a_cycle_whose_hybrid_never_caught_up_is_an_error():
    logs = {"core0-0": _core({}, {}), "core1-0": _core({}, {}), "hybrid-0": _hybrid(joins=False)}
    with pytest.raises(LibraError, match="left before catching up: no snapshot"):
        analyse(logs, "core0", argparse.Namespace(cycles=1))
