"""`LocalSender`: this process's own tensors as the sender of a `BroadcastSync`.

    sender = LocalSender(lambda: model.state_dict(), version=lambda: step)
    sync = BroadcastSync(sender=sender, pool=pool, kind="vllm", origin=...)
    await sync.publish(step)

For a trainer that is not Libra's (and for tests and `libra bench publish`): the
tensors are read when each transfer starts; blocking work runs in threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import torch

from libra.transfer import wire


class LocalSender:
    def __init__(
        self,
        tensors: Callable[[], dict[str, torch.Tensor]],
        version: Callable[[], int] = lambda: 0,
    ):
        self.tensors = tensors
        self.version = version
        self._stores: dict[str, tuple[Any, int, float, str]] = {}
        self._groups: dict[str, Any] = {}

    async def broadcast_metas(self) -> Sequence[tuple[str, str, Sequence[int]]]:
        return [(m.name, m.dtype, m.shape) for m in wire.metas_of(self.tensors().items())]

    async def broadcast_listen(self, gid: str, host: str, world: int, timeout_s: float) -> int:
        await self.broadcast_close(gid)
        store, port = await asyncio.to_thread(wire.listen, host, world, timeout_s)
        self._stores[gid] = (store, world, timeout_s, host)
        return port

    async def broadcast_join(self, gid: str) -> str | None:
        store, world, timeout_s, host = self._stores.pop(gid)
        try:
            self._groups[gid] = await asyncio.to_thread(
                wire.open_group, host, 0, rank=0, world=world, timeout_s=timeout_s, store=store
            )
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    async def broadcast_send(self, gid: str, bucket_bytes: int) -> tuple[int, str | None]:
        version = self.version()
        group = self._groups.get(gid)
        if group is None:
            return version, f"no weight group {gid!r}"
        try:
            await asyncio.to_thread(wire.send, group, self.tensors().items(), bucket_bytes)
        except Exception as e:
            self._groups.pop(gid, None)
            return version, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return version, None

    async def broadcast_close(self, gid: str) -> None:
        self._stores.pop(gid, None)
        self._groups.pop(gid, None)


__all__ = ["LocalSender"]
