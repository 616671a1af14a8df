"""Event-loop lag and garbage-collector passes of one process, sampled while a benchmark
runs (`libra bench control-plane`; a rollout worker started with `monitor` runs one too).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class LagMonitor:
    """Samples event-loop lag (how late a 10 ms sleep wakes up), peak RSS, and the
    garbage collector's passes (each one stops the loop): every full pass, and the
    longest of the young generations' passes."""

    def __init__(self) -> None:
        self.reset()
        self._gc_t0 = 0.0

    def reset(self) -> None:
        self.lags: list[float] = []
        self.peak_rss = 0.0
        self.full_gc_s: list[float] = []
        self.young_gc_s_max = 0.0

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif info["generation"] == 2:
            self.full_gc_s.append(time.perf_counter() - self._gc_t0)
        else:
            self.young_gc_s_max = max(self.young_gc_s_max, time.perf_counter() - self._gc_t0)

    async def run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            self.lags.append(time.perf_counter() - t - 0.01)
            if len(self.lags) % 10 == 0:
                self.peak_rss = max(self.peak_rss, rss_mb())

    def figures(self) -> dict[str, Any]:
        """Lag percentiles (ms), GC passes and peak RSS since the last `reset`."""
        return {
            "loop_lag_p50_ms": percentile(self.lags, 0.5) * 1e3,
            "loop_lag_p99_ms": percentile(self.lags, 0.99) * 1e3,
            "loop_lag_max_ms": max(self.lags, default=0.0) * 1e3,
            "full_gc_passes": len(self.full_gc_s),
            "full_gc_ms_max": max(self.full_gc_s, default=0.0) * 1e3,
            "young_gc_ms_max": self.young_gc_s_max * 1e3,
            "rss_peak_mb": self.peak_rss,
        }


__all__ = ["LagMonitor", "percentile", "rss_mb"]
