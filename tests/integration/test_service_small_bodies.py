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
