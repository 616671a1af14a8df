"""`POST /v1/weights`: load a checkpoint into every endpoint, then stamp later turns.

Each healthy endpoint loads the folder through `libra.engine.weights.load_weights`
(embedded engine: its load endpoint; vLLM: pause, reload, reset prefix cache, resume),
and only after its load succeeded is its version set (`EndpointPool.set_version`), so
every turn records the version of the endpoint that served it. Endpoints that are down
or fail keep their old version and are reported; turns they serve later say so.
A turn already in flight on an endpoint while it loads is stamped with the old version
(the engines let it finish on the old weights, or run it on the new ones after the
swap); at most one turn per episode in flight is affected.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import aiohttp
import orjson

from libra.endpoints.pool import Endpoint, EndpointPool
from libra.errors import ConfigError, LibraError

Kind = Literal["embedded", "vllm"]
KINDS: dict[str, Kind] = {"embedded": "embedded", "vllm": "vllm"}
OWNERS: dict[str, Kind] = {"libra": "embedded", "vllm": "vllm"}
"""`owned_by` of `/v1/models` -> endpoint kind, for `endpoint_kind = "auto"`."""


async def detect_kind(session: aiohttp.ClientSession, url: str) -> Kind:
    async with session.get(f"{url}/v1/models") as r:
        doc = orjson.loads(await r.read())
    owner = ((doc.get("data") or [{}])[0]).get("owned_by")
    if owner not in OWNERS:
        raise ConfigError(
            f"cannot tell what serves {url} (owned_by={owner!r}); "
            "set endpoint_kind = 'embedded' or 'vllm' in the service config"
        )
    return OWNERS[owner]


async def update_all(
    pool: EndpointPool, kind: str, version: int, path: str, *, check_local: bool = True
) -> dict[str, Any]:
    """Load `path` everywhere; returns {url: {"status": ok|error|skipped, ...}}."""
    from libra.engine.weights import load_weights

    async def one(ep: Endpoint) -> dict[str, Any]:
        if not ep.healthy:
            return {"status": "skipped", "error": "endpoint is down; it keeps its version"}
        try:
            k = KINDS[kind] if kind != "auto" else await detect_kind(pool.session, ep.url)
            out = await load_weights(pool.session, ep.url, k, path, check_local=check_local)
        except (LibraError, aiohttp.ClientError, TimeoutError, OSError) as e:
            return {"status": "error", "error": f"{type(e).__name__}: {e}"}
        pool.set_version(version, [ep.url])
        return {"status": "ok", "kind": k, "version": version, "detail": out}

    eps = pool.endpoints()
    results = await asyncio.gather(*(one(ep) for ep in eps))
    return {ep.url: r for ep, r in zip(eps, results, strict=True)}


__all__ = ["detect_kind", "update_all"]
