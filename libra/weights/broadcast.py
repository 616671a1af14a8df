"""`BroadcastSync`: weights from the trainer's memory into each endpoint, no files.

Per endpoint, one gloo group (the trainer's sender as rank 0, the server's TP ranks
after it; `libra.transfer`), opened when the endpoint is attached and kept for the
run, so a server that dies breaks its own group only. A publication, endpoint by
endpoint (the others keep serving):

1. no new turn is sent to it; vLLM: its turns in flight finish, then
   `POST /pause?mode=wait`;
2. vLLM's weight-transfer phases (the embedded engine serves the same routes):
   `POST /start_weight_update`, then `POST /update_weights` with the tensors' names,
   dtypes and shapes while the sender broadcasts them bucket by bucket, then
   `POST /finish_weight_update`; vLLM: `POST /reset_prefix_cache`, `POST /resume`;
3. its version becomes `version`; it admits turns again.

An endpoint whose transfer fails (it died, or its group broke mid-way, so its weights
may be half old, half new) leaves the pool for good; the others still get the version,
and `publish` then raises `WeightsNotDelivered` naming it. The sender is anything with the
`Sender` calls: the trainer (`libra.train.handle.TrainerHandle`: rank 0 of core replica
0 sends) or a process's own tensors (`libra.transfer.local.LocalSender`).

New engines start on `start_weights()` (the run's first folder, never rewritten) and
`attach` brings them to the trainer's weights by broadcast before they are registered,
stamped with the version the sender reports (the trainer may have stepped past the
last publication: the stamp names what the engine holds).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import aiohttp

from libra.endpoints.pool import Endpoint, EndpointPool
from libra.engine.weights import EndpointKind, post, server_base
from libra.errors import EndpointDown, EndpointError
from libra.weights.base import Weights, not_delivered

DEFAULT_TIMEOUT_S = 120.0
"""How long a group's rendezvous and one transfer may wait for the other side."""


class Sender(Protocol):
    """The trainer half of a broadcast (see `libra.trainer.broadcast` for the trainer's)."""

    async def broadcast_metas(self) -> Sequence[tuple[str, str, Sequence[int]]]: ...

    async def broadcast_listen(self, gid: str, host: str, world: int, timeout_s: float) -> int: ...

    async def broadcast_join(self, gid: str) -> str | None: ...

    async def broadcast_send(self, gid: str, bucket_bytes: int) -> tuple[int, str | None]: ...

    async def broadcast_close(self, gid: str) -> None: ...


