"""The bearer-token check of the service and of the agent proxy, over real loopback HTTP:
the scheme is case-insensitive, and a header that is not UTF-8 is a 401, not a 500."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from libra.proxy.server import ProxyServer
from libra.service.app import auth_middleware, error_middleware
from tests.integration.service_util import serving

TOKEN = "s3cret-token"


async def raw_get(port: int, path: str, auth: bytes | None) -> tuple[int, bytes]:
    """One HTTP/1.1 GET with the Authorization header's bytes exactly as given."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"GET %b HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" % path.encode()
    if auth is not None:
        head += b"Authorization: " + auth + b"\r\n"
    writer.write(head + b"\r\n")
    await writer.drain()
    data = await reader.read()
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


@pytest.fixture
async def service_port() -> AsyncIterator[int]:
    """The service's real middlewares in front of one route."""

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[error_middleware, auth_middleware(TOKEN)])
    app.router.add_get("/v1/rollouts/x", hello)
    async with serving(app) as port:
        yield port


@pytest.mark.parametrize(
    ("auth", "status"),
    [
        (b"Bearer " + TOKEN.encode(), 200),
        (b"bearer " + TOKEN.encode(), 200),  # the scheme is case-insensitive
        (b"BEARER  " + TOKEN.encode(), 200),
        (b"Bearer \xff\xfe" + TOKEN.encode(), 401),  # not UTF-8: refused, not a crash
        (b"\xc3\x28 " + TOKEN.encode(), 401),
        (b"Basic " + TOKEN.encode(), 401),
        (b"Bearer wrong", 401),
        (None, 401),
    ],
)
async def test_service_token_check(service_port: int, auth: bytes | None, status: int) -> None:
    got, body = await raw_get(service_port, "/v1/rollouts/x", auth)
    assert got == status, body
    if status == 401:
        assert b"bearer token" in orjson.loads(body)["error"].encode()


async def test_proxy_token_check_matches_the_service() -> None:
    async with ProxyServer() as proxy:
        port = int(proxy.url.rsplit(":", 1)[1])
        path = "/episodes/none/v1/models"
        # The right token in any case reaches the routing (no such episode: 404).
        for scheme in (b"Bearer ", b"bearer "):
            got, body = await raw_get(port, path, scheme + proxy.token.encode())
            assert got == 404 and b"episode_not_found" in body, body
        for auth in (b"Bearer \xff" + proxy.token.encode(), b"Bearer nope", None):
            got, body = await raw_get(port, path, auth)
            assert got == 401 and b"invalid_api_key" in body, (auth, body)
