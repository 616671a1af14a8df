"""The HTTP API of `libra serve-rollout` (DESIGN.md), on aiohttp.

| method | path                                        |                                    |
|--------|---------------------------------------------|------------------------------------|
| POST   | /v1/rollouts                                | submit (idempotent by `batch_id`)  |
| GET    | /v1/rollouts/{id}/trajectories?after=&unit= | NDJSON stream from a cursor        |
| GET    | /v1/rollouts/{id}                           | status: counts by state            |
| DELETE | /v1/rollouts/{id}                           | cancel                             |
| POST   | /v1/weights                                 | load a checkpoint, stamp its version |
| GET    | /healthz                                    | liveness (no token needed)         |
| GET    | /metrics                                    | Prometheus text                    |

Every error is JSON `{"error": "..."}` with a 4xx/5xx status and a reason that names the
fix. With a token, every call but `/healthz` needs `Authorization: Bearer TOKEN`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from aiohttp import web

from libra.auth import bearer_matches, is_loopback, page_refusal
from libra.config import Config
from libra.endpoints.pool import EndpointPool
from libra.rollout.supervise import EngineWatch
from libra.service.batch import Batch
from libra.service.config import ServiceConfig, WeightsRequest
from libra.service.errors import RequestError
from libra.service.intake import CHILDREN, parse_body, parse_submit
from libra.service.manager import BatchManager
from libra.service.metrics import render
from libra.service.stream import episode_chunks, group_chunks
from libra.service.weights import (
    broadcast_all,
    checkpoint_here,
    sender_url,
    update_all,
    weights_folder,
)

log = logging.getLogger("libra.service")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
M = TypeVar("M", bound=Config)
MANAGER = web.AppKey("manager", BatchManager)
POOL = web.AppKey("pool", EndpointPool)
CONFIG = web.AppKey("config", ServiceConfig)
WATCH = web.AppKey("watch", EngineWatch)
INTAKE = web.AppKey("intake", asyncio.Semaphore)
"""Bounds the child processes that check large submit bodies (`intake.CHILDREN`)."""


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(doc), status=status, content_type="application/json")


def _error(status: int, message: str, **headers: str) -> web.Response:
    resp = _json({"error": message}, status)
    resp.headers.update(headers)
    return resp


def auth_middleware(token: str | None) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        # Without a token the service binds loopback only (`ServiceConfig`).
        refused = page_refusal(request.headers.get("Origin"), request.headers.get("Host"),
                               loopback_only=not token)  # fmt: skip
        if refused is not None:
            return _error(403, refused)
        if token and request.path != "/healthz":
            header = request.headers.get("Authorization", "")
            if not bearer_matches(header, token):
                why = "wrong bearer token" if header else "missing bearer token"
                return _error(
                    401, f"{why}: send the header `Authorization: Bearer TOKEN` with the "
                    "service's token (--token / LIBRA_TOKEN)",
                    **{"WWW-Authenticate": 'Bearer realm="libra"'},
                )  # fmt: skip
        return await handler(request)

    return check


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        resp = _error(e.status, str(e))
        if e.close:
            resp.force_close()
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, f"{e.reason}: {request.method} {request.path}" + (
            f" ({e.text})" if e.text and e.text != f"{e.status}: {e.reason}" else ""))  # fmt: skip
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:
        if request.transport is not None and not request.transport.is_closing():
            raise  # not the client's connection that broke
        # The client left (a stream reader that disconnects, a body cut short): the
        # normal end of a stream, not an error worth a traceback in the log for every
        # reader. The response goes nowhere; aiohttp drops it quietly.
        log.debug("%s %s: the client left", request.method, request.path)
        return web.Response(status=499)
    except Exception as e:
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"internal error: {type(e).__name__}: {e}")


SMALL_BODY = 64 * 1024
"""Largest body of a request other than a submit (they carry a few fields)."""


BODY_IDLE_S = 15.0
"""A body that sends nothing for this long is given up: 408, connection closed (as
`libra.service.server.IDLE_S` does for headers). A client that sent its headers and a
few bytes of a body, then nothing, held its connection for ever, and enough of them
took every connection the service serves."""
BODY_MIN_RATE = 64 * 1024
"""Bytes a second a body must average past its first `BODY_IDLE_S` (a trickle of a byte
every few seconds is no faster than silence)."""


async def _read_body(request: web.Request, limit: int, what: str) -> bytes:
    """The body, refused as soon as it is known to be over `limit` bytes (`what` says
    what the limit is): a declared length past it before any of it is read, a chunked
    one at the first byte past it. Under `BODY_IDLE_S` between chunks and
    `BODY_MIN_RATE` in all, else a 408 that closes the connection."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise RequestError(413, f"the body is {declared} bytes; {request.method} "
                           f"{request.path} takes at most {what}")  # fmt: skip
    raw = bytearray()
    expect = declared if declared is not None else limit
    try:
        async with asyncio.timeout(BODY_IDLE_S + expect / BODY_MIN_RATE):
            while len(raw) <= limit:
                want = min(limit + 1 - len(raw), 1 << 20)
                chunk = await asyncio.wait_for(request.content.read(want), BODY_IDLE_S)
                if not chunk:
                    break
                raw += chunk
    except TimeoutError:
        raise RequestError(408, f"the body did not arrive in time ({len(raw)} bytes in; a "
                                f"body must not pause {BODY_IDLE_S:g} s nor average under "
                                f"{BODY_MIN_RATE} bytes/s)", close=True) from None  # fmt: skip
    if len(raw) > limit:
        raise RequestError(413, f"the body is over {limit} bytes; {request.method} "
                           f"{request.path} takes at most {what}")  # fmt: skip
    return bytes(raw)


