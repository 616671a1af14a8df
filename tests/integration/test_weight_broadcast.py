"""Weights by broadcast (`libra.weights.BroadcastSync`) into real embedded engines on
loopback: what happens when an engine dies in the middle of a transfer."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
import pytest
from safetensors.torch import load_file

from libra.endpoints.config import BucketConfig
from libra.endpoints.pool import EndpointPool
from libra.engine.model_maker import make_model
from libra.errors import EndpointDown
from libra.transfer.local import LocalSender
from libra.weights import BroadcastSync, Weights
from tests.conftest import serve_engine_process

PROMPT = [10, 20, 30, 40]


async def greedy(url: str, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return list((await r.json())["choices"][0]["token_ids"])


@pytest.mark.timeout(240)
async def test_an_engine_that_dies_mid_broadcast_fails_that_publish_and_only_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Two engines; the second is killed after its transfer started (the sender kills it
    as it begins broadcasting to it). The publish raises one error naming that engine;
    the first engine has the new weights and keeps serving; the dead one left the pool;
    the next publish reaches the survivor."""
    s1 = make_model(tmp_path / "s1", seed=1)
    tensors = {0: load_file(str(tiny_model / "model.safetensors")),
               1: load_file(str(s1 / "model.safetensors"))}  # fmt: skip
    with serve_engine_process(tiny_model) as (a, _), serve_engine_process(tiny_model) as (b, pb):
        model = str(tiny_model)
        want = {0: await greedy(a, model)}
        now = {"v": 0}

        class KillsB(LocalSender):
            async def broadcast_send(self, gid: str, bucket_bytes: int) -> tuple[int, str | None]:
                if gid == b and pb.poll() is None:
                    pb.send_signal(signal.SIGKILL)
                    await asyncio.to_thread(pb.wait)
                return await super().broadcast_send(gid, bucket_bytes)

        sender = KillsB(lambda: tensors[now["v"] % 2], version=lambda: now["v"])
        bucket = BucketConfig(name="b", tp=1, bound=1024)
        async with EndpointPool([(bucket, [])], joined_later=True) as pool:
            sync = BroadcastSync(sender=sender, pool=pool, kind="embedded",
                                 origin=Weights(0, model), timeout_s=30)  # fmt: skip
            for url in (a, b):
                assert await sync.attach("b", url, sync.start_weights()) == 0
            now["v"] = 1
            with pytest.raises(EndpointDown) as err:
                await sync.publish(1)
            message = str(err.value)
            assert b in message and a not in message and "\n" not in message
            assert [(e.url, e.version) for e in pool.endpoints()] == [(a, 1)]
            assert [url for url, _ in sync.lost] == [b]
            want[1] = await greedy(a, model)
            assert want[1] != want[0]  # the survivor took the new weights

            now["v"] = 2  # seed 0 again, over the survivor's same group
            assert await sync.publish(2) >= 0
            assert await greedy(a, model) == want[0]
            assert [(e.url, e.version) for e in pool.endpoints()] == [(a, 2)]


@pytest.mark.timeout(240)
async def test_the_trainer_sends_its_own_weights(tiny_model: Path, tmp_path: Path) -> None:
    """`libra train`'s sender: rank 0 of core replica 0 (a real `ElasticTrainer`, here
    holding seed-1 weights) broadcasts into an engine serving seed 0; the engine then
    answers as one started from the seed-1 folder, and no folder was written."""
    from libra.train.handle import TrainerHandle
    from libra.trainer import ElasticTrainer, TrainerConfig

    s1 = make_model(tmp_path / "s1", seed=1)
    trainer = TrainerHandle(ElasticTrainer(TrainerConfig(model=str(s1))))
    before = set(tmp_path.rglob("*"))
    try:
        with serve_engine_process(tiny_model) as (a, _), serve_engine_process(s1) as (ref, _):
            await trainer.start()
            bucket = BucketConfig(name="b", tp=1, bound=1024)
            async with EndpointPool([(bucket, [])], joined_later=True) as pool:
                sync = BroadcastSync(sender=trainer, pool=pool, kind="embedded",
                                     origin=Weights(0, str(tiny_model)))  # fmt: skip
                await sync.attach("b", a, sync.start_weights())
                assert await greedy(a, str(tiny_model)) != await greedy(ref, str(s1))
                await sync.publish(1)
                assert await greedy(a, str(tiny_model)) == await greedy(ref, str(s1))
                assert [(e.url, e.version) for e in pool.endpoints()] == [(a, 1)]
    finally:
        await trainer.close()
    assert set(tmp_path.rglob("*")) == before


