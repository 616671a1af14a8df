"""libra bench control-plane reports the garbage collector's passes; the rollout
process's collector settings (run_sync)."""

from __future__ import annotations

import gc

import pytest

from libra.bench.control_plane import LagMonitor
from libra.rollout.run import GC_THRESHOLDS, run_sync


def test_the_lag_monitor_counts_full_passes_apart_from_young_ones() -> None:
    monitor = LagMonitor()
    gc.callbacks.append(monitor.on_gc)
    try:
        gc.collect(0)
        gc.collect(1)
        gc.collect(2)
    finally:
        gc.callbacks.remove(monitor.on_gc)
    assert len(monitor.full_gc_s) == 1
    assert monitor.young_gc_s_max > 0.0


def test_run_sync_sets_thresholds_for_a_long_lived_process() -> None:
    before = gc.get_threshold()

    async def thresholds() -> tuple[int, ...]:
        return gc.get_threshold()

    try:
        assert run_sync(thresholds()) == GC_THRESHOLDS
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
    # full passes rarer than Python's default; the young generations as they were
    assert GC_THRESHOLDS[2] > 10
    assert GC_THRESHOLDS[:2] == (700, 10)


def test_a_count_below_one_is_one_line_naming_the_flag(capsys) -> None:
    """`--episodes -1` ended in `ValueError: Semaphore initial value must be >= 0`; the
    benchmarks' count flags now take integers >= 1 (`libra.cli.common.count`)."""
    from libra.cli import main

    for argv in (["control-plane", "--episodes", "-1"], ["service", "--episodes", "0"],
                 ["routing", "--nodes", "x"]):  # fmt: skip
        with pytest.raises(SystemExit) as ended:  # argparse's own exit, code 2
            main(["bench", *argv])
        assert ended.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"libra: error: argument {argv[1]}: expected an integer >= 1")
