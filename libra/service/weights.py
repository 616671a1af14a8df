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
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import aiohttp
import orjson

from libra.auth import is_loopback
from libra.endpoints.pool import Endpoint, EndpointPool
from libra.errors import ConfigError, EndpointDown, LibraError, WeightsNotDelivered
from libra.service.errors import RequestError

Kind = Literal["embedded", "vllm"]
KINDS: dict[str, Kind] = {"embedded": "embedded", "vllm": "vllm"}
OWNERS: dict[str, Kind] = {"libra": "embedded", "vllm": "vllm"}
"""`owned_by` of `/v1/models` -> endpoint kind, for `endpoint_kind = "auto"`."""


def weights_folder(path: str, dirs: Sequence[str], *, exposed: bool, local: bool) -> str:
    """The folder `POST /v1/weights` may hand the endpoints for a request's `path`, or a
    `RequestError` (403) naming the problem and the fix. A request's path is untrusted:
    with `weights_dirs` set it must be absolute and lie inside one of them, also once
    links are resolved when the service sees the endpoints' filesystem (`local`); the
    resolved path is what the endpoints get. Without `weights_dirs` any folder is taken
    on a loopback-only service (one machine, one user) and none on an exposed one."""
    if not dirs:
        if exposed:
            raise RequestError(
                403,
                "weight updates on a service reachable from other hosts need weights_dirs, "
                "the folders checkpoints may be loaded from: set weights_dirs = "
                '["/shared/ckpt"] in the config, or --weights-dir DIR',
            )
        return path
    if not os.path.isabs(path):
        raise RequestError(403, f"path {path!r} is not absolute; give the checkpoint's "
                                f"absolute path inside weights_dirs {list(dirs)}")  # fmt: skip
    lexical = os.path.normpath(path)
    candidates = [(lexical, [os.path.normpath(d) for d in dirs])]
    if local:
        candidates.append((os.path.realpath(path), [os.path.realpath(d) for d in dirs]))
    for p, roots in candidates:
        if not any(os.path.commonpath([p, r]) == r for r in roots):
            what = "" if p == lexical else f" (it resolves to {p!r})"
            raise RequestError(403, f"path {path!r}{what} is outside weights_dirs "
                                    f"{list(dirs)}: publish checkpoints inside one of them "
                                    "or add its folder to weights_dirs")  # fmt: skip
    return candidates[-1][0]


def checkpoint_here(path: str, folder: str) -> None:
    """A 400 naming what is missing unless `folder` (a request's `path`, checked by
    `weights_folder`) holds a checkpoint: asked before any endpoint is touched, where
    the service sees the endpoints' filesystem (`check_weights_locally`)."""
    from libra.engine.weights import not_a_checkpoint

    why = not_a_checkpoint(Path(folder))
    if why is not None:
        raise RequestError(400, f"path {path!r} is not a checkpoint ({why}): give a folder "
                                "with config.json and *.safetensors, as save_pretrained "
                                "writes it; no endpoint was touched")  # fmt: skip


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
    pool: EndpointPool,
    kind: str,
    version: int,
    path: str,
    *,
    check_local: bool = True,
    only: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Load `path` everywhere (or into the endpoints `only` names); returns {url:
    {"status": ok|error|skipped, ...}}."""
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

    eps = [e for e in pool.endpoints() if only is None or e.url in only]
    results = await asyncio.gather(*(one(ep) for ep in eps))
    return {ep.url: r for ep, r in zip(eps, results, strict=True)}


def sender_url(url: str, peer: str | None, *, exposed: bool) -> str:
    """The broadcast sender a request names, or a `RequestError` (403): the service
    calls it and the engines connect to its host, so it must run on the requesting
    host (or on loopback, for a service that is itself loopback-only)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError:  # a malformed [IPv6] host, or a port out of range / not a number
        parts, host, port = urlsplit(""), "", None
    if parts.scheme != "http" or not host or port is None:
        raise RequestError(400, f"sender {url!r} is not an http://HOST:PORT URL "
                                "(libra.weights.remote.serve_sender gives one)")  # fmt: skip
    if host == peer or (not exposed and is_loopback(host)):
        return url
    raise RequestError(403, f"sender {url!r} is not on the requesting host ({peer}): "
                            "run the sender in the process that asks for the update, on "
                            "an address of its host this service can reach")  # fmt: skip


async def broadcast_all(
    pool: EndpointPool,
    kind: str,
    version: int,
    sender: str,
    ranks: dict[str, int],
) -> dict[str, Any]:
    """Broadcast the sender's tensors into every healthy endpoint, one at a time
    (`libra.weights.BroadcastSync`); an endpoint whose transfer fails leaves the pool
    (its weights may be half new). Returns {url: {"status": ok|error|skipped, ...}}."""
    from urllib.parse import urlsplit

    from libra.weights import BroadcastSync, Weights
    from libra.weights.broadcast import DEFAULT_TIMEOUT_S as timeout_s
    from libra.weights.remote import RemoteSender

    out: dict[str, Any] = {}
    kinds: dict[Kind, list[str]] = {}
    for ep in pool.endpoints():
        if not ep.healthy:
            out[ep.url] = {"status": "skipped", "error": "endpoint is down; it keeps its version"}
            continue
        try:
            k = KINDS[kind] if kind != "auto" else await detect_kind(pool.session, ep.url)
        except (LibraError, aiohttp.ClientError, TimeoutError, OSError) as e:
            out[ep.url] = {"status": "error", "error": f"{type(e).__name__}: {e}"}
            continue
        kinds.setdefault(k, []).append(ep.url)
    host = urlsplit(sender).hostname or ""
    async with aiohttp.ClientSession() as session:
        remote = RemoteSender(sender, session, timeout_s=timeout_s + 60)
        try:
            await remote.broadcast_metas()  # reachable, and it has tensors to send
        except EndpointDown as e:
            raise RequestError(502, f"{e}: start the sender (serve_sender) on an address "
                                    "this service can reach, and keep it up") from None  # fmt: skip
        for k, urls in kinds.items():
            sync = BroadcastSync(
                sender=remote, pool=pool, kind=k, origin=Weights(-1, ""), host=host,
                ranks=ranks if k == "vllm" else {}, timeout_s=timeout_s,
            )  # fmt: skip
            try:
                await sync.publish(version, only=urls)
            except WeightsNotDelivered:
                pass  # in sync.lost
            finally:
                await sync.close()
            lost = dict(sync.lost)
            for url in urls:
                ok = {"status": "ok", "kind": k, "version": version}
                bad = {"status": "error", "error": lost.get(url), "left_pool": True}
                out[url] = bad if url in lost else ok
    return out


__all__ = [
    "broadcast_all",
    "checkpoint_here",
    "detect_kind",
    "sender_url",
    "update_all",
    "weights_folder",
]
