"""`libra.transfer.wire`: weights over a real gloo group between processes on loopback."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

from libra.transfer import wire


def named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(50, 8, generator=g)),
        ("odd.bf16", torch.randn(301, generator=g).to(torch.bfloat16)),  # 602 bytes
        ("after.odd", torch.randn(3, 5, generator=g)),  # must still be aligned
        ("big", torch.randn(400, generator=g)),  # 1600 bytes > a 1000-byte bucket
        ("bias", torch.randn(7, generator=g)),
    ]


def test_buckets_cover_the_stream_in_order_and_stay_bounded() -> None:
    metas = wire.metas_of(named())
    plan = wire.buckets(metas, 1000)
    assert [m for b in plan for m in b] == metas
    for b in plan:
        assert len(b) == 1 or sum(m.nbytes for m in b) + wire.ALIGN * len(b) <= 1000
    assert [m.name for m in plan[-2]] == ["big"]  # a tensor larger than a bucket: alone


def _receive(port: int, rank: int, metas: list[wire.Meta], out: mp.Queue) -> None:
    pg = wire.open_group("127.0.0.1", port, rank=rank, world=3, timeout_s=60)
    got = {}
    for bucket in wire.receive(pg, metas, 1000):
        got.update({n: raw(t) for n, t in bucket})
    out.put((rank, got))  # bytes: a tensor in a queue is a handle into this process


def raw(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    return (
        str(t.dtype),
        tuple(t.shape),
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
    )


def test_every_receiver_gets_every_tensor_bit_exact() -> None:
    tensors = named()
    metas = wire.metas_of(tensors)
    store, port = wire.listen("127.0.0.1", 3, 60)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_receive, args=(port, r, metas, q)) for r in (1, 2)]
    for p in procs:
        p.start()
    pg = wire.open_group("127.0.0.1", port, rank=0, world=3, timeout_s=60, store=store)
    wire.send(pg, tensors, 1000)
    results = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert sorted(results) == [1, 2]
    for got in results.values():
        assert list(got) == [n for n, _ in tensors]
        for n, t in tensors:
            assert got[n] == raw(t)


def _join_then_die(port: int) -> None:
    wire.open_group("127.0.0.1", port, rank=1, world=2, timeout_s=60)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_receiver_that_dies_fails_the_send_instead_of_hanging() -> None:
    store, port = wire.listen("127.0.0.1", 2, 60)
    p = mp.get_context("spawn").Process(target=_join_then_die, args=(port,))
    p.start()
    pg = wire.open_group("127.0.0.1", port, rank=0, world=2, timeout_s=60, store=store)
    p.join(30)
    big = [("w", torch.zeros(16 << 20, dtype=torch.uint8))]  # more than a socket buffers
    with pytest.raises(RuntimeError):
        wire.send(pg, big, 1 << 20)
