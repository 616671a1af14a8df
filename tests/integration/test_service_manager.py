"""The batch manager in-process against a fake vLLM server on loopback: a long-running
service that gets a batch per training step keeps memory and file descriptors bounded,
and finished batches stay readable from the spool."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from libra.envs.arith import make_tasks

from libra.chat import ChatTokenizer
from libra.endpoints.config import EndpointConfig
from libra.endpoints.pool import EndpointPool
from libra.routing.base import Bucket
from libra.service.config import EnvEntry, ServiceConfig, SubmitRequest
from libra.service.envs import EnvHost
from libra.service.manager import KEEP_LOADED, BatchManager
from libra.service.stream import episode_chunks


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.asynccontextmanager
async def a_manager(
    tmp_path: Path, tiny_model: Path, url: str, **config: Any
) -> AsyncIterator[BatchManager]:
    """A recovered manager over a spool in `tmp_path` and one bucket of `url`'s engine
    (its episodes run once `manager.run()` does)."""
    cfg = ServiceConfig(spool={"dir": str(tmp_path / "spool")}, envs=[EnvEntry(spec="arith")],
                        **config)  # fmt: skip
    buckets = [Bucket("tp1", 1, 4096)]
    async with EndpointPool([(buckets[0], [url])], EndpointConfig()) as pool:
        manager = BatchManager(
            config=cfg, pool=pool, tokenizer=ChatTokenizer(tiny_model), max_context=4096,
            envs=EnvHost(cfg.envs, buckets, "static", {}),
        )  # fmt: skip
        manager.recover()
        yield manager


async def test_many_finished_batches_are_unloaded_and_reloaded_on_demand(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    async with a_manager(tmp_path, tiny_model, fake_vllm.url) as manager:
        work = asyncio.create_task(manager.run())
        try:
            fds = None
            n = 3 * KEEP_LOADED
            for step in range(n):
                req = SubmitRequest(
                    env="arith", tasks=make_tasks(1, seed=step), batch_id=f"s{step}"
                )
                batch, created = await manager.submit(req)
                assert created
                lines = b"".join([c async for c in episode_chunks(batch, -1)])
                assert lines.count(b"\n") == 1
                while not batch.spool.closed:
                    await asyncio.sleep(0.01)
                if step == KEEP_LOADED:
                    fds = open_fds()
            assert len(manager.batches) <= KEEP_LOADED
            assert fds is not None and open_fds() <= fds  # no descriptor per finished batch
            # An unloaded batch comes back from the spool with its status and records.
            old = await manager.get("s0")
            assert manager.status(old)["state"] == "done"
            assert manager.status(old)["counts"]["ok"] == 1
            lines = b"".join([c async for c in episode_chunks(old, -1)])
            assert b'"id":"s0/arith-0-0/0"' in lines
            # Many requests for an unloaded batch at once read it back once (each read
            # the whole spool again: 40 readers of a 30,000-episode batch took 95 s).
            reads: list[str] = []
            real = manager._reload

            def counted(batch_id: str):  # type: ignore[no-untyped-def]
                reads.append(batch_id)
                return real(batch_id)

            manager._reload = counted  # type: ignore[method-assign]
            got = await asyncio.gather(*(manager.get("s1") for _ in range(20)))
            assert reads == ["s1"] and all(b is got[0] for b in got)
        finally:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)


async def test_streams_of_unloaded_batches_read_their_own_records_and_end(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    """A stream counted itself as a reader only after its first await, and another
    request's eviction released the spool under it: streams got another batch's records
    (a file that took the closed descriptor's number), cut lines, or hung without end.
    Many finished batches, many concurrent streams of them, over HTTP."""
    import random

    import aiohttp
    import orjson

    from tests.integration.service_util import Service

    url, _ = spawn_fake()
    svc = Service(tmp_path, tiny_model, [url])
    base = svc.start()
    n = 3 * KEEP_LOADED
    try:
        async with aiohttp.ClientSession() as http:
            for i in range(n):
                body = {"env": "arith", "tasks": make_tasks(1, seed=i), "batch_id": f"b{i}"}
                async with http.post(f"{base}/v1/rollouts", json=body) as r:
                    assert r.status == 201, await r.text()
            for i in range(n):  # every one finished (its stream ends)
                async with http.get(f"{base}/v1/rollouts/b{i}/trajectories") as r:
                    await r.read()

            async def stream(batch_id: str) -> list[dict]:
                url = f"{base}/v1/rollouts/{batch_id}/trajectories"
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=30)) as r:
                    assert r.status == 200
                    return [orjson.loads(line) for line in (await r.read()).splitlines()]

            rng = random.Random(0)
            for _ in range(3):
                ids = [f"b{rng.randrange(n)}" for _ in range(120)]
                got = await asyncio.gather(*(stream(b) for b in ids))
                for batch_id, recs in zip(ids, got, strict=True):
                    assert [r["batch_id"] for r in recs] == [batch_id]
        assert "Bad file descriptor" not in svc.log()
    finally:
        svc.close()


async def test_a_submit_out_of_file_descriptors_is_a_503_and_leaves_no_batch(
    tmp_path: Path, tiny_model: Path, fake_vllm, monkeypatch
) -> None:
    """With every descriptor taken, a submit was told 507 "free space there" (the disk
    was not full), its write side stayed open, and its folder stayed: at the restart the
    service ran the batch the client had been told was refused."""
    import errno

    import pytest

    from libra.service import spool
    from libra.service.errors import RequestError

    async with a_manager(tmp_path, tiny_model, fake_vllm.url) as manager:
        real_open, before = os.open, open_fds()

        def no_more(path, flags, *a):  # type: ignore[no-untyped-def]
            if flags == os.O_RDONLY:  # the spool's read side, after its write side
                raise OSError(errno.EMFILE, "Too many open files")
            return real_open(path, flags, *a)

        monkeypatch.setattr(spool.os, "open", no_more)
        req = SubmitRequest(env="arith", tasks=make_tasks(1, seed=0), batch_id="x")
        with pytest.raises(RequestError) as err:
            await manager.submit(req)
        assert err.value.status == 503 and "no file descriptor is left" in str(err.value)
        assert not (tmp_path / "spool" / "x").exists() and open_fds() == before
        monkeypatch.setattr(spool.os, "open", real_open)
        batch, created = await manager.submit(req)  # once there are descriptors again
        assert created and batch.total == 1


async def test_unfinished_batches_past_max_open_batches_are_a_429(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    """Each unfinished batch holds two descriptors and nothing bounded them: 500 small
    batches took every descriptor, and submits failed with `Too many open files`."""
    import pytest

    from libra.service.errors import RequestError

    async with a_manager(tmp_path, tiny_model, fake_vllm.url, max_open_batches=2) as manager:

        def req(i: int) -> SubmitRequest:
            return SubmitRequest(env="arith", tasks=make_tasks(1, seed=i), batch_id=f"o{i}")

        first = [(await manager.submit(req(i)))[0] for i in range(2)]  # queued: none runs yet
        with pytest.raises(RequestError) as err:
            await manager.submit(req(2))
        assert err.value.status == 429 and "max_open_batches (2)" in str(err.value)
        assert not (tmp_path / "spool" / "o2").exists()
        work = asyncio.create_task(manager.run())
        try:
            for batch in first:
                while not batch.spool.closed:
                    await asyncio.sleep(0.01)
            batch, created = await manager.submit(req(2))  # once they have finished
            assert created
        finally:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
