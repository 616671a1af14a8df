"""The driver's handle on the (blocking) `ElasticTrainer`: every call runs in a worker
thread, one at a time, with SIGINT blocked, so membership changes happen between steps,
never inside one, and the event loop never waits on torch."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from multiprocessing import resource_tracker
from typing import Any, TypeVar

from libra.record import Trajectory

T = TypeVar("T")


def no_sigint(fn: Callable[..., T]) -> Callable[..., T]:
    """Run `fn` with SIGINT blocked in the calling thread, so processes it spawns start
    with SIGINT blocked (the mask survives fork and exec): a Ctrl-C at the terminal goes
    to the whole foreground process group, and the trainer's processes must keep
    running until `libra train` has saved its checkpoint and stops them itself."""

    def wrapped(*args: Any) -> T:
        # multiprocessing starts its resource tracker at the first spawn, and *unblocks*
        # SIGINT in the calling thread after starting it (it blocks it around the spawn
        # and then unblocks it, whatever the mask was): every process spawned after it in
        # this call got a terminal's Ctrl-C, and a rank died of it. Started first, here,
        # it leaves the mask alone.
        resource_tracker.ensure_running()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return fn(*args)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    return wrapped


class TrainerHandle:
    """Async calls into an `ElasticTrainer` (`libra.trainer`). A cancelled caller still
    waits for its call to end before the next one may start: the trainer is never
    entered twice."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self._lock = asyncio.Lock()

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        async with self._lock:
            fut = asyncio.ensure_future(asyncio.to_thread(no_sigint(fn), *args))
            try:
                return await asyncio.shield(fut)
            except asyncio.CancelledError:
                # the thread cannot be interrupted: wait for it, whatever it raises (its
                # outcome belongs to the cancelled caller), then let the cancel go on
                await asyncio.wait([fut])
                raise

    @property
    def version(self) -> int:
        return int(self.trainer.version)

    async def start(self) -> None:
        await self._call(self.trainer.start)

    async def step(self, records: list[Trajectory]) -> Any:
        """One policy version (a `libra.trainer.StepReport`)."""
        return await self._call(self.trainer.step, records)

    async def add_hybrid(
        self, replica_id: str, node: str | None = None, gpus: list[int] | None = None
    ) -> None:
        await self._call(self.trainer.add_hybrid, replica_id, node, gpus)

    async def nodes(self) -> dict[str, str]:
        """Replica id -> the node it runs on (`local`: this machine)."""
        return await self._call(self.trainer.nodes)

    async def sender_host(self) -> str | None:
        """Where the weight broadcast's sender runs, when not on this machine."""
        return await self._call(lambda: self.trainer.sender_host)

    async def remove_hybrid(self, replica_id: str) -> None:
        await self._call(self.trainer.remove_hybrid, replica_id)

    async def replicas(self) -> list[Any]:
        return await self._call(self.trainer.replicas)

    async def save_weights(self, path: str) -> None:
        """The weight sync's trainer half: an HF folder of the current weights."""
        await self._call(self.trainer.save_weights, path)

    # the sender of `libra.weights.BroadcastSync` (rank 0 of core replica 0 sends)

    async def broadcast_metas(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return await self._call(self.trainer.broadcast_metas)

    async def broadcast_listen(self, gid: str, host: str, world: int, timeout_s: float) -> int:
        return await self._call(self.trainer.broadcast_listen, gid, host, world, timeout_s)

    async def broadcast_join(self, gid: str) -> str | None:
        return await self._call(self.trainer.broadcast_join, gid)

    async def broadcast_send(self, gid: str, bucket_bytes: int) -> tuple[int, str | None]:
        return await self._call(self.trainer.broadcast_send, gid, bucket_bytes)

    async def broadcast_close(self, gid: str) -> None:
        await self._call(self.trainer.broadcast_close, gid)

    async def save_checkpoint(self, path: str) -> None:
        await self._call(self.trainer.save_checkpoint, path)

    async def holder(self) -> str | None:
        """The replica a checkpoint would be saved from now (None: none holds the
        current step's state whole)."""
        return await self._call(self.trainer.holder)

    @property
    def saved_by(self) -> str:
        """The replica that wrote the last checkpoint."""
        return str(self.trainer.saved_by)

    async def close(self) -> None:
        """Stop the trainer's processes, after the call in flight (a start, a step) has
        ended: the trainer is never entered twice, also when the caller is cancelled."""
        await self._call(self.trainer.close)


__all__ = ["TrainerHandle", "no_sigint"]
