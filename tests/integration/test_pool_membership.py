"""Endpoints joining and leaving a bucket while calls run (what `libra train` does when a
hybrid worker switches roles, and while it loads new weights into an engine)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from libra.chat import ChatTokenizer
from libra.endpoints.config import EndpointConfig
from libra.endpoints.pool import EndpointPool
from libra.errors import EndpointDown
from libra.routing.base import Bucket
from tests.conftest import free_port
from tests.fakes.vllm_fake import FakeVLLM

BUCKET = Bucket("tp1", 1, 4096)


@asynccontextmanager
async def fake(model: Path, delay: float) -> AsyncIterator[str]:
    runner = web.AppRunner(FakeVLLM(str(model), delay=delay).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def call(pool: EndpointPool, prompt: list[int]) -> str:
    served = await pool.generate("tp1", prompt, max_tokens=8, temperature=1.0, top_p=1.0)
    return served.endpoint.url


async def test_join_drain_and_leave_while_calls_run(tiny_model: Path) -> None:
    prompt = ChatTokenizer(tiny_model).encode("What is 2+3?")
    async with fake(tiny_model, 0.4) as a, fake(tiny_model, 0.0) as b:  # noqa: SIM117
        async with EndpointPool([(BUCKET, [a])], EndpointConfig()) as pool:
            running = asyncio.create_task(call(pool, prompt))
            await asyncio.sleep(0.1)  # the call is on `a` now
            joined = await pool.add_endpoint("tp1", b, version=3)
            assert joined.version == 3
            assert [e.url for e in pool.endpoints("tp1")] == [a, b]

            left = await pool.drain(a, timeout_s=10)
            assert left == 0  # drain waited for the call in flight on `a` ...
            assert running.done() and running.result() == a  # ... which finished there
            # `a` admits nothing now: every new call goes to `b`
            assert {await call(pool, prompt) for _ in range(4)} == {b}

            await pool.remove_endpoint(a)
            assert [e.url for e in pool.endpoints("tp1")] == [b]
            with pytest.raises(KeyError):
                pool.find(a)


async def test_a_paused_endpoint_holds_calls_until_it_resumes(tiny_model: Path) -> None:
    prompt = ChatTokenizer(tiny_model).encode("What is 2+3?")
    async with fake(tiny_model, 0.0) as a, EndpointPool([(BUCKET, [a])]) as pool:
        await pool.set_admitting(a, False)  # e.g. while new weights load
        waiting = asyncio.create_task(call(pool, prompt))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await pool.set_admitting(a, True)
        assert await asyncio.wait_for(waiting, 10) == a


async def test_a_server_that_does_not_answer_cannot_join(tiny_model: Path) -> None:
    async with fake(tiny_model, 0.0) as a, EndpointPool([(BUCKET, [a])]) as pool:
        with pytest.raises(EndpointDown, match="cannot join bucket 'tp1'"):
            await pool.add_endpoint("tp1", f"http://127.0.0.1:{free_port()}")
        assert [e.url for e in pool.endpoints("tp1")] == [a]
