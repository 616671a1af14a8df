"""Big requests against a real `libra serve-rollout` never stop it answering (issue 14,
item 2): while a big submit is checked, a junk body is parsed, or a big batch is
cancelled, `GET /healthz` keeps being answered, and a cancelled batch still has a
record for every episode. The measure is an ordering, not a time: how many `/healthz`
answers arrive while the big request is in flight (a blocked event loop answers none)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.integration.service_util import Service

EPISODES = 30_000


async def answered_during(base: str, request: Callable[[], Awaitable[Any]]) -> tuple[int, Any]:
    """(/healthz answers received while `request` was in flight, its result)."""
    done = asyncio.Event()
    count = 0

    async def probe() -> None:
        nonlocal count
        async with aiohttp.ClientSession() as s:
            while not done.is_set():
                async with s.get(base + "/healthz") as r:
                    await r.read()
                if not done.is_set():
                    count += 1
                await asyncio.sleep(0.002)

    prober = asyncio.create_task(probe())
    await asyncio.sleep(0.05)  # the prober is connected and running
    count = 0
    try:
        result = await request()
    finally:
        done.set()
        await prober
    return count, result


async def test_big_submit_junk_body_and_big_cancel_do_not_stall_the_service(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    url, _ = spawn_fake(delay=0.5)
    svc = Service(tmp_path, tiny_model, [url], "--env", "arith", "--concurrency", "8")
    base = svc.start()
    try:
        async with aiohttp.ClientSession() as s:

            async def call(method: str, path: str, body: bytes | None = None) -> Any:
                async with s.request(method, base + path, data=body) as r:
                    return r.status, orjson.loads(await r.read())

            tasks = [{"id": f"t{i}", "question": f"What is {i} + 1?", "answer": str(i + 1)}
                     for i in range(EPISODES)]  # fmt: skip
            body = orjson.dumps({"env": "arith", "tasks": tasks, "batch_id": "big"})
            n_submit, (status, doc) = await answered_during(
                base, lambda: call("POST", "/v1/rollouts", body)
            )
            assert status == 201 and doc["episodes"] == EPISODES, doc

            junk = b'{"env": "arith", "tasks": [' + b",".join([b"1"] * 4_000_000) + b"]}"
            n_junk, (status, doc) = await answered_during(
                base, lambda: call("POST", "/v1/rollouts", junk)
            )
            assert status == 400 and "tasks.0: Input should be a valid dictionary" in doc["error"]

            n_cancel, (status, doc) = await answered_during(
                base, lambda: call("DELETE", "/v1/rollouts/big")
            )
            assert status == 200 and doc["state"] == "cancelled"
            while (doc := (await call("GET", "/v1/rollouts/big"))[1])["counts"]["running"]:
                await asyncio.sleep(0.1)
        # Every episode has its record: none was lost to the cancel.
        counts = doc["counts"]
        assert doc["finished"] == EPISODES == sum(counts[k] for k in counts if k != "running")
        assert counts["aborted"] > EPISODES - 100
        print("healthz answers during submit, junk, cancel:", n_submit, n_junk, n_cancel)
        assert min(n_submit, n_junk, n_cancel) >= 20, (n_submit, n_junk, n_cancel)
    finally:
        svc.close()
