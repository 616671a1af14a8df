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

import torch

from libra.transfer import wire
from libra.transfer.groups import Groups


class LocalSender:
    def __init__(
        self,
        tensors: Callable[[], dict[str, torch.Tensor]],
        version: Callable[[], int] = lambda: 0,
    ):
        self.tensors = tensors
        self.version = version
        self.groups = Groups()

    async def broadcast_metas(self) -> Sequence[tuple[str, str, Sequence[int]]]:
        return [(m.name, m.dtype, m.shape) for m in wire.metas_of(self.tensors().items())]

    async def broadcast_listen(self, gid: str, host: str, world: int, timeout_s: float) -> int:
        return await asyncio.to_thread(self.groups.listen, gid, host, world, timeout_s)

    async def broadcast_join(self, gid: str) -> str | None:
        return await asyncio.to_thread(self.groups.join, gid)

    async def broadcast_send(self, gid: str, bucket_bytes: int) -> tuple[int, str | None]:
        version = self.version()
        named = self.tensors().items()
        return version, await asyncio.to_thread(self.groups.send, gid, named, bucket_bytes)

    async def broadcast_close(self, gid: str) -> None:
        self.groups.close(gid)


__all__ = ["LocalSender"]
