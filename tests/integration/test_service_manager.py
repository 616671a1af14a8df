"""The batch manager in-process against a fake vLLM server on loopback: a long-running
service that gets a batch per training step keeps memory and file descriptors bounded,
and finished batches stay readable from the spool."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

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


async def test_many_finished_batches_are_unloaded_and_reloaded_on_demand(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    cfg = ServiceConfig(spool={"dir": str(tmp_path / "spool")}, envs=[EnvEntry(spec="arith")])
    buckets = [Bucket("tp1", 1, 4096)]
    async with EndpointPool([(buckets[0], [fake_vllm.url])], EndpointConfig()) as pool:
        manager = BatchManager(
            config=cfg, pool=pool, tokenizer=ChatTokenizer(tiny_model), max_context=4096,
            envs=EnvHost(cfg.envs, buckets, "static", {}),
        )  # fmt: skip
        manager.recover()
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
