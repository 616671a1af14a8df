"""Engines a job launched are kept serving (`libra.rollout.supervise.EngineWatch`): one
that dies is restarted and joins with the weights the others serve. Real engines, the
real service over HTTP, the real `arith` env; the lost engine is SIGKILLed."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from libra.envs.arith import make_tasks

from libra.client import AsyncClient
from libra.cluster.engines import Launched
from libra.endpoints.config import EndpointConfig
from libra.endpoints.pool import EndpointPool
from libra.rollout.supervise import EngineWatch
from libra.routing.base import Bucket
from tests.integration.procs import engine_on, wait_gone
from tests.integration.service_util import Service


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _wait_for(pattern: str, text: Callable[[], str], timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, text())
        if m:
            return m
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout:g} s: {text()[-3000:]}")


@pytest.mark.timeout(400)
async def test_a_killed_engine_is_restarted_with_the_weights_the_service_loaded(
    tmp_path: Path, tiny_model: Path
) -> None:
    """`serve-rollout --launch 2`: after `POST /v1/weights` (version 3, another
    checkpoint), one engine is SIGKILLed. The service restarts it, loads version 3 into
    it before it serves, and its greedy answers are the survivor's."""
    from libra.engine.model_maker import make_model

    ckpts = tmp_path / "ckpts"
    other = make_model(ckpts / "step-3", seed=1)
    svc = Service(tmp_path, tiny_model, [], "--launch", "2", "--env", "arith",
                  "--weights-dir", str(ckpts),
                  config="[sampling]\ntemperature = 0.0\nmax_tokens = 24\n")  # fmt: skip
    svc.start(timeout=240)
    try:
        tasks = make_tasks(8, seed=5)
        async with AsyncClient(svc.url) as c:
            doc = await c.update_weights(3, str(other))
            urls = sorted(doc["endpoints"])
            assert len(urls) == 2 and all(r["status"] == "ok" for r in doc["endpoints"].values())
            before = [r async for r in c.trajectories(await c.submit("arith", tasks))]
            answers = {r.task_id: r.response_token_ids for r in before}
            assert {t.policy_version for r in before for t in r.turns} == {3}

            lost = engine_on(_port(urls[0]))
            assert lost is not None
            os.kill(lost, signal.SIGKILL)
            m = await asyncio.to_thread(
                _wait_for, r"engine (\S+) restarted at (\S+), serving version (\d+)",
                svc.log, 120,
            )  # fmt: skip
            new_url = m.group(2).rstrip(",")
            assert m.group(3) == "3", svc.log()[-3000:]
            assert "exited with code -9 while serving" in svc.log()
            assert new_url not in urls and engine_on(_port(new_url)) is not None
            assert wait_gone(lost)

            # The replacement serves (both engines do), at version 3, the same greedy
            # answers as before the loss: it holds the loaded checkpoint.
            after = [r async for r in c.trajectories(await c.submit("arith", tasks, group_size=2))]
            assert not [r.error for r in after if r.status == "error"]  # none lost a turn
            served = {t.endpoint for r in after for t in r.turns}
            assert served == {urls[1], new_url}, served
            on_new = [r for r in after if {t.endpoint for t in r.turns} == {new_url}]
            assert on_new, "no episode ran on the replacement alone"
            assert {t.policy_version for r in after for t in r.turns} == {3}
            assert all(r.response_token_ids == answers[r.task_id] for r in on_new)
        with urllib.request.urlopen(f"{svc.url}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert re.search(r"^libra_engine_restarts_total 1\.0$", metrics, re.M), metrics
        replacement = engine_on(_port(new_url))
    finally:
        code = svc.stop()
    assert code == 0, svc.log()[-3000:]
    assert replacement is None or wait_gone(replacement), "the replacement outlived the service"


async def test_a_replacement_waits_paused_for_weights_only_a_trainer_holds(
    tmp_path: Path, tiny_model: Path
) -> None:
    """When the latest update came by broadcast, the restarted engine cannot load it:
    it joins its bucket paused (no turn goes to it, at version 0) and is admitted once an
    update reaches it. An engine a broadcast left half-updated is replaced too."""
    lines: list[str] = []
    launched = Launched(tiny_model, {"tp1": 1}, log_dir=tmp_path)
    async with launched as started:
        (url,) = started["tp1"]
        bucket = Bucket("tp1", 1, 2048)
        async with EndpointPool([(bucket, [url])], EndpointConfig()) as pool:
            watch = EngineWatch(interval_s=0.2, say=lines.append)
            async with watch.lock:  # as a broadcast update leaves it
                await watch.loaded(pool, [url], 5, None)
            pool.set_version(5, [url])
            async with watch.running(launched, pool):
                lost = engine_on(_port(url))
                assert lost is not None
                os.kill(lost, signal.SIGKILL)
                deadline = time.monotonic() + 120
                while not any("restarted" in x for x in lines) and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert any("paused until the next weight update" in x for x in lines), lines
                (ep,) = pool.endpoints("tp1")
                assert ep.url != url and not ep.admitting and ep.version == 0
                assert watch.held == {ep.url}

                async with watch.lock:  # the next update reaches it
                    await watch.loaded(pool, [ep.url], 6, None)
                assert ep.admitting and not watch.held
                assert any(f"engine at {ep.url} admitted" in x for x in lines), lines

                # A broadcast that fails halfway into it (the update takes it out of the
                # pool): it runs, but is no longer trusted, and is replaced all the same.
                half = engine_on(_port(ep.url))
                await pool.remove_endpoint(ep.url)
                watch.condemn(ep.url, "version 7 failed halfway")
                while sum("restarted" in x for x in lines) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert half is not None and wait_gone(half), "the untrusted engine runs on"
                (again,) = pool.endpoints("tp1")
                assert again.url not in (url, ep.url) and not again.admitting, lines
                assert any("version 7 failed halfway; restarting it" in x for x in lines)


async def test_engine_logs_are_kept_only_when_something_went_wrong(tiny_model: Path) -> None:
    """Without a log folder a job's engines log to a temporary one: gone after a clean
    run (a long-lived service starts many jobs), kept after one that raised, whose error
    may name a log in it."""
    launched = Launched(tiny_model, {"tp1": 1})
    async with launched:
        assert (launched.log_dir / "engine-tp1-0.log").is_file()
    assert not launched.log_dir.exists()

    launched = Launched(tiny_model, {"tp1": 1})
    with pytest.raises(RuntimeError, match="the job failed"):
        async with launched:
            raise RuntimeError("the job failed")
    try:
        assert "serving" in (launched.log_dir / "engine-tp1-0.log").read_text()
    finally:
        shutil.rmtree(launched.log_dir, ignore_errors=True)
