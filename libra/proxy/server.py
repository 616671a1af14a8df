"""The proxy's HTTP side: one aiohttp server on loopback for all episodes of a runner.

    POST {url}/episodes/{key}/v1/chat/completions    a model turn of episode `key`
    GET  {url}/episodes/{key}/v1/models              the one model name it serves

`key` is the episode id made URL-safe plus a random suffix, so ids such as `b/q3/0` stay
readable in logs and one episode cannot reach another's conversation. Every call needs
`Authorization: Bearer <token>` (the runner gives each episode's client that token), so
other processes on the machine cannot inject turns. Errors use OpenAI's error body.
"""

from __future__ import annotations

import re
import secrets
import socket
from typing import Any

import orjson
from aiohttp import web

from libra.proxy import protocol
from libra.proxy.protocol import ProxyError
from libra.proxy.session import Session

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MODEL_NAME = "libra-policy"


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(doc), status=status, content_type="application/json")


class ProxyServer:
    """`async with ProxyServer() as srv`: `srv.open(id, session) -> base_url`, `srv.close(key)`."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.token = secrets.token_urlsafe(24)
        self.url = ""
        self.sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> ProxyServer:
        app = web.Application(client_max_size=256 * 1024**2)
        app.router.add_post("/episodes/{key}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{key}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        site = web.SockSite(self._runner, sock)
        await site.start()
        self.url = f"http://{self.host}:{sock.getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, episode_id: str, session: Session) -> tuple[str, str]:
        """Serve `session`; returns (key, base URL for an OpenAI client)."""
        key = f"{_UNSAFE.sub('_', episode_id)[:80]}.{secrets.token_hex(6)}"
        self.sessions[key] = session
        return key, f"{self.url}/episodes/{key}/v1"

    def close(self, key: str) -> None:
        session = self.sessions.pop(key, None)
        if session is not None:
            session.close()

    def _session(self, request: web.Request) -> Session:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            raise ProxyError(401, "missing or wrong API key for this Libra proxy",
                             "invalid_api_key", "authentication_error")  # fmt: skip
        session = self.sessions.get(request.match_info["key"])
        if session is None:
            raise ProxyError(404, f"no running episode {request.match_info['key']!r}",
                             "episode_not_found")  # fmt: skip
        return session

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except ProxyError as e:
            return _json(e.body(), e.status)
        return _json(protocol.models(MODEL_NAME))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError as e:
                raise protocol.bad_request(f"the request body is not JSON: {e}") from None
            req = protocol.parse_request(body)
            reply = await session.chat(req)
        except ProxyError as e:
            return _json(e.body(), e.status)
        if not req.stream:
            return _json(protocol.completion(req, reply))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})  # fmt: skip
        await resp.prepare(request)
        for event in protocol.stream_events(req, reply):
            await resp.write(event)
        await resp.write_eof()
        return resp


__all__ = ["MODEL_NAME", "ProxyServer"]
