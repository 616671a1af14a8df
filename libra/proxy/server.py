"""The proxy's HTTP side: one aiohttp server on loopback for all episodes of a runner.

    POST {url}/episodes/{key}/v1/chat/completions    a model turn of episode `key`
    GET  {url}/episodes/{key}/v1/models              the one model name it serves

`key` is the episode id made URL-safe plus a random suffix, so ids such as `b/q3/0` stay
readable in logs and one episode cannot reach another's conversation. Every call needs
`Authorization: Bearer <token>` (the runner gives each episode's client that token), so
other processes on the machine cannot inject turns. Errors use OpenAI's error body.

`dispatch` is the whole API, independent of the transport: the aiohttp server serves it
to any HTTP client (another library, a subprocess agent given the base URL), and
`InProcessTransport` serves it to the `openai` client the runner hands each episode
without a socket — same requests, same answers, no loopback HTTP on either side.
"""

from __future__ import annotations

import re
import secrets
import socket
from typing import Any

import orjson
from aiohttp import web

from libra.auth import bearer_matches
from libra.proxy import protocol
from libra.proxy.protocol import ProxyError
from libra.proxy.session import Session

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_PATH = re.compile(r"^/episodes/([^/]+)/v1/(chat/completions|models)$")
MODEL_NAME = "libra-policy"
JSON = "application/json"


class ProxyServer:
    """`async with ProxyServer() as srv`: `srv.open(id, session) -> (key, base_url)`,
    `srv.close(key)`."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.token = secrets.token_urlsafe(24)
        self.url = ""
        self.sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> ProxyServer:
        app = web.Application(client_max_size=256 * 1024**2)
        app.router.add_route("*", "/{path:.*}", self._serve)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        site = web.SockSite(self._runner, sock, backlog=1024)
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

    async def dispatch(
        self, method: str, path: str, auth: str | None, body: bytes
    ) -> tuple[int, str, bytes]:
        """One API call: (HTTP status, content type, body)."""
        try:
            if not bearer_matches(auth, self.token):
                raise ProxyError(401, "missing or wrong API key for this Libra proxy",
                                 "invalid_api_key", "authentication_error")  # fmt: skip
            m = _PATH.match(path)
            if m is None:
                raise ProxyError(404, f"no such endpoint {path!r}; the API is at "
                                 "/episodes/{key}/v1/chat/completions", "not_found")  # fmt: skip
            session = self.sessions.get(m.group(1))
            if session is None:
                raise ProxyError(404, f"no running episode {m.group(1)!r}", "episode_not_found")
            if m.group(2) == "models":
                return 200, JSON, orjson.dumps(protocol.models(MODEL_NAME))
            if method != "POST":
                raise ProxyError(405, "chat completions take POST", "method_not_allowed")
            limit = session.sh.max_body
            if limit is not None and len(body) > limit:
                await session.refuse_oversize(len(body))
            try:
                doc = orjson.loads(body)
            except orjson.JSONDecodeError as e:
                raise protocol.bad_request(f"the request body is not JSON: {e}") from None
            req = protocol.parse_request(doc)
            reply = await session.chat(req)
        except ProxyError as e:
            return e.status, JSON, orjson.dumps(e.body())
        if req.stream:  # a finished turn: all events at once
            return 200, "text/event-stream", b"".join(protocol.stream_events(req, reply))
        return 200, JSON, orjson.dumps(protocol.completion(req, reply))

    async def _serve(self, request: web.Request) -> web.Response:
        status, kind, body = await self.dispatch(
            request.method, request.path, request.headers.get("Authorization"),
            await request.read(),
        )  # fmt: skip
        return web.Response(body=body, status=status, content_type=kind)


def in_process_transport(httpx: Any, server: ProxyServer) -> Any:
    """An httpx transport that hands requests straight to `server.dispatch`. Its
    `aclose` does nothing: one instance serves every episode's client, and an agent that
    closes its client (`async with client:`) closes only its own."""

    class InProcessTransport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: Any) -> Any:
            body = await request.aread()
            status, kind, content = await server.dispatch(
                request.method, request.url.path, request.headers.get("authorization"), body
            )
            return httpx.Response(status, headers={"content-type": kind}, content=content)

        async def aclose(self) -> None:
            return None

    return InProcessTransport()


__all__ = ["MODEL_NAME", "ProxyServer", "in_process_transport"]
