"""The small requests of `libra serve-rollout` (`POST /v1/weights`) take at most 64 KB
(`SMALL_BODY`), over real loopback HTTP: a body declared or sent past that is a 413 as
soon as that is known. The service read the whole body first, up to `max_request_mb`
(64 MB by default) per request, and a client that declared a large body and sent it
slowly held the request that long."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from libra.service.app import SMALL_BODY, _body, error_middleware
from libra.service.config import WeightsRequest
from tests.integration.service_util import serving


@pytest.fixture
async def port() -> AsyncIterator[int]:
    """The service's error middleware and body reader in front of one route."""

    async def weights(request: web.Request) -> web.Response:
        req = await _body(request, WeightsRequest)
        return web.json_response({"version": req.version})

    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 2**20)
    app.router.add_post("/v1/weights", weights)
    async with serving(app) as port:
        yield port


async def exchange(port: int, head: bytes, body: bytes) -> tuple[int, dict]:
    """Send `head` and `body` and read the response, without sending anything more."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b"\r\n" + body)
    await writer.drain()
    try:
        status_line = await asyncio.wait_for(reader.readline(), 20)
        rest = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        length = int(next(
            line.split(b":")[1] for line in rest.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ))  # fmt: skip
        doc = orjson.loads(await asyncio.wait_for(reader.readexactly(length), 20))
    finally:
        writer.close()
    return int(status_line.split(b" ")[1]), doc


async def test_a_body_declared_too_big_is_refused_before_it_is_sent(port: int) -> None:
    head = (b"POST /v1/weights HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 50000000\r\n")  # fmt: skip
    status, doc = await exchange(port, head, b'{"version": 1, ')  # the rest never comes
    assert status == 413
    assert "50000000 bytes" in doc["error"] and str(SMALL_BODY) in doc["error"]


async def test_a_chunked_body_is_refused_at_the_limit_and_a_small_one_served(port: int) -> None:
    head = (b"POST /v1/weights HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n")  # fmt: skip

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(data), data)

    big = b'{"version": 1, "path": "' + b"a" * (SMALL_BODY + 10)
    status, doc = await exchange(port, head, chunk(big))  # no last chunk: it never ends
    assert status == 413 and str(SMALL_BODY) in doc["error"]
    small = b'{"version": 3, "path": "/ckpt"}'
    status, doc = await exchange(port, head, chunk(small) + b"0\r\n\r\n")
    assert (status, doc) == (200, {"version": 3})


async def test_connections_past_the_cap_are_closed_without_a_traceback() -> None:
    """`cap_connections` closed a connection past the cap inside `connection_made`; the
    handler's task then failed on an assertion, a 7-line "Task exception was never
    retrieved" in the log for every connection refused (no token needed to cause it)."""
    import gc

    from libra.service.server import cap_connections

    app = web.Application()

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/healthz", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    cap_connections(runner.server, 4)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    loop = asyncio.get_running_loop()
    failures: list[dict] = []
    loop.set_exception_handler(lambda _, ctx: failures.append(ctx))
    try:
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(10)]
        ended = 0
        for reader, _ in conns:
            try:
                ended += await asyncio.wait_for(reader.read(1), 1.0) == b""
            except TimeoutError:
                pass  # held open: one of the four served
        assert ended == 6
        for _, writer in conns:
            writer.close()
        await asyncio.sleep(0.2)
        gc.collect()  # an unretrieved task exception is reported when it is collected
        await asyncio.sleep(0)
        assert failures == []
    finally:
        loop.set_exception_handler(None)
        await runner.cleanup()


async def test_a_body_that_stops_coming_is_a_408_and_its_connection_closed(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Headers and a few bytes of the body, then nothing: the connection was held for
    ever (the headers' idle timer does not cover a body), and enough of them took every
    connection the service serves."""
    from libra.service import app

    monkeypatch.setattr(app, "BODY_IDLE_S", 0.5)
    head = (b"POST /v1/weights HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n")  # fmt: skip
    status, doc = await exchange(port, head, b'{"ver')
    assert status == 408 and "did not arrive in time (5 bytes in" in doc["error"]