async def _body(request: web.Request, model: type[M]) -> M:
    """A small request's body (at most `SMALL_BODY`: reading it whole first took up to
    `max_request_mb` per request)."""
    return parse_body(await _read_body(request, SMALL_BODY, str(SMALL_BODY)), model)


async def submit(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER]
    mb = request.app[CONFIG].max_request_mb
    raw = await _read_body(request, int(mb * 2**20), f"max_request_mb ({mb:g} MiB)")
    # Parsed off the event loop (libra.service.intake): a big body is slow to parse.
    req = await parse_submit(raw, request.app[CONFIG].max_task_kb * 1024, request.app[INTAKE])
    batch, created = await manager.submit(req)
    doc = {"batch_id": batch.id, "created": created, "episodes": batch.total}
    return _json(doc, 201 if created else 200)


async def status(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER]
    return _json(manager.status(await manager.get(request.match_info["batch_id"])))


async def cancel(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER]
    batch = await manager.cancel(request.match_info["batch_id"])
    return _json(manager.status(batch))


async def trajectories(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER]
    raw_after = request.query.get("after", "-1")
    try:
        after = int(raw_after)
    except ValueError:
        after = -2
    if after < -1:
        raise RequestError(
            400, f"after={raw_after!r}: give the last seq you received (an integer >= -1)"
        )
    unit = request.query.get("unit", "episode")
    if unit not in ("episode", "group"):
        raise RequestError(400, f"unit={unit!r}: expected 'episode' or 'group'")
    batch = await manager.hold(request.match_info["batch_id"])
    try:
        return await _stream(request, batch, after, unit)
    finally:
        manager.let_go(batch)


