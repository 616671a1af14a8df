"""Timeout scopes for thousands of episodes on one timer.

`asyncio.timeout` arms a timer per scope: with uvloop that is six objects the garbage
collector tracks (the Timeout, its TimerHandle and libuv timer, a copied contextvars
Context, two bound methods) for as long as the scope is open. An episode holds two
(episode ⊃ turn), so at 10,000 in flight that is 120,000 objects every full collection
walks. `Deadlines` keeps its open scopes in one heap with one timer armed for the
earliest: a scope is one small object. Semantics are `asyncio.timeout`'s: on expiry the
task is cancelled and the scope that expired turns the `CancelledError` into
`TimeoutError`; a cancellation from elsewhere passes through; scopes nest.
"""

from __future__ import annotations

import asyncio
import heapq
from types import TracebackType


class Deadlines:
    """Many timeout scopes, one timer. Use from one event loop at a time."""

    def __init__(self) -> None:
        self._heap: list[Deadline] = []
        self._dead = 0  # exited scopes still in the heap (dropped lazily)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._loop: asyncio.AbstractEventLoop | None = None

    def timeout(self, delay: float | None) -> Deadline:
        """A scope that expires `delay` seconds after it is entered (None: never)."""
        return Deadline(self, delay)

    def _add(self, scope: Deadline) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop: the old one's timer is gone with it
            self._loop, self._timer, self._timer_at = loop, None, float("inf")
            self._heap, self._dead = [], 0
        scope.when = loop.time() + scope.delay  # type: ignore[operator]
        heapq.heappush(self._heap, scope)
        if scope.when < self._timer_at:
            self._arm(loop)

    def _drop(self) -> None:
        """An open scope exited: forget it once exited ones are a quarter of the heap."""
        self._dead += 1
        if self._dead > 64 and self._dead * 4 > len(self._heap):
            self._heap = [s for s in self._heap if s.task is not None]
            heapq.heapify(self._heap)
            self._dead = 0

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, float("inf")
        while self._heap and self._heap[0].task is None:  # exited
            heapq.heappop(self._heap)
            self._dead -= 1
        if self._heap:
            self._timer_at = self._heap[0].when
            self._timer = loop.call_at(self._timer_at, self._fire)

    def _fire(self) -> None:
        loop = self._loop
        assert loop is not None
        self._timer, self._timer_at = None, float("inf")
        now = loop.time()
        while self._heap and self._heap[0].when <= now:
            scope = heapq.heappop(self._heap)
            if scope.task is None:
                self._dead -= 1
            else:
                scope.expire()
        self._arm(loop)


class Deadline:
    """One open scope of `Deadlines` (`async with deadlines.timeout(s):`)."""

    __slots__ = ("_owner", "cancelling", "delay", "expired", "task", "when")

    def __init__(self, owner: Deadlines, delay: float | None) -> None:
        self._owner = owner
        self.delay = delay
        self.when = 0.0
        self.task: asyncio.Task[object] | None = None
        """The task the scope guards; None once it exited (or before it opened)."""
        self.expired = False
        self.cancelling = 0

    def __lt__(self, other: Deadline) -> bool:
        return self.when < other.when

    async def __aenter__(self) -> Deadline:
        if self.delay is None:
            return self
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a timeout scope must be used inside a task")
        self.task = task
        self.cancelling = task.cancelling()
        self._owner._add(self)
        return self

    def expire(self) -> None:
        assert self.task is not None
        self.expired = True
        self.task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, self.task = self.task, None
        if task is None:
            return
        if not self.expired:
            self._owner._drop()
            return
        # As asyncio.timeout: this scope's cancellation becomes TimeoutError unless
        # someone else also asked to cancel the task.
        if task.uncancel() <= self.cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc


__all__ = ["Deadline", "Deadlines"]
