"""The trainer's half of weight broadcast: rank 0 of core replica 0 sends.

The driver (`ElasticTrainer.broadcast_*`, called by `libra.weights.BroadcastSync`) asks
every rank of core replica 0; each builds the full tensors (a collective when the
replica is sharded) and only rank 0 talks to servers, one gloo group per server
(`libra.transfer.wire`):

    ("wt", "metas")                    -> [(name, dtype, shape), ...]  what `send` sends
    ("wt", "listen", gid, host, world, timeout_s) -> port of gid's rendezvous store
    ("wt", "join", gid)                -> None once the server's ranks have joined, or why not
    ("wt", "send", gid, bucket_bytes)  -> None once sent, or why not
    ("wt", "close", gid)               -> None

A failure is the server's, not the trainer's: `join` and `send` answer it as one line
(the group is dropped; the rank keeps training), never as an error that ends the rank.
Tensors travel in float32, the dtype of the folders the disk path writes; tied weights
once, as in those folders.
"""

from __future__ import annotations

from typing import Any

import torch

from libra.trainer.checkpoint import full_state
from libra.trainer.model import tied_keys
from libra.trainer.replica import Replica
from libra.transfer import wire
from libra.transfer.groups import Groups


class Broadcasts:
    """Rank 0's open groups (`libra.transfer.groups.Groups`); other ranks only join the
    collectives that build the tensors."""

    def __init__(self, replica: Replica):
        self.replica = replica
        self.groups = Groups()

    def handle(self, cmd: tuple) -> Any:
        op, args = cmd[1], cmd[2:]
        if op == "metas":
            return [(m.name, m.dtype, m.shape) for m in wire.metas_of(self._tensors().items())]
        if op == "send":  # every rank: building the tensors may be a collective
            state = self._tensors()
            if self.replica.rank != 0:
                return None
            return self.groups.send(args[0], state.items(), args[1])
        if self.replica.rank != 0:
            return None
        if op == "listen":
            return self.groups.listen(*args)
        if op == "join":
            return self.groups.join(args[0])
        if op == "close":
            self.groups.close(args[0])
            return None
        raise ValueError(f"unknown broadcast command {op!r}")

    def _tensors(self) -> dict[str, torch.Tensor]:
        skip = tied_keys(self.replica.model)
        return {k: v.detach().to(torch.float32) for k, v in full_state(self.replica).items()
                if k not in skip}  # fmt: skip


__all__ = ["Broadcasts"]