async def _stream(request: web.Request, batch: Batch, after: int, unit: str) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "application/x-ndjson",
            "Cache-Control": "no-store",
            "X-Libra-Episodes": str(batch.total),
        }
    )
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    chunks = episode_chunks(batch, after) if unit == "episode" else group_chunks(batch, after)
    send = asyncio.ensure_future(_send(resp, chunks))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({send, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not send.done():  # the client left while nothing new was to be sent
            send.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await send
    if not send.cancelled():
        send.result()  # what sending raised (a client that left mid-write: a quiet 499)
    return resp


async def _send(resp: web.StreamResponse, chunks: AsyncIterator[bytes]) -> None:
    async for chunk in chunks:
        await resp.write(chunk)  # waits while the client is slow: episodes go on
        # A client that keeps up never pauses the transport, so `write` never gave the
        # loop a turn: a finished batch's whole stream (56 MB of groups) went out in one
        # step of it, 4 such streams holding every other request for 0.66 s.
        await asyncio.sleep(0)
    await resp.write_eof()


GONE_POLL_S = 1.0
"""How often a stream waiting for records checks that its client is still there."""


async def _client_gone(request: web.Request) -> None:
    """Returns once the client's connection is closed. A stream waiting for the next
    record learnt it only when that record came (a batch whose episodes take minutes
    kept a reader that had left counted, and its finished batch in memory, that long)."""
    # aiohttp tells a handler of a lost connection only by cancelling it (off here: a
    # submit cut short must not leave its batch half made), so this polls.
    while request.transport is not None and not request.transport.is_closing():  # noqa: ASYNC110
        await asyncio.sleep(GONE_POLL_S)


async def weights(request: web.Request) -> web.StreamResponse:
    req = await _body(request, WeightsRequest)
    try:
        import libra.engine.weights  # noqa: F401
    except ImportError:
        raise RequestError(
            501, "weight updates need libra.engine.weights (not installed)"
        ) from None
    cfg = request.app[CONFIG]
    exposed = not is_loopback(cfg.host)
    if req.sender is not None:
        sender = sender_url(req.sender, request.remote, exposed=exposed)
        ranks = {b.name: b.tp for b in cfg.buckets}
        async with request.app[WATCH].lock:
            results = await broadcast_all(request.app[POOL], cfg.endpoint_kind, req.version,
                                          sender, ranks)  # fmt: skip
            return await _weights_done(request, req.version, {"sender": sender}, results, None)
    assert req.path is not None
    folder = await asyncio.to_thread(  # realpath touches the filesystem
        weights_folder, req.path, cfg.weights_dirs, exposed=exposed,
        local=cfg.check_weights_locally,
    )  # fmt: skip
    if cfg.check_weights_locally:
        await asyncio.to_thread(checkpoint_here, req.path, folder)
    async with request.app[WATCH].lock:
        results = await update_all(request.app[POOL], cfg.endpoint_kind, req.version, folder,
                                   check_local=cfg.check_weights_locally)  # fmt: skip
        return await _weights_done(request, req.version, {"path": req.path}, results, folder)


async def _weights_done(
    request: web.Request,
    version: int,
    source: dict[str, str],
    results: dict[str, Any],
    folder: str | None,
) -> web.StreamResponse:
    """Count the outcome, stamp the version where it loaded, tell the engine watch what
    a replacement must load (`folder`; None: a broadcast), answer (502: not everywhere).
    Called holding the watch's lock."""
    manager = request.app[MANAGER]
    ok = [u for u, r in results.items() if r["status"] == "ok"]
    for r in results.values():
        manager.metrics.weight_updates[r["status"]] += 1
    for url, r in results.items():
        if r.get("left_pool"):  # half-updated: a launched engine is replaced
            request.app[WATCH].condemn(url, f"version {version} failed halfway: {r['error']}")
    if ok:
        if manager.workers is not None:
            manager.workers.set_version(version, ok)
        await asyncio.to_thread(manager.set_version, version, folder)
        await request.app[WATCH].loaded(request.app[POOL], ok, version, folder)
    doc = {"version": version, **source, "endpoints": results}
    if len(ok) < len(results):
        doc["error"] = f"{len(results) - len(ok)} of {len(results)} endpoints did not load it"
        return _json(doc, 502)
    return _json(doc)


async def healthz(request: web.Request) -> web.StreamResponse:
    """Alive: 200. `degraded` while finished records cannot be written (a full disk):
    streams go on, no episode starts and submits are refused (507) until they are. It
    needs no token, so it gives the OS's reason only; the 507 and the log name the file."""
    manager = request.app[MANAGER]
    if manager.write_error is None:
        return _json({"status": "ok"})
    reason = f"finished records cannot be written: {manager.write_reason}"
    return _json({"status": "degraded", "spool": reason})


async def metrics(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER]
    text = render(manager.metrics, manager, request.app[POOL], request.app[WATCH])
    ctype = "text/plain; version=0.0.4; charset=utf-8"
    return web.Response(body=text.encode(), headers={"Content-Type": ctype})


def build_app(
    manager: BatchManager,
    pool: EndpointPool,
    config: ServiceConfig,
    watch: EngineWatch | None = None,
) -> web.Application:
    """The service's HTTP app; `watch`: the one keeping the launched engines serving
    (`open_pool`), which weight updates tell what they loaded."""
    app = web.Application(
        middlewares=[error_middleware, auth_middleware(config.token)],
        client_max_size=int(config.max_request_mb * 2**20),
    )
    app[MANAGER] = manager
    app[POOL] = pool
    app[CONFIG] = config
    app[WATCH] = watch or EngineWatch()
    app[INTAKE] = asyncio.Semaphore(CHILDREN)
    app.router.add_post("/v1/rollouts", submit)
    app.router.add_get("/v1/rollouts/{batch_id}/trajectories", trajectories)
    app.router.add_get("/v1/rollouts/{batch_id}", status)
    app.router.add_delete("/v1/rollouts/{batch_id}", cancel)
    app.router.add_post("/v1/weights", weights)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


__all__ = ["build_app"]
