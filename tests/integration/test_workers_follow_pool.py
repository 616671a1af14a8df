"""Rollout workers follow the front's endpoint pool (#22, `libra train` with
`rollout.workers > 1`): the front's pool is the one that changes (engines join and
leave, weights are published) while the workers make every call. Against fake vLLM
servers on loopback (only the model is scripted)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from libra.endpoints.config import BucketConfig, EndpointConfig, SamplingConfig
from libra.endpoints.pool import EndpointPool
from libra.record import Trajectory
from libra.rollout.batch import run_episodes
from libra.rollout.config import LimitsConfig
from libra.rollout.run import make_policy
from libra.rollout.serving import resolve_serving
from libra.rollout.tasks import episode_specs, load_tasks
from libra.rollout.worker import HostedEnv, WorkerInit
from libra.rollout.worker_runners import ParsedRunner
from libra.rollout.workers import BatchInfo, WorkerPool, split_limits, worker_buckets
from tests.conftest import ROOT


async def served(url: str) -> int:
    """Completions the fake server at `url` has answered."""
    async with aiohttp.ClientSession() as s, s.get(f"{url}/_log") as r:
        return len(await r.json())


async def test_workers_follow_joins_drains_removals_and_versions(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    slow, _ = spawn_fake(delay=0.3)
    fresh, _ = spawn_fake()
    held, _ = spawn_fake()  # joins paused (a restarted engine waiting for weights)
    endpoint = EndpointConfig(backoff_s=0.01, health_interval_s=0.1, down_wait_s=5)
    serving = resolve_serving(str(tiny_model), None, [BucketConfig(name="tp1")])
    tasks = load_tasks(ROOT / "examples/data/arith-train.jsonl", 8)
    sampling = SamplingConfig(max_tokens=40)
    policy = make_policy("cmlfq", serving.buckets, {})
    records: list[Trajectory] = []

    async with EndpointPool([(b, [slow]) for b in serving.buckets], endpoint,
                            joined_later=True) as pool:  # fmt: skip
        pool.set_version(3)

        def init() -> WorkerInit:
            eps = pool.endpoints()
            return WorkerInit(
                model=str(tiny_model), max_context=serving.max_context,
                buckets=worker_buckets(pool), endpoint=split_limits(endpoint, 2),
                limits=LimitsConfig(), envs=[HostedEnv(name="arith", spec="arith")],
                policy="cmlfq", versions={e.url: e.version for e in eps},
                paused=[e.url for e in eps if not e.admitting], joined_later=True,
            )  # fmt: skip

        async with WorkerPool(2, init) as workers:
            pool.followers.append(workers)
            info = BatchInfo("train", "arith", sampling.model_dump(mode="json"))
            runner = ParsedRunner(workers.runner(info, policy), policy)

            async def batch(name: str) -> None:
                specs = list(episode_specs(tasks, 2, name))
                await run_episodes(runner, specs, concurrency=16, emit=records.append)

            await batch("v0")  # every call on the slow server, its weights as told at init
            first = list(records)
            running = asyncio.create_task(batch("v1"))
            while await served(slow) <= sum(len(r.turns) for r in first):
                await asyncio.sleep(0.05)  # until the second batch's calls are under way
            await pool.add_endpoint("tp1", fresh, version=4)
            await pool.add_endpoint("tp1", held, version=0, admitting=False)
            left = await pool.drain(slow, 30)
            after_drain = await served(slow)
            await pool.remove_endpoint(slow)
            await running
            await asyncio.sleep(0.6)  # twice the slow server's delay
            assert await served(slow) == after_drain  # no call was running there, none came
            pool.set_version(5, [fresh])
            records.clear()
            await batch("v2")
            v2 = list(records)
            assert await served(held) == 0  # the workers took it in paused
            await pool.set_admitting(held, True)
            pool.set_version(5, [held])
            records.clear()
            await batch("v3")

    assert left == 0
    assert all(r.status == "ok" for r in first) and len(first) == 16
    assert {t.endpoint for r in first for t in r.turns} == {slow}
    assert {t.policy_version for r in first for t in r.turns} == {3}
    assert {r.batch_id for r in first} == {"v0"}  # the spec's, not the worker batch's
    # After the drain and removal, every turn went to the endpoint that joined, stamped
    # with the version the front set on it.
    assert len(v2) == 16 and all(r.status == "ok" for r in v2), [(r.status, r.error) for r in v2][
        :3
    ]
    assert {(t.endpoint, t.policy_version) for r in v2 for t in r.turns} == {(fresh, 5)}
    # Once admitted, the paused endpoint takes turns from the workers too.
    assert {t.endpoint for r in records for t in r.turns} == {fresh, held}


async def test_a_hung_worker_is_killed_and_its_episodes_run_again(
    tmp_path: Path, tiny_model: Path, spawn_fake, capfd
) -> None:
    """A worker whose event loop stops (SIGSTOP here; in life a sync call that never
    returns) is killed once it has answered nothing for `hang_s`; its episodes run
    again on the other worker and its replacement."""
    import os
    import re
    import signal

    url, _ = spawn_fake(delay=0.1)
    endpoint = EndpointConfig(backoff_s=0.01, health_interval_s=0.1, down_wait_s=5)
    serving = resolve_serving(str(tiny_model), None, [BucketConfig(name="tp1")])
    tasks = load_tasks(ROOT / "examples/data/arith-train.jsonl", 16)
    policy = make_policy("static", serving.buckets, {})
    records: list[Trajectory] = []
    stopped: list[int] = []

    async with EndpointPool([(b, [url]) for b in serving.buckets], endpoint) as pool:

        def init() -> WorkerInit:
            return WorkerInit(
                model=str(tiny_model), max_context=serving.max_context,
                buckets=worker_buckets(pool), endpoint=split_limits(endpoint, 2),
                limits=LimitsConfig(), envs=[HostedEnv(name="arith", spec="arith")],
                policy="static",
            )  # fmt: skip

        async with WorkerPool(2, init, hang_s=2.0) as workers:
            info = BatchInfo("b", "arith", SamplingConfig(max_tokens=40).model_dump(mode="json"))
            runner = ParsedRunner(workers.runner(info, policy), policy)

            def emit(r: Trajectory) -> None:
                records.append(r)
                if len(records) == 8:
                    stopped.append(workers.pids()[0])
                    os.kill(stopped[0], signal.SIGSTOP)

            specs = list(episode_specs(tasks, 4, "v0"))
            await run_episodes(runner, specs, concurrency=32, emit=emit)

    assert stopped
    assert len(records) == 64 and len({r.id for r in records}) == 64
    assert all(r.status == "ok" for r in records), {r.status for r in records}
    err = capfd.readouterr().err
    assert re.search(rf"rollout worker \d \(pid {stopped[0]}\) answered nothing for \d+ s: "
                     "killed as hung", err), err  # fmt: skip
    assert re.search(rf"\(pid {stopped[0]}\) exited with -9; its [1-9]\d* running", err), err
