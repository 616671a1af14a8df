"""Threads for user code and tokenizing are started before episodes need them: a
`submit` that must start a thread waits, on the event loop, until the new thread runs,
which under GIL contention took up to 100 ms per thread (issue 14, item 2)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from libra.usercode import start_threads


def test_start_threads_starts_them_all_so_later_submits_start_none() -> None:
    ex = ThreadPoolExecutor(4)
    try:
        start_threads(ex, 4)
        before = {t.ident for t in threading.enumerate()}
        barrier = threading.Barrier(4)
        jobs = [ex.submit(barrier.wait, 10) for _ in range(4)]  # 4 at once: all threads
        for job in jobs:
            job.result()
        assert {t.ident for t in threading.enumerate()} == before  # none started for them
    finally:
        ex.shutdown()


def test_runners_opening_at_once_start_the_user_threads_once(monkeypatch) -> None:
    """Two runners that open side by side (a rollout worker's training and validation
    batches) share one start: two starts at once each held part of the pool at their
    barrier until both gave up, 30 s later."""
    import time

    from libra import usercode

    calls: list[int] = []

    def slow_start(executor: ThreadPoolExecutor, n: int, **kw: object) -> None:
        calls.append(n)
        time.sleep(0.2)  # the first start is still under way when the others come

    monkeypatch.setattr(usercode, "start_threads", slow_start)
    monkeypatch.setattr(usercode, "_prestarted", threading.Event())
    openers = [threading.Thread(target=usercode.prestart) for _ in range(3)]
    for t in openers:
        t.start()
    for t in openers:
        t.join()
    assert calls == [usercode.THREADS]


async def test_calls_stuck_past_their_limits_do_not_take_every_thread() -> None:
    """A service whose env hung THREADS calls over its life ran no plain-function hook of
    any env again: each call waited for a thread that never came, until its limit."""
    import asyncio
    import threading
    import time

    from libra import usercode

    release = threading.Event()

    def hang() -> None:
        release.wait(60)

    try:
        hung = [asyncio.ensure_future(usercode.call(hang, limit_s=0.2, what="hang"))
                for _ in range(usercode.THREADS)]  # fmt: skip
        for h in hung:
            with pytest.raises(usercode.LimitExceeded):
                await h
        t0 = time.monotonic()
        assert await usercode.call(lambda: "fine", limit_s=5, what="after") == "fine"
        assert time.monotonic() - t0 < 2  # not a wait for a thread to come free
    finally:
        release.set()


async def test_async_code_that_blocks_the_loop_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """An `async def` tool that calls `time.sleep` holds the loop: its limit cannot act,
    and it finished as `ok` with nothing said."""
    import time

    from libra import usercode

    async def sleepy() -> str:
        time.sleep(0.5)
        return "done"

    assert await usercode.call(sleepy, limit_s=0.1, what="tool sleepy") == "done"
    assert "async user code tool sleepy took" in caplog.text
    assert "held the event loop" in caplog.text
