"""Keep the event loop responsive: cap requests in flight by measured loop lag.

When thousands of episodes are in flight and endpoints answer fast, every response
that arrives costs the event loop some CPU (parse, tokenize, render). If hundreds arrive
in one loop iteration, timers (timeouts, health probes, the HTTP service) fire late.
`LagGovernor` is a pure AIMD state machine (it owns no tasks): fed the loop lag it
observes, it shrinks the process-wide cap on requests in flight when lag exceeds the
target and grows it back when the loop is idle. `Limiter` is the adjustable semaphore
that enforces the cap. With slow real endpoints the loop is idle, so the cap sits at its
maximum and changes nothing.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class LagGovernor:
    target_s: float = 0.02
    """Lag above this shrinks the cap (multiplicatively)."""
    min_cap: int = 16
    max_cap: int = 4096
    cap: int = 64
    """Current cap; starts low and grows while the loop keeps up."""
    shrink: float = 0.7
    """Multiplier applied when lag is over target."""
    grow: float = 1.1
    """Multiplier (at least +1) applied when lag is under half the target."""

    def observe(self, lag_s: float, inflight: int) -> int:
        """New cap from the worst lag of the last window and the requests in flight.
        Shrinks from what is actually in flight (a cap far above it limits nothing);
        grows only while the cap is what holds requests back."""
        if lag_s > self.target_s:
            self.cap = max(self.min_cap, int(min(self.cap, inflight) * self.shrink))
        elif lag_s < self.target_s / 2 and inflight >= self.cap * 0.9:
            self.cap = min(self.max_cap, max(self.cap + 1, int(self.cap * self.grow)))
        return self.cap


class Limiter:
    """A semaphore whose limit can change while it is in use (FIFO, cancellation-safe)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.inflight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if self.inflight < self.limit and not self._waiters:
            self.inflight += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # we were granted a slot just as we were cancelled
            elif fut in self._waiters:  # `_wake` may have dropped it already (cancelled)
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        self.inflight -= 1
        self._wake()

    def set_limit(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.inflight < self.limit:
            fut = self._waiters.popleft()
            if not fut.done():
                self.inflight += 1
                fut.set_result(None)


__all__ = ["LagGovernor", "Limiter"]
