"""The sender's groups, by id (one per server): what `LocalSender` and the trainer's
rank 0 (`libra.trainer.broadcast`) both keep.

    groups = Groups()
    port = groups.listen("s1", "127.0.0.1", world=1 + tp, timeout_s=120)
    why = groups.join("s1")        # None once the server's ranks joined
    why = groups.send("s1", state.items(), bucket_bytes)
    groups.close("s1")

`join` and `send` never raise for the server's failure: they return it as one line and
drop the group (a broken group cannot be used again; the next `listen` opens a new one).
Blocking calls: from asyncio, run them in a thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from libra.transfer import wire

log = logging.getLogger("libra.transfer")


class Groups:
    def __init__(self) -> None:
        self._stores: dict[str, tuple[Any, int, float, str]] = {}
        self._groups: dict[str, Any] = {}

    def listen(self, gid: str, host: str, world: int, timeout_s: float) -> int:
        """Open `gid`'s rendezvous on a free port of `host` (as rank 0 of `world`)."""
        self.close(gid)
        store, port = wire.listen(host, world, timeout_s)
        self._stores[gid] = (store, world, timeout_s, host)
        return port

    def join(self, gid: str) -> str | None:
        def join() -> None:
            store, world, timeout_s, host = self._stores.pop(gid)
            self._groups[gid] = wire.open_group(host, 0, rank=0, world=world,
                                                timeout_s=timeout_s, store=store)  # fmt: skip

        return self._guard(gid, self._stores, join)

    def send(
        self, gid: str, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> str | None:
        return self._guard(gid, self._groups,
                           lambda: wire.send(self._groups[gid], named, bucket_bytes))  # fmt: skip

    def close(self, gid: str) -> None:
        self._stores.pop(gid, None)
        self._groups.pop(gid, None)

    def _guard(self, gid: str, where: dict[str, Any], fn: Callable[[], object]) -> str | None:
        if gid not in where:
            return f"no weight group {gid!r} (listen and join first)"
        try:
            fn()
        except Exception as e:
            log.warning("weight broadcast to %s failed: %s", gid, e)
            self.close(gid)
            first = str(e).splitlines()[0] if str(e) else ""
            return f"{type(e).__name__}: {first}"
        return None


__all__ = ["Groups"]
