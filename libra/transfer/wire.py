"""Weights over a gloo process group: buckets of whole tensors, rank 0 to the rest.

The two sides agree on the stream from the metadata alone (`Meta`: name, dtype,
shape, in the sender's order): `buckets` cuts it the same way on both, so a bucket is
one broadcast of a flat byte buffer, at most `bucket_bytes` long unless one tensor is
larger (then it travels alone). A receiver gets views into the bucket's buffer, valid
until it asks for the next bucket.

One group per server (the trainer as rank 0, each of the server's TP ranks after it):
a server that dies breaks only its own group, and the sender's `broadcast` raises
instead of waiting forever (gloo reports the closed connection; a silent peer hits
the group's timeout).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 << 20
"""Default bucket size: bounded memory on both sides, few enough broadcasts."""
ALIGN = 16


@dataclass(frozen=True, slots=True)
class Meta:
    name: str
    dtype: str
    """A torch dtype name ("float32", "bfloat16")."""
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = getattr(torch, self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


def metas_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[Meta]:
    return [Meta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]


def buckets(metas: Sequence[Meta], bucket_bytes: int) -> list[list[Meta]]:
    """Consecutive runs of `metas`, each at most `bucket_bytes` (or one tensor)."""
    out: list[list[Meta]] = []
    size = 0
    for m in metas:
        if out and size + ALIGN + m.nbytes <= bucket_bytes:
            out[-1].append(m)
            size += ALIGN + m.nbytes
        else:
            out.append([m])
            size = m.nbytes
    return out


def open_group(
    host: str,
    port: int,
    *,
    rank: int,
    world: int,
    timeout_s: float,
    store: dist.Store | None = None,
) -> dist.ProcessGroupGloo:
    """Join the group whose store rank 0 serves at `host:port`; blocks until all
    `world` ranks have joined (or `timeout_s`). Rank 0 passes the `listen` store."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    opts._devices = [_device(host)]
    return dist.ProcessGroupGloo(store, rank, world, opts)


def listen(host: str, world: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """Rank 0's rendezvous store on a free port of `host`: (store, port)."""
    store = dist.TCPStore(host, 0, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)  # fmt: skip
    return store, int(store.port)


def _device(host: str) -> object:
    """Bind gloo to loopback when the group is on loopback; otherwise the default
    interface (`GLOO_SOCKET_IFNAME` picks another)."""
    try:
        loop = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loop = host == "localhost"
    if loop:
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


def send(
    pg: dist.ProcessGroupGloo, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> int:
    """Broadcast `named` (in order; the receivers hold its `metas_of`) from rank 0;
    returns the bytes sent."""
    tensors = dict(named)
    total = 0
    for bucket in buckets(metas_of(tensors.items()), bucket_bytes):
        offsets, size = _layout(bucket)
        flat = torch.empty(size, dtype=torch.uint8)
        for m, at in zip(bucket, offsets, strict=True):
            src = tensors[m.name].detach().contiguous().reshape(-1).view(torch.uint8)
            flat[at : at + m.nbytes].copy_(src)
        _broadcast(pg, flat)
        total += size
    return total


def receive(
    pg: dist.ProcessGroupGloo, metas: Sequence[Meta], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each bucket as (name, tensor) views, in order (a view is valid until the next)."""
    for bucket in buckets(metas, bucket_bytes):
        offsets, size = _layout(bucket)
        flat = torch.empty(size, dtype=torch.uint8)
        _broadcast(pg, flat)
        yield [(m.name, flat[at : at + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape))
               for m, at in zip(bucket, offsets, strict=True)]  # fmt: skip


def _layout(bucket: Sequence[Meta]) -> tuple[list[int], int]:
    """Byte offset of each tensor in the bucket's buffer (16-byte aligned, so that any
    dtype can be viewed in place) and the buffer's size."""
    offsets, at = [], 0
    for m in bucket:
        at = -(-at // ALIGN) * ALIGN
        offsets.append(at)
        at += m.nbytes
    return offsets, at


def _broadcast(pg: dist.ProcessGroupGloo, flat: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([flat], opts).wait()  # type: ignore[attr-defined]


__all__ = ["BUCKET_BYTES", "Meta", "buckets", "listen", "metas_of", "open_group", "receive",
           "send"]  # fmt: skip
