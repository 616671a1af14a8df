"""The trainer's half of weight broadcast: rank 0 of core replica 0 sends.

The driver (`ElasticTrainer.broadcast_*`, called by `libra.weights.BroadcastSync`) asks
every rank of core replica 0; each builds the full tensors (a collective when the
replica is sharded) and only rank 0 talks to servers, one gloo group per server
(`libra.transfer.wire`):

    ("wt", "metas")                    -> [(name, dtype, shape), ...]  what `send` sends
    ("wt", "listen", gid, host, world, timeout_s) -> port of gid's rendezvous store
    ("wt", "join", gid)                -> None once the server's ranks have joined
    ("wt", "send", gid, bucket_bytes)  -> bytes sent
    ("wt", "close", gid)               -> None

A failure is the server's, not the trainer's: it comes back as `Failed(message)` (the
group is dropped; the rank keeps training), never as an error that ends the rank.
Tensors travel in float32, the dtype of the folders the disk path writes; tied weights
once, as in those folders.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from libra.trainer.checkpoint import full_state
from libra.trainer.model import tied_keys
from libra.trainer.replica import Replica
from libra.transfer import wire

log = logging.getLogger("libra.trainer")


@dataclass(frozen=True, slots=True)
class Failed:
    """A broadcast call that failed on the server's side (message for the driver)."""

    message: str


class Broadcasts:
    """Rank 0's open groups, by id; other ranks only join the collectives."""

    def __init__(self, replica: Replica):
        self.replica = replica
        self._stores: dict[str, tuple[Any, int, float, str]] = {}
        self._groups: dict[str, Any] = {}

    def handle(self, cmd: tuple) -> Any:
        op, args = cmd[1], cmd[2:]
        if op == "metas":
            return [(m.name, m.dtype, m.shape) for m in wire.metas_of(self._tensors().items())]
        if op == "send":  # every rank: building the tensors may be a collective
            state = self._tensors()
            if self.replica.rank != 0:
                return 0
            return self._guard(args[0], lambda: wire.send(self._groups[args[0]],
                                                          state.items(), args[1]))  # fmt: skip
        if self.replica.rank != 0:
            return None
        if op == "listen":
            gid, host, world, timeout_s = args
            self.close(gid)
            store, port = wire.listen(host, world, timeout_s)
            self._stores[gid] = (store, world, timeout_s, host)
            return port
        if op == "join":
            return self._guard(args[0], lambda: self._join(args[0]))
        if op == "close":
            self.close(args[0])
            return None
        raise ValueError(f"unknown broadcast command {op!r}")

    def _join(self, gid: str) -> None:
        store, world, timeout_s, host = self._stores.pop(gid)
        self._groups[gid] = wire.open_group(host, 0, rank=0, world=world,
                                            timeout_s=timeout_s, store=store)  # fmt: skip

    def _tensors(self) -> dict[str, torch.Tensor]:
        skip = tied_keys(self.replica.model)
        return {k: v.detach().to(torch.float32) for k, v in full_state(self.replica).items()
                if k not in skip}  # fmt: skip

    def _guard(self, gid: str, fn: Any) -> Any:
        try:
            if gid not in self._groups and gid not in self._stores:
                return Failed(f"no weight group {gid!r} (listen and join first)")
            return fn()
        except Exception as e:
            log.warning("weight broadcast to %s failed: %s", gid, e)
            self.close(gid)
            return Failed(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def close(self, gid: str) -> None:
        self._stores.pop(gid, None)
        self._groups.pop(gid, None)

    def close_all(self) -> None:
        self._stores.clear()
        self._groups.clear()


__all__ = ["Broadcasts", "Failed"]
