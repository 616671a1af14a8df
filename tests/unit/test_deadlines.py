"""Timeout scopes on one timer (libra.rollout.deadlines) behave as asyncio.timeout."""

from __future__ import annotations

import asyncio

import pytest

from libra.rollout.deadlines import Deadlines


def test_expiry_raises_timeout_error_and_nested_scopes_pick_the_one_that_expired() -> None:
    d = Deadlines()

    async def main() -> list[str]:
        seen = []
        async with d.timeout(30):  # outer, far away
            with pytest.raises(TimeoutError):
                async with d.timeout(0.01):
                    await asyncio.sleep(30)
            seen.append("inner expired, outer still open")
        # the outer expires while the inner is open
        with pytest.raises(TimeoutError):
            async with d.timeout(0.01), d.timeout(30):
                await asyncio.sleep(30)
        seen.append("outer expired through the inner")
        async with d.timeout(None):  # never expires
            await asyncio.sleep(0)
        return seen

    assert asyncio.run(main()) == [
        "inner expired, outer still open",
        "outer expired through the inner",
    ]


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    d = Deadlines()

    async def victim() -> None:
        async with d.timeout(30):
            await asyncio.sleep(30)

    async def main() -> None:
        t = asyncio.create_task(victim())
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(main())


def test_exited_scopes_do_not_pile_up() -> None:
    d = Deadlines()

    async def main() -> int:
        for _ in range(10_000):
            async with d.timeout(600):
                pass
        return len(d._heap)

    assert asyncio.run(main()) <= 130  # exited scopes are dropped, not kept for 600 s


def test_many_scopes_expire_in_deadline_order() -> None:
    d = Deadlines()
    order: list[int] = []

    async def one(i: int, delay: float) -> None:
        try:
            async with d.timeout(delay):
                await asyncio.sleep(30)
        except TimeoutError:
            order.append(i)

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            for i, delay in enumerate([0.06, 0.02, 0.04]):
                tg.create_task(one(i, delay))

    asyncio.run(main())
    assert order == [1, 2, 0]
