"""`AsyncClient.trajectories` reads NDJSON however the bytes arrive: a record of
megabytes in many small chunks, a chunk holding the end of one record and the start of
the next, several records in one chunk. A real aiohttp server on loopback."""

from __future__ import annotations

import orjson
from aiohttp import web

from libra.client import AsyncClient
from libra.record import Trajectory
from tests.conftest import free_port


def rec(seq: int, size: int) -> bytes:
    r = Trajectory(id=f"b/t{seq}/0", batch_id="b", task_id=f"t{seq}", group_id=f"b/t{seq}",
                   env="arith", seq=seq, answer="x" * size)  # fmt: skip
    return r.to_json() + b"\n"


async def test_records_of_any_size_in_any_chunks() -> None:
    port = free_port()
    body = rec(0, 10) + rec(1, 3 << 20) + rec(2, 5) + rec(3, 70_000) + rec(4, 1)
    cuts = [7, 1000, 4096, 1, 65536, 333]  # sizes of the writes, cycled

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        at, k = 0, 0
        while at < len(body):
            n = cuts[k % len(cuts)]
            await resp.write(body[at : at + n])
            at, k = at + n, k + 1
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/rollouts/b/trajectories", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        async with AsyncClient(f"http://127.0.0.1:{port}", reconnect_s=1) as c:
            got = [r async for r in c.trajectories("b")]
    finally:
        await runner.cleanup()
    assert [r.seq for r in got] == [0, 1, 2, 3, 4]
    assert [len(r.answer or "") for r in got] == [10, 3 << 20, 5, 70_000, 1]
    assert got[1].answer == orjson.loads(rec(1, 3 << 20))["answer"]