@pytest.mark.timeout(300)
async def test_the_fleet_replaces_an_engine_a_publication_lost(
    tiny_model: Path, tmp_path: Path
) -> None:
    """`libra train`'s path after a lost transfer: the publication raises
    `WeightsNotDelivered`, `Fleet.replace_lost` stops that engine and starts a new one
    on the same worker, which joins a new group and is registered at the published
    version with the published weights (it answers as the survivor does); a worker out
    of restarts stops the run in one line."""
    from libra.cluster.engines import EmbeddedLauncher
    from libra.cluster.placement import Placement
    from libra.errors import WeightsNotDelivered
    from libra.train.workers import Fleet, Worker

    s1 = make_model(tmp_path / "s1", seed=1)
    tensors = {0: load_file(str(tiny_model / "model.safetensors")),
               1: load_file(str(s1 / "model.safetensors"))}  # fmt: skip
    now = {"v": 0}
    workers = [Worker(f"rollout{i}", "core-rollout", "rollout", "b") for i in range(2)]
    victim = workers[1]

    class KillsVictim(LocalSender):
        async def broadcast_send(self, gid: str, bucket_bytes: int) -> tuple[int, str | None]:
            e = victim.engine
            if e is not None and gid == e.url and now["v"] in (1, 3):
                e.process.proc.kill()
                await asyncio.to_thread(e.process.proc.wait)
            return await super().broadcast_send(gid, bucket_bytes)

    sender = KillsVictim(lambda: tensors[now["v"] % 2], version=lambda: now["v"])
    bucket = BucketConfig(name="b", tp=1, bound=1024)
    events: list[tuple[str, dict]] = []
    async with EndpointPool([(bucket, [])], joined_later=True) as pool:
        sync = BroadcastSync(sender=sender, pool=pool, kind="embedded",
                             origin=Weights(0, str(tiny_model)), timeout_s=30)  # fmt: skip
        fleet = Fleet(workers, launcher=EmbeddedLauncher(), placement=Placement("cpu"),
                      weights=sync, bucket_tp={"b": 1}, log_dir=tmp_path / "logs",
                      restarts=1)  # fmt: skip
        try:
            await fleet.start()
            lost_url = victim.engine.url if victim.engine else ""
            now["v"] = 1
            with pytest.raises(WeightsNotDelivered) as err:
                await sync.publish(1)
            assert [u for u, _ in err.value.lost] == [lost_url]
            await fleet.replace_lost(err.value.lost, lambda e, **f: events.append((e, f)))
            assert victim.role == "rollout" and victim.engine is not None
            assert victim.engine.url != lost_url
            eps = {e.url: e.version for e in pool.endpoints()}
            assert eps == {workers[0].engine.url: 1, victim.engine.url: 1}  # type: ignore[union-attr]
            model = str(tiny_model)
            assert await greedy(victim.engine.url, model) == await greedy(
                workers[0].engine.url,  # type: ignore[union-attr]
                model,
            )
            assert [e for e, _ in events] == ["engine-lost", "engine-restarted"]

            now["v"] = 3  # dies again: its one restart is used up
            with pytest.raises(WeightsNotDelivered) as err:
                await sync.publish(3)
            with pytest.raises(EndpointDown, match="no restart left"):
                await fleet.replace_lost(err.value.lost, None)
        finally:
            await fleet.close()


async def test_the_engine_refuses_a_malformed_update_in_one_line(tiny_model: Path) -> None:
    """The weight-transfer routes validate what they are sent: an unknown dtype, a bad
    shape, phases out of order are 400s naming the problem; what a web page sends is a
    403; the engine keeps serving."""
    with serve_engine_process(tiny_model) as (a, _):
        async with aiohttp.ClientSession() as s:

            async def post(path: str, body: dict) -> tuple[int, str]:
                async with s.post(f"{a}{path}", json=body) as r:
                    return r.status, await r.text()

            info = {"names": ["x"], "dtype_names": ["float32"], "shapes": [[2]]}
            code, text = await post("/update_weights", {"update_info": info})
            assert code == 400 and "start_weight_update first" in text
            code, text = await post("/start_weight_update", {})
            assert code == 400 and "init_weight_transfer_engine" in text
            bad = {**info, "dtype_names": ["load"]}
            code, text = await post("/update_weights", {"update_info": bad})
            assert code == 400 and "dtype 'load'" in text
            bad = {**info, "shapes": [[-1]]}
            code, text = await post("/update_weights", {"update_info": bad})
            assert code == 400 and "non-negative" in text
            code, text = await post("/init_weight_transfer_engine", {"init_info": {}})
            assert code == 400 and "master_address" in text
            # The engine has no token: a web page (an Origin), or one that rebound its
            # own name to 127.0.0.1 (its Host), must not swap the served weights.
            port = a.rsplit(":", 1)[1]
            for headers, says in (
                ({"Origin": "http://attacker.example"}, "cross-site request"),
                ({"Host": f"rebind.test:{port}"}, "loopback name"),
            ):
                async with s.post(f"{a}/v1/load_weights", json={"path": str(tiny_model)},
                                  headers=headers) as r:  # fmt: skip
                    assert r.status == 403 and says in await r.text()
        assert await greedy(a, str(tiny_model))