class BroadcastSync:
    """Weights by broadcast into the endpoints of `pool` (module doc)."""

    def __init__(
        self,
        *,
        sender: Sender,
        pool: EndpointPool,
        kind: EndpointKind,
        origin: Weights,
        current: Weights | None = None,
        host: str = "127.0.0.1",
        ranks: dict[str, int] | None = None,
        bucket_bytes: int = 64 << 20,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.sender = sender
        self.pool = pool
        self.kind = kind
        self.origin = origin
        self._current = current or origin
        self.host = host
        """The address endpoints reach the sender at (the trainer's node)."""
        self.ranks = ranks or {}
        """Serving ranks per bucket (its TP size; the embedded engine has one)."""
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._open: set[str] = set()
        self._metas: dict[str, Any] | None = None
        self._lock = asyncio.Lock()
        self.lost: list[tuple[str, str]] = []
        """(url, why) of endpoints that left the pool because a transfer failed."""

    @property
    def current(self) -> Weights:
        return self._current

    def start_weights(self) -> Weights:
        return self.origin

    async def publish(self, version: int, only: Collection[str] | None = None) -> float:
        """(`only`: these endpoints' URLs, not every registered one.)"""
        t0 = time.monotonic()
        failed: list[tuple[str, str]] = []
        async with self._lock, aiohttp.ClientSession() as session:
            for ep in list(self.pool.endpoints()):
                if only is not None and ep.url not in only:
                    continue
                why = await self._bring(session, ep, version)
                if why is not None:
                    failed.append((ep.url, why))
            self._current = Weights(version, "")
        if failed:
            raise not_delivered(version, failed)
        return time.monotonic() - t0

    async def attach(self, bucket: str, url: str, started_on: Weights) -> int:
        async with self._lock:
            version = self._current.version
            try:
                async with aiohttp.ClientSession() as session:
                    await self._open_group(session, url, bucket)
                    if started_on != self._current:  # published while the engine started
                        version = await self._transfer(session, url)
                await self.pool.add_endpoint(bucket, url, version)
            except BaseException:
                await self._close(url)  # the caller stops the engine
                raise
            return version

    async def detach(self, url: str, drain_timeout_s: float) -> int:
        async with self._lock:
            left = 0
            if any(ep.url == url for ep in self.pool.endpoints()):  # else: lost already
                left = await self.pool.drain(url, drain_timeout_s)
                await self.pool.remove_endpoint(url)
            await self._close(url)
        return left

    async def close(self) -> None:
        """Release every group (the sender's side; an engine's is replaced when a group
        is opened to it again)."""
        async with self._lock:
            for url in list(self._open):
                await self._close(url)

    # -- one endpoint -------------------------------------------------------------------

    async def _bring(
        self, session: aiohttp.ClientSession, ep: Endpoint, version: int
    ) -> str | None:
        """Send the trainer's weights to the registered endpoint `ep` as `version`; on
        failure it leaves the pool and the reason is returned."""
        url = ep.url
        await self.pool.set_admitting(url, False)
        try:
            if self.kind == "vllm":
                await self.pool.drain(url, self.pool.config.request_timeout_s)
            if url not in self._open:
                await self._open_group(session, url, ep.bucket)
            await self._transfer(session, url)
            self.pool.set_version(version, [url])
        except (EndpointError, OSError, TimeoutError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.lost.append((url, why))
            await self._close(url)
            await self.pool.remove_endpoint(url)
            return why
        await self.pool.set_admitting(url, True)
        return None

    async def _open_group(self, session: aiohttp.ClientSession, url: str, bucket: str) -> None:
        world = 1 + self.ranks.get(bucket, 1)
        port = await self.sender.broadcast_listen(url, self.host, world, self.timeout_s)
        info = {"master_address": self.host, "master_port": port, "world_size": world,
                "rank_offset": 1, "timeout_s": self.timeout_s}  # fmt: skip
        base = server_base(url)
        join = asyncio.ensure_future(self.sender.broadcast_join(url))
        try:
            await post(session, f"{base}/init_weight_transfer_engine", {"init_info": info},
                       self.timeout_s + 30, retry=False)  # fmt: skip
        finally:
            why = await join  # the rank waits at most timeout_s for the server's ranks
        if why is not None:
            raise EndpointDown(f"weight group: {why}", url=url)
        self._open.add(url)

    async def _transfer(self, session: aiohttp.ClientSession, url: str) -> int:
        """The four phases (module doc); returns the version sent."""
        base = server_base(url)
        metas = await self._update_info()
        if self.kind == "vllm":
            await post(session, f"{base}/pause?mode=wait", timeout_s=self.timeout_s)
        try:
            await post(session, f"{base}/start_weight_update", retry=False)
            send = asyncio.ensure_future(self.sender.broadcast_send(url, self.bucket_bytes))
            try:
                await post(session, f"{base}/update_weights", {"update_info": metas},
                           self.timeout_s + 30, retry=False)  # fmt: skip
            finally:
                version, why = await send
            if why is not None:
                raise EndpointDown(f"broadcast: {why}", url=url)
            await post(session, f"{base}/finish_weight_update", timeout_s=self.timeout_s,
                       retry=False)  # fmt: skip
            if self.kind == "vllm":
                await post(session, f"{base}/reset_prefix_cache")
        finally:
            if self.kind == "vllm":
                await post(session, f"{base}/resume")
        return version

    async def _update_info(self) -> dict[str, Any]:
        if self._metas is None:
            metas = await self.sender.broadcast_metas()
            self._metas = {
                "names": [m[0] for m in metas],
                "dtype_names": [m[1] for m in metas],
                "shapes": [list(m[2]) for m in metas],
                "bucket_bytes": self.bucket_bytes,
            }
        return self._metas

    async def _close(self, url: str) -> None:
        self._open.discard(url)
        await self.sender.broadcast_close(url)


__all__ = ["DEFAULT_TIMEOUT_S", "BroadcastSync", "Sender"]
