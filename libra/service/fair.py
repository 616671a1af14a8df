"""Fair admission across batches (pure: no asyncio, no I/O).

Several batches from several clients share one concurrency bound. When a slot frees,
`pop` admits the next episode of the batch with the fewest episodes running per unit of
its weight (default 1); ties go to the batch served least recently. A batch submitted
behind a 10,000-episode one therefore reaches its share of the slots as fast as slots
free up, and a batch alone uses all of them (weighted max-min fairness of in-flight
episodes, work-conserving): two busy batches of weights 3 and 1 hold 3/4 and 1/4 of the
slots, and neither waits for the other to finish. Within a batch, episodes run in submit
order (a GRPO group's samples stay together).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Pending items per batch, handed out fairly; tracks what each batch has running."""

    def __init__(self) -> None:
        self._pending: dict[str, deque[T]] = {}
        self._running: dict[str, int] = {}
        self._served_at: dict[str, int] = {}
        self._weight: dict[str, float] = {}
        self._tick = 0

    def push(self, batch: str, items: Iterable[T], weight: float = 1.0) -> None:
        """Queue items of `batch` (after those it already has); `weight` (> 0): its share
        of the slots against the other busy batches' (the first push of a batch sets it)."""
        if not weight > 0:
            raise ValueError(f"a batch's weight must be > 0, got {weight}")
        q = self._pending.setdefault(batch, deque())
        q.extend(items)
        self._running.setdefault(batch, 0)
        self._served_at.setdefault(batch, -1)
        self._weight.setdefault(batch, weight)

    def pop(self) -> tuple[str, T] | None:
        """The next item to admit and its batch (counted as running), or None."""
        best: str | None = None
        best_key = (0.0, 0)
        for batch, q in self._pending.items():
            if not q:
                continue
            key = (self._running[batch] / self._weight[batch], self._served_at[batch])
            if best is None or key < best_key:
                best, best_key = batch, key
        if best is None:
            return None
        self._tick += 1
        self._served_at[best] = self._tick
        self._running[best] += 1
        return best, self._pending[best].popleft()

    def release(self, batch: str) -> None:
        """An admitted item of `batch` finished."""
        self._running[batch] -= 1
        if self._running[batch] == 0 and not self._pending.get(batch):
            self._forget(batch)

    def drop(self, batch: str) -> list[T]:
        """Remove and return the items of `batch` not admitted yet (a cancel)."""
        items = list(self._pending.pop(batch, ()))
        if not self._running.get(batch):
            self._forget(batch)
        else:
            self._pending[batch] = deque()
        return items

    def pending(self, batch: str | None = None) -> int:
        if batch is not None:
            return len(self._pending.get(batch, ()))
        return sum(len(q) for q in self._pending.values())

    def running(self, batch: str | None = None) -> int:
        if batch is not None:
            return self._running.get(batch, 0)
        return sum(self._running.values())

    def _forget(self, batch: str) -> None:
        self._pending.pop(batch, None)
        self._running.pop(batch, None)
        self._served_at.pop(batch, None)
        self._weight.pop(batch, None)


__all__ = ["FairQueue"]
