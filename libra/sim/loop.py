"""The discrete-event loop: virtual time, a heap of callbacks, deterministic ties."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class Loop:
    """`at(t, fn, *args)` runs `fn(*args)` when virtual time reaches `t`; events at the
    same time run in the order they were scheduled, so a run is reproducible."""

    __slots__ = ("_heap", "_n", "events", "now")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._n = 0
        self.events = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        now = self.now
        heapq.heappush(self._heap, (t if t > now else now, self._n, fn, args))
        self._n += 1

    def run(self, done: Callable[[], bool], *, horizon: float = float("inf")) -> None:
        """Process events until `done()` holds, the queue runs dry, or `horizon`."""
        heap, pop, events = self._heap, heapq.heappop, self.events
        try:
            while heap and not done():
                t, _, fn, args = pop(heap)
                if t > horizon:
                    heapq.heappush(heap, (t, -1, fn, args))
                    return
                self.now = t
                events += 1
                fn(*args)
        finally:
            self.events = events


__all__ = ["Loop"]
