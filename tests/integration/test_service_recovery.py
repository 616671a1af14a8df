"""The issue's must-show: `libra serve-rollout` in a subprocess with two endpoints; a
client submits 200 episodes; one endpoint is killed mid-batch; the service is killed
(SIGKILL) and restarted once mid-batch; the client receives every record exactly once,
resuming by cursor, and the batch completes. With `--workers 2` (#22) a rollout worker
is killed mid-batch too. Only the model is faked (tests/fakes)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from libra.envs.arith import make_tasks

from libra.client import AsyncClient
from libra.record import read_jsonl
from tests.integration.service_util import Service

TOKEN = "test-token-7f3a"


@pytest.fixture
def services() -> Iterator[list[Service]]:
    made: list[Service] = []
    yield made
    for s in made:
        s.close()


def worker_pids(log: str) -> dict[int, int]:
    """Rollout workers the service said it started: {worker: pid}, the last of each."""
    found = re.findall(r"rollout worker (\d+) started \(pid (\d+)\)", log)
    return {int(w): int(pid) for w, pid in found}


@pytest.mark.parametrize("workers", [1, 2])
async def test_kill_endpoint_and_service_mid_batch_loses_and_repeats_nothing(
    tmp_path: Path, tiny_model: Path, spawn_fake, services: list[Service], workers: int
) -> None:
    url1, fake1 = spawn_fake(delay=0.05)
    url2, _ = spawn_fake(delay=0.05)
    svc = Service(tmp_path, tiny_model, [url1, url2], "--token", TOKEN, "--concurrency", "16",
                  "--workers", str(workers))  # fmt: skip
    services.append(svc)
    svc.start()
    tasks = make_tasks(50, seed=3)
    expected = {f"b200/{t['id']}/{k}" for t in tasks for k in range(4)}

    got: list[tuple[int, str, str, list[str]]] = []
    async with AsyncClient(svc.url, token=TOKEN, reconnect_s=60, backoff_max_s=0.3) as client:
        batch = await client.submit("arith", tasks, group_size=4, batch_id="b200")
        assert batch == "b200"
        async for rec in client.trajectories(batch):
            got.append((rec.seq, rec.id, rec.status, [t.endpoint for t in rec.turns]))
            if len(got) == 40:
                fake1.kill()  # one endpoint dies mid-batch
            if len(got) == 60 and workers > 1:
                os.kill(worker_pids(svc.log())[1], signal.SIGKILL)  # so does a worker
            if len(got) == 100:
                svc.kill()  # the service crashes mid-batch ...
                await asyncio.to_thread(svc.start)  # ... and comes back on its spool
        status = await client.status(batch)

    ids = Counter(r[1] for r in got)
    assert set(ids) == expected and max(ids.values()) == 1  # every record exactly once
    assert [r[0] for r in got] == list(range(200))  # in seq order, no gaps
    assert Counter(r[2] for r in got) == {"ok": 200}  # re-routed, re-run: nothing lost
    assert status["state"] == "done" and status["finished"] == 200
    assert status["counts"]["ok"] == 200 and status["counts"]["queued"] == 0
    # The restarted service found records of the batch and ran the rest again.
    m = re.search(r"resumed batch b200: (\d+) of 200 episodes to run again", svc.log(1))
    assert m and 0 < int(m.group(1)) <= 100, svc.log(1)  # 100 when nothing finished unread
    if workers > 1:  # the killed worker was replaced; its episodes ran again
        assert re.search(r"rollout worker 1 \(pid \d+\) exited with -9; its \d+ running "
                         r"episodes run again", svc.log(0)), svc.log(0)  # fmt: skip
        assert len(worker_pids(svc.log(1))) == 2
    # After the endpoint died, only the survivor served.
    assert {e for r in got[:30] for e in r[3]} == {url1, url2}
    assert {e for r in got[-60:] for e in r[3]} == {url2}
    # The spool holds each episode once, line k = seq k.
    spooled = read_jsonl(tmp_path / "spool" / "b200" / "records.jsonl")
    assert [r.seq for r in spooled] == list(range(200))
    assert {r.id for r in spooled} == expected


@pytest.mark.parametrize(("on_restart", "workers"), [("rerun", 1), ("abort", 1), ("rerun", 2)])
async def test_graceful_stop_then_restart(
    tmp_path: Path,
    tiny_model: Path,
    spawn_fake,
    services: list[Service],
    on_restart: str,
    workers: int,
) -> None:
    """SIGTERM mid-batch: the service exits 0 promptly, records nothing for the episodes
    it interrupted, and after a restart they run again (`rerun`) or are recorded
    `aborted` (`abort`); either way each id arrives once and the batch completes."""
    url, _ = spawn_fake(delay=0.2)
    svc = Service(tmp_path, tiny_model, [url], "--concurrency", "4", "--on-restart", on_restart,
                  "--workers", str(workers))  # fmt: skip
    services.append(svc)
    svc.start()
    tasks = make_tasks(16, seed=4)
    got = []
    async with AsyncClient(svc.url, reconnect_s=60, backoff_max_s=0.3) as client:
        batch = await client.submit("arith", tasks, group_size=2, batch_id="g")
        async for rec in client.trajectories(batch):
            got.append(rec)
            if len(got) == 2:
                assert await asyncio.to_thread(svc.stop) == 0
                await asyncio.to_thread(svc.start)
    assert [r.seq for r in got] == list(range(32))
    assert len({r.id for r in got}) == 32
    m = re.search(
        r"resumed batch g: (\d+) of 32 episodes to (run again|record aborted)", svc.log(1)
    )
    assert m and int(m.group(1)) > 0, svc.log(1)
    assert "Traceback" not in svc.log(0)
    statuses = Counter(r.status for r in got)
    if on_restart == "rerun":
        assert statuses == {"ok": 32}
    else:
        assert statuses == {"ok": 32 - int(m.group(1)), "aborted": int(m.group(1))}
        assert {r.error for r in got if r.status == "aborted"} == {
            "the service restarted before the episode finished"
        }
        assert all(r.seq >= 2 for r in got if r.status == "aborted")
