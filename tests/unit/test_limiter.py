"""The endpoints' resizable semaphore under cancellation (issue 14: cancelling a big
batch turned episodes waiting for an endpoint slot into `error`s)."""

from __future__ import annotations

import asyncio

import pytest

from libra.endpoints.governor import Limiter


async def test_a_waiter_cancelled_just_before_a_release_leaves_cleanly() -> None:
    limiter = Limiter(1)
    await limiter.acquire()
    waiter = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0)  # it waits for the slot
    waiter.cancel()  # cancelled ...
    limiter.release()  # ... and, before it runs again, a slot frees
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert limiter.inflight == 0
    await asyncio.wait_for(limiter.acquire(), 1)  # the slot is free for the next one
    assert limiter.inflight == 1


async def test_cancelled_waiters_do_not_leak_slots() -> None:
    limiter = Limiter(2)
    await limiter.acquire()
    await limiter.acquire()
    waiters = [asyncio.create_task(limiter.acquire()) for _ in range(10)]
    await asyncio.sleep(0)
    for w in waiters[:5]:
        w.cancel()
    limiter.release()
    limiter.release()
    await asyncio.sleep(0)
    # The two freed slots went to live waiters, not to cancelled ones.
    assert sum(w.done() and not w.cancelled() for w in waiters[5:]) == 2
    assert limiter.inflight == 2
    for w in waiters:
        w.cancel()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)
