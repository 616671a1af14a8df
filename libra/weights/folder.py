"""`FolderSync`: weights through a filesystem every endpoint sees.

Trainer half: the trainer writes version `v` as an HF folder `{root}/v{v}` (atomically:
written beside, renamed), and all but the newest `keep` folders are deleted. Endpoint
half: each registered endpoint loads the folder, one at a time
(`libra.engine.weights.load_weights`: the embedded engine's load call, or vLLM's pause,
`reload_weights`, prefix-cache reset, resume):

1. no new turn is sent to it (`EndpointPool.set_admitting(False)`); turns it is running
   finish on the old weights (vLLM: Libra's turns are drained first, so no request can
   reach the server between its pause and the reload and run on weights its stamp does
   not name);
2. it loads the folder; its version becomes `v` (every later turn is stamped `v`);
3. it admits turns again; if the load failed, it leaves the pool instead (its state is
   unknown), the others still load the folder, and `publish` then raises
   `WeightsNotDelivered` naming it.

Endpoints that start later begin on `start_weights()`: the current folder for the
embedded engine (a start takes seconds), the run's first folder for vLLM (never pruned:
a start can outlast `keep` publications), and `attach` loads the current version before
they are registered. The GPU transport (NCCL broadcast into vLLM's weight-transfer
engine) is a second `WeightSync` with the same calls.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from libra.endpoints.pool import EndpointPool
from libra.engine.weights import EndpointKind, load_weights
from libra.errors import EndpointError
from libra.weights.base import Weights, not_delivered

Writer = Callable[[str], Awaitable[object]]
"""The trainer half: write the current weights as an HF folder at the given path."""


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version}"


def prune(root: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` version folders under `root`."""
    versions = (p for p in Path(root).glob("v*") if p.name[1:].isascii() and p.is_dir())
    folders = sorted((p for p in versions if p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))
    for p in folders[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


class FolderSync:
    """Versioned folders under `root`, loaded into the endpoints of `pool` (module doc)."""

    def __init__(
        self,
        *,
        write: Writer,
        root: str | Path,
        keep: int,
        pool: EndpointPool,
        kind: EndpointKind,
        origin: Weights,
        current: Weights | None = None,
    ):
        self._write = write
        self.root = Path(root)
        self.keep = keep
        self.pool = pool
        self.kind = kind
        self.origin = origin
        """The folder the run started from (never pruned; version -1 when the endpoints
        serve something newer, e.g. a resumed run's checkpoint)."""
        self._current = current or origin
        self._lock = asyncio.Lock()
        """Held while endpoints load weights or join / leave the pool: a publication
        must not re-admit an endpoint that is being drained, nor miss one that joins."""

    @property
    def current(self) -> Weights:
        return self._current

    def start_weights(self) -> Weights:
        return self._current if self.kind == "embedded" else self.origin

    async def publish(self, version: int) -> float:
        t0 = time.monotonic()
        folder = str(version_dir(self.root, version).resolve())
        await self._write(folder)
        await asyncio.to_thread(prune, self.root, self.keep)
        wait_s = self.pool.config.request_timeout_s
        lost: list[tuple[str, str]] = []
        async with self._lock, aiohttp.ClientSession() as session:
            for ep in list(self.pool.endpoints()):
                await self.pool.set_admitting(ep.url, False)
                try:
                    if self.kind == "vllm":
                        await self.pool.drain(ep.url, wait_s)
                    await load_weights(session, ep.url, self.kind, folder)
                    self.pool.set_version(version, [ep.url])
                except (EndpointError, OSError, TimeoutError) as e:
                    lost.append((ep.url, str(e).splitlines()[0] if str(e) else repr(e)))
                    await self.pool.remove_endpoint(ep.url)
                    continue
                await self.pool.set_admitting(ep.url, True)
            self._current = Weights(version, folder)
        if lost:
            raise not_delivered(version, lost)
        return time.monotonic() - t0

    async def attach(self, bucket: str, url: str, started_on: Weights) -> int:
        async with self._lock:
            if started_on != self._current:  # published while the engine started
                async with aiohttp.ClientSession() as session:
                    await load_weights(session, url, self.kind, self._current.folder)
            await self.pool.add_endpoint(bucket, url, self._current.version)
            return self._current.version

    async def detach(self, url: str, drain_timeout_s: float) -> int:
        async with self._lock:
            if not any(ep.url == url for ep in self.pool.endpoints()):
                return 0  # a publication that could not reach it removed it already
            left = await self.pool.drain(url, drain_timeout_s)
            await self.pool.remove_endpoint(url)
        return left


__all__ = ["FolderSync", "Writer", "prune", "version_dir"]
