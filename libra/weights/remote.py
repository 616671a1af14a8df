"""A broadcast's sender in another process: its calls over HTTP.

    # the trainer's process: its tensors, served for the time of one update
    async with serve_sender(LocalSender(lambda: model.state_dict()), host="10.0.0.5") as url:
        await client.update_weights(version, sender=url)   # libra serve-rollout drives it

    # libra serve-rollout: a BroadcastSync whose sender is that URL
    sync = BroadcastSync(sender=RemoteSender(url), pool=pool, kind="vllm", ...)

`serve_sender` answers the five `Sender` calls of `libra.weights.broadcast` for any
sender (`libra.transfer.local.LocalSender` holds a process's own tensors); the gloo
traffic itself goes from the sender's process straight to the engines, on `host`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from libra.errors import EndpointDown
from libra.weights.broadcast import Sender

ROUTES = ("metas", "listen", "join", "send", "close")


class RemoteSender:
    """`Sender` calls to a `serve_sender` at `url`."""

    def __init__(self, url: str, session: aiohttp.ClientSession, timeout_s: float = 300.0):
        self.url = url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _post(self, route: str, body: dict[str, Any]) -> Any:
        """A failed call is an `EndpointDown` naming the sender (the update cannot go on
        for the engine being served)."""
        try:
            async with self.session.post(f"{self.url}/{route}", json=body,
                                         timeout=self.timeout) as r:  # fmt: skip
                doc = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise EndpointDown(f"sender {self.url}: {type(e).__name__}: {e}", url=self.url) from e
        if r.status != 200:
            raise EndpointDown(f"sender {self.url}/{route}: HTTP {r.status}: {doc}", url=self.url)
        return doc

    async def broadcast_metas(self) -> Sequence[tuple[str, str, Sequence[int]]]:
        return [(str(n), str(d), list(s)) for n, d, s in (await self._post("metas", {}))["metas"]]

    async def broadcast_listen(self, gid: str, host: str, world: int, timeout_s: float) -> int:
        body = {"gid": gid, "host": host, "world": world, "timeout_s": timeout_s}
        return int((await self._post("listen", body))["port"])

    async def broadcast_join(self, gid: str) -> str | None:
        return (await self._post("join", {"gid": gid}))["error"]

    async def broadcast_send(self, gid: str, bucket_bytes: int) -> tuple[int, str | None]:
        doc = await self._post("send", {"gid": gid, "bucket_bytes": bucket_bytes})
        return int(doc["version"]), doc["error"]

    async def broadcast_close(self, gid: str) -> None:
        await self._post("close", {"gid": gid})


@contextlib.asynccontextmanager
async def serve_sender(sender: Sender, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Serve `sender`'s calls on a free port of `host` while the block runs; yields the
    URL to hand to the process that drives the update."""

    async def call(request: web.Request) -> web.Response:
        route = request.match_info["route"]
        body = await request.json()
        if route == "metas":
            metas = await sender.broadcast_metas()
            return web.json_response({"metas": [[n, d, list(s)] for n, d, s in metas]})
        if route == "listen":
            gid, host_, world = str(body["gid"]), str(body["host"]), int(body["world"])
            port = await sender.broadcast_listen(gid, host_, world, float(body["timeout_s"]))
            return web.json_response({"port": port})
        if route == "join":
            return web.json_response({"error": await sender.broadcast_join(str(body["gid"]))})
        if route == "send":
            version, error = await sender.broadcast_send(str(body["gid"]),
                                                         int(body["bucket_bytes"]))  # fmt: skip
            return web.json_response({"version": version, "error": error})
        await sender.broadcast_close(str(body["gid"]))
        return web.json_response({})

    app = web.Application()
    app.router.add_post(f"/{{route:{'|'.join(ROUTES)}}}", call)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, 0)
        await site.start()
        port = runner.addresses[0][1]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


__all__ = ["RemoteSender", "serve_sender"]
