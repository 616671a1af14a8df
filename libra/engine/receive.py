"""The embedded engine's side of weight broadcast: vLLM's four phases, same routes.

    POST /init_weight_transfer_engine {"init_info": {"master_address", "master_port",
                                                     "world_size", "rank_offset"}}
    POST /start_weight_update
    POST /update_weights {"update_info": {"names", "dtype_names", "shapes",
                                          "bucket_bytes"}}
    POST /finish_weight_update
    POST /shutdown_weight_transfer_engine

The engine joins the trainer's gloo group (`libra.transfer.wire`) as rank
`rank_offset`, takes the buckets into a fresh set of tensors while it keeps serving on
the old ones, and at `finish` swaps them in as one piece, exactly as a folder load
does (`EmbeddedEngine.swap`): a response comes from one version. Blocking work (the
rendezvous, the receive, the fuse) runs in threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from libra.engine import protocol
from libra.engine.model import ModelConfig, fuse
from libra.errors import ModelError
from libra.transfer import wire

DTYPES = frozenset({"float32", "bfloat16", "float16"})
"""Tensor dtypes a broadcast may carry (the engine computes in float32 or bfloat16)."""


class Receiver:
    """One trainer connection and at most one update in progress."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.group: Any = None
        self.incoming: dict[str, torch.Tensor] | None = None
        self.lock = asyncio.Lock()

    async def init(self, info: dict[str, Any]) -> None:
        host, port = _field(info, "master_address", str), _field(info, "master_port", int)
        world, rank = _field(info, "world_size", int), int(info.get("rank_offset", 1))
        timeout_s = float(info.get("timeout_s", 120.0))
        if not 0 < rank < world:
            raise protocol.bad(f"rank_offset {rank} is not in 1..world_size-1", "init_info")
        async with self.lock:
            self.group = None
            self.group = await asyncio.to_thread(
                wire.open_group, host, port, rank=rank, world=world, timeout_s=timeout_s
            )

    async def start(self) -> None:
        if self.group is None:
            raise protocol.bad("no weight-transfer group: POST /init_weight_transfer_engine "
                               "first", "init_info")  # fmt: skip
        self.incoming = {}

    async def update(self, info: dict[str, Any]) -> None:
        names = _field(info, "names", list)
        dtypes, shapes = _field(info, "dtype_names", list), _field(info, "shapes", list)
        if not len(names) == len(dtypes) == len(shapes):
            raise protocol.bad("names, dtype_names and shapes differ in length", "update_info")
        bad = next((d for d in dtypes if d not in DTYPES), None)
        if bad is not None:
            raise protocol.bad(f"dtype {bad!r} is not one of {sorted(DTYPES)}", "update_info")
        if not all(isinstance(s, list) and all(isinstance(x, int) and x >= 0 for x in s)
                   for s in shapes):  # fmt: skip
            raise protocol.bad("shapes must be lists of non-negative integers", "update_info")
        metas = [wire.Meta(str(n), str(d), tuple(s))
                 for n, d, s in zip(names, dtypes, shapes, strict=True)]  # fmt: skip
        bucket = int(info.get("bucket_bytes", wire.BUCKET_BYTES))
        if self.incoming is None:
            raise protocol.bad("POST /start_weight_update first", "update_info")
        incoming = self.incoming
        async with self.lock:
            await asyncio.to_thread(self._receive, metas, bucket, incoming)

    def _receive(self, metas: list[wire.Meta], bucket: int, into: dict) -> None:
        try:
            for part in wire.receive(self.group, metas, bucket):
                into.update(part)
        except BaseException:
            self.group = None  # a broken group cannot be used again: init anew
            raise

    async def finish(self) -> dict[str, torch.Tensor]:
        """The received tensors in the decoder's layout (the caller swaps them in)."""
        raw, self.incoming = self.incoming, None
        if raw is None:
            raise protocol.bad("POST /start_weight_update first", "update_info")
        try:
            return await asyncio.to_thread(fuse, raw, self.cfg)
        except KeyError as e:
            raise ModelError(f"weight {e.args[0]} was not sent") from None

    def shutdown(self) -> None:
        self.group, self.incoming = None, None


def _field(info: dict[str, Any], key: str, kind: type) -> Any:
    value = info.get(key)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is not int and isinstance(value, kind):
        return value
    raise protocol.bad(f"{key} must be a {kind.__name__}, got {value!r}", key)


__all__ = ["Receiver"]
