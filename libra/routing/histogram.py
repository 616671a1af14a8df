"""A length distribution over recent history: log-spaced bins, two tumbling windows.

`add` is O(1) (one bin increment); statistics cover the current window and the one
before it, so a node forgets what it saw more than two windows ago and follows the
policy as it drifts. Bins are 1/8 octave wide (quantiles within ~4.5%); the mean is
exact (sums are kept). Two histograms merge by adding counts window by window, so trees
built in several rollout processes combine into one.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

BINS_PER_OCTAVE = 8
_SCALE = BINS_PER_OCTAVE / math.log(2)


def bin_of(x: float) -> int:
    return int(math.log1p(max(0.0, x)) * _SCALE)


def _edge(b: float) -> float:
    """Lower edge of (fractional) bin `b`."""
    return math.expm1(b / _SCALE)


_MIDS = tuple(_edge(b + 0.5) for b in range(256))
"""Bin midpoints, `_edge(b + 0.5)`, of the bins up to ~1e9 tokens (summaries sum them)."""


class _Window:
    __slots__ = ("counts", "n", "total")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.n = 0
        self.total = 0.0

    def add(self, x: float, b: int) -> None:
        self.counts[b] = self.counts.get(b, 0) + 1
        self.n += 1
        self.total += x

    def merge(self, other: _Window) -> None:
        for b, c in other.counts.items():
            self.counts[b] = self.counts.get(b, 0) + c
        self.n += other.n
        self.total += other.total

    def to_list(self) -> list[Any]:
        return [self.n, self.total, sorted(self.counts.items())]

    @classmethod
    def from_list(cls, data: list[Any]) -> _Window:
        w = cls()
        w.n, w.total = int(data[0]), float(data[1])
        w.counts = {int(b): int(c) for b, c in data[2]}
        return w


class _Summary:
    """Sorted bins with cumulative counts (and midpoint-weighted sums), so that every
    statistic is a binary search."""

    __slots__ = ("bins", "cum", "cum_mid", "mean", "n", "p90")

    def __init__(self, counts: dict[int, int], n: int, total: float):
        self.bins = sorted(counts)
        self.cum: list[int] = []
        self.cum_mid: list[float] = []
        c = m = 0.0
        mids = _MIDS
        for b in self.bins:
            k = counts[b]
            c += k
            m += k * (mids[b] if b < 256 else _edge(b + 0.5))
            self.cum.append(int(c))
            self.cum_mid.append(m)
        self.n = n
        self.mean = total / n if n else 0.0
        self.p90 = self.quantile(0.9)

    def _start(self, above: float) -> tuple[int, int]:
        """Index of the first bin that can hold values > `above`, and the count below."""
        if above < 0:
            return 0, 0
        i = bisect.bisect_left(self.bins, bin_of(above))
        return i, self.cum[i - 1] if i else 0

    def quantile(self, q: float, above: float = -1.0) -> float:
        i0, base = self._start(above)
        rest = self.n - base
        if rest <= 0:
            return 0.0
        target = base + q * rest
        i = min(bisect.bisect_left(self.cum, target, lo=i0), len(self.bins) - 1)
        before = self.cum[i - 1] if i else 0
        frac = (target - before) / (self.cum[i] - before)
        return max(_edge(self.bins[i] + frac), above)

    def cdf(self, x: float) -> float:
        if not self.n:
            return 0.0
        bx = bin_of(x)
        i = bisect.bisect_left(self.bins, bx)
        below = float(self.cum[i - 1] if i else 0)
        if i < len(self.bins) and self.bins[i] == bx:
            lo, hi = _edge(bx), _edge(bx + 1)
            inside = self.cum[i] - below
            below += inside * min(1.0, max(0.0, (x - lo) / (hi - lo)))
        return below / self.n

    def conditional_mean(self, above: float) -> float:
        i0, base = self._start(above)
        rest = self.n - base
        if rest <= 0:
            return 0.0
        mid = self.cum_mid[-1] - (self.cum_mid[i0 - 1] if i0 else 0.0)
        return max(mid / rest, above)


class LengthHistogram:
    __slots__ = ("_summary", "count", "cur", "prev", "window")

    def __init__(self, window: int = 256):
        self.window = window
        """Samples per tumbling window; statistics cover between 1 and 2 windows."""
        self.cur = _Window()
        self.prev: _Window | None = None
        self._summary: _Summary | None = None
        self.count = 0
        """Samples the statistics cover (the current and the previous window)."""

    def add(self, x: float) -> None:
        cur = self.cur
        if cur.n >= self.window:
            self.prev, cur = cur, _Window()
            self.cur = cur
            self.count = self.prev.n
        # `cur.add(x, bin_of(x))` inlined: every tree update runs this per node
        b = int(math.log1p(max(0.0, x)) * _SCALE)
        counts = cur.counts
        counts[b] = counts.get(b, 0) + 1
        cur.n += 1
        cur.total += x
        self.count += 1
        self._summary = None

    def _recount(self) -> None:
        self.count = self.cur.n + (self.prev.n if self.prev else 0)

    def summary(self) -> _Summary:
        """The statistics of the recent samples, cached until the next change."""
        if self._summary is None:
            counts, n, total = self.cur.counts, self.cur.n, self.cur.total
            if self.prev is not None:
                counts = dict(self.prev.counts)
                for b, c in self.cur.counts.items():
                    counts[b] = counts.get(b, 0) + c
                n, total = n + self.prev.n, total + self.prev.total
            self._summary = _Summary(counts, n, total)
        return self._summary

    def mean_p90(self) -> tuple[float, float]:
        """(mean, 90th percentile) of the recent samples."""
        s = self.summary()
        return s.mean, s.p90

    def quantile(self, q: float, above: float = -1.0) -> float:
        """The q-quantile, interpolated in log space inside its bin; with `above`, of
        the samples greater than `above` only (a distribution conditioned on having
        run past a length). 0.0 when there are no such samples."""
        return self.summary().quantile(q, above)

    def cdf(self, x: float) -> float:
        """Share of the recent samples <= x (interpolated inside x's bin)."""
        return self.summary().cdf(x)

    def conditional_mean(self, above: float) -> float:
        """Mean of the samples greater than `above`, from bin midpoints (geometric);
        0.0 when there are none."""
        return self.summary().conditional_mean(above)

    def merge(self, other: LengthHistogram) -> None:
        self.cur.merge(other.cur)
        if other.prev is not None:
            if self.prev is None:
                self.prev = _Window()
            self.prev.merge(other.prev)
        self._recount()
        self._summary = None

    def to_list(self) -> list[Any]:
        return [self.cur.to_list(), self.prev.to_list() if self.prev else None]

    @classmethod
    def from_list(cls, data: list[Any], window: int) -> LengthHistogram:
        h = cls(window)
        h.cur = _Window.from_list(data[0])
        h.prev = _Window.from_list(data[1]) if data[1] is not None else None
        h._recount()
        return h


__all__ = ["BINS_PER_OCTAVE", "LengthHistogram", "bin_of"]
