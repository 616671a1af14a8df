"""The spool's disk fills up under a running `libra serve-rollout` (here: a file size
limit set on the process, which makes its writes fail as a full disk does). Before, the
failed write left the episode's task group and the whole service exited, losing the
episodes in flight. Now the finished records wait in memory, no episode starts, submits
get a 507 (which a patient client retries) and `/healthz` says `degraded`; once the disk
takes writes again every record is written, each once, in order, the batch completes
and the waiting submit gets in."""

from __future__ import annotations

import asyncio
import json
import resource
import urllib.request
from pathlib import Path

import pytest
from libra.envs.arith import make_tasks

from libra.client import AsyncClient, ServiceError
from tests.integration.service_util import Service

LIMIT = 12_000
"""Bytes a file may grow to: the batch's request fits, its records do not."""


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/healthz", timeout=10) as r:
        return json.loads(r.read())


async def until(check, timeout: float = 60.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (out := await check()):
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.2)
    return out


@pytest.mark.timeout(240)
async def test_a_full_disk_holds_records_in_memory_and_loses_none(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    url, _ = spawn_fake()
    svc = Service(tmp_path, tiny_model, [url], "--env", "arith", config="concurrency = 4\n")
    base = svc.start()
    assert svc.proc is not None
    pid = svc.proc.pid
    try:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))
        async with AsyncClient(base, reconnect_s=60) as c:
            tasks = make_tasks(24, seed=3)
            batch = await c.submit("arith", tasks, group_size=2)

            async def degraded():
                h = await asyncio.to_thread(health, base)
                return h if h["status"] == "degraded" else None

            h = await until(degraded)
            # no token needed for /healthz: the reason, not the spool's path
            assert h["spool"] == "finished records cannot be written: File too large", h
            async with AsyncClient(base, reconnect_s=0) as impatient:
                with pytest.raises(ServiceError) as err:
                    await impatient.submit("arith", make_tasks(1, seed=4))
            assert err.value.status == 507 and "finished records wait in memory" in str(err.value)
            # a patient client retries a 507 (as a 429) and gets in once the disk takes it
            later = asyncio.create_task(c.submit("arith", make_tasks(1, seed=4), group_size=2))

            async def drained():  # episodes in flight finish; none starts
                s = await c.status(batch)
                return s if s["counts"]["running"] == 0 else None

            s = await until(drained)
            assert s["counts"]["queued"] > 0 and s["finished"] < 48
            await asyncio.sleep(2.5)  # past a retry: still nothing started
            again = await c.status(batch)
            assert again["counts"]["queued"] == s["counts"]["queued"]
            assert again["counts"]["running"] == 0

            resource.prlimit(pid, resource.RLIMIT_FSIZE,
                             (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # fmt: skip
            recs = [r async for r in c.trajectories(batch)]
            assert len(recs) == 48 and len({r.id for r in recs}) == 48
            assert [r.seq for r in recs] == list(range(48))
            assert {r.task_id for r in recs} == {t["id"] for t in tasks}
            assert health(base) == {"status": "ok"}
            assert (await c.status(batch))["state"] == "done"
            second = [r async for r in c.trajectories(await later)]
            assert len(second) == 2  # one task x group_size 2
        assert svc.proc.poll() is None  # the service never stopped
    finally:
        svc.close()
    lines = (svc.spool / batch / "records.jsonl").read_bytes().splitlines()
    assert len(lines) == 48 and [json.loads(x)["seq"] for x in lines] == list(range(48))
