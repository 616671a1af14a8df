"""A rollout-side layout change on a live fleet of real embedded engines: core
instances are drained, stopped and restarted in another bucket (an embedded engine's TP
size is a label; the sequence is the one a vLLM fleet runs at real TP sizes) while
episodes keep calling every bucket and new weights are published meanwhile."""

from __future__ import annotations

import asyncio
import itertools
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from libra.chat import ChatTokenizer
from libra.cluster.engines import EmbeddedLauncher, Engine
from libra.cluster.placement import Placement
from libra.endpoints.config import EndpointConfig
from libra.endpoints.pool import EndpointPool
from libra.routing.base import Bucket
from libra.train.planning import FleetShape, SwitchCosts
from libra.train.reconfig import Reconfigurer
from libra.train.relayout import relayout
from libra.train.state import LoopState
from libra.train.workers import Fleet, Worker
from libra.weights import FolderSync, Weights

TP = {"short": 1, "long": 2}


async def turn(pool: EndpointPool, bucket: str, prompt: list[int]) -> dict[str, Any]:
    served = await pool.generate(bucket, prompt, max_tokens=6, temperature=0.0, top_p=1.0)
    return {
        "bucket": bucket,
        "version": served.version,
        "tokens": served.completion.token_ids,
        "url": served.endpoint.url,
    }


async def test_relayout_drains_restarts_and_loses_no_episode(
    tiny_model: Path, tmp_path: Path
) -> None:
    from libra.engine.model_maker import make_model

    newer = make_model(tmp_path / "v1", seed=1)  # the weights published mid-change
    prompt = ChatTokenizer(tiny_model).encode("What is 2+3?")
    pool = EndpointPool([(Bucket(b, tp, 4096), []) for b, tp in TP.items()],
                        EndpointConfig(down_wait_s=5.0), joined_later=True)  # fmt: skip

    async def trainer_half(path: str) -> None:  # stands for the trainer writing version 1
        await asyncio.to_thread(shutil.copytree, newer, path)

    weights = FolderSync(write=trainer_half, root=tmp_path / "weights", keep=2, pool=pool,
                         kind="embedded", origin=Weights(0, str(tiny_model)))  # fmt: skip
    workers = [
        Worker("rollout0", "core-rollout", "rollout", "short"),
        Worker("rollout1", "core-rollout", "rollout", "long"),
        Worker("rollout2", "core-rollout", "rollout", "long"),
    ]
    fleet = Fleet(workers, launcher=EmbeddedLauncher(), placement=Placement("cpu"),
                  weights=weights, bucket_tp=TP, log_dir=tmp_path / "logs")  # fmt: skip
    events: list[dict[str, Any]] = []
    try:
        async with pool:
            await fleet.start()
            ref = {0: (await turn(pool, "short", prompt))["tokens"]}
            done = asyncio.Event()
            empty: list[str] = []
            seen: dict[str, Engine] = {}

            async def episode(i: int) -> list[dict[str, Any]]:
                turns = []
                for n in itertools.count():
                    turns.append(await turn(pool, ("short", "long")[(i + n) % 2], prompt))
                    if done.is_set() and n >= 3:
                        return turns
                    await asyncio.sleep(0.01)
                raise AssertionError("unreachable")

            async def watch() -> None:
                # every bucket keeps a registered server that is not being retired (a
                # weight update pauses each one briefly: its turns wait, as always)
                while not done.is_set():
                    seen.update((w.id, w.engine) for w in fleet.workers if w.engine)
                    for b in TP:
                        registered = {e.url for e in pool.endpoints(b)}
                        serving = [
                            w
                            for w in fleet.workers
                            if w.role == "rollout" and w.engine and w.engine.url in registered
                        ]
                        if not serving:
                            empty.append(b)
                    await asyncio.sleep(0.005)

            def note(event: str, **fields: Any) -> None:
                events.append({"event": event, **fields})

            shape = FleetShape(3, 1, 0, buckets=tuple(TP.items()), layout=(1, 2))
            state = LoopState(costs=SwitchCosts(10.0, 10.0))
            reconfig = Reconfigurer(
                replanner=SimpleNamespace(shape=shape, current=None),  # type: ignore[arg-type]
                fleet=fleet, trainer=None,  # type: ignore[arg-type]
                state=state, report=SimpleNamespace(event=note),  # type: ignore[arg-type]
                view=SimpleNamespace(switches=0),  # type: ignore[arg-type]
                steps=10, decode_slots=64, bucket="short",
            )  # fmt: skip

            async def change() -> list[dict[str, Any]]:
                await asyncio.sleep(0.3)
                narrow = asyncio.create_task(relayout(fleet, {"short": 3, "long": 1}, note))
                await asyncio.sleep(0.2)  # a publication while instances stop and start
                await weights.publish(1)
                took = [await narrow]
                await asyncio.sleep(0.3)
                # and back, the way the training loop applies a chosen layout
                await reconfig.relayout((1, 2))
                took.append(events[-1])
                await asyncio.sleep(0.3)
                done.set()
                return took

            async with asyncio.TaskGroup() as tg:
                runs = [tg.create_task(episode(i)) for i in range(8)]
                tg.create_task(watch())
                took = await tg.create_task(change())
            ref[1] = (await turn(pool, "long", prompt))["tokens"]

            assert took[0]["steps"] == ["-long", "+short", "+short"]  # one TP-2 -> two TP-1
            assert took[1]["steps"] == ["-short", "-short", "+long"]  # and back
            assert took[1]["event"] == "relayout-done"
            starts = [e for e in events if e["event"] == "relayout-start"]
            assert starts == [{"event": "relayout-start", "have": {"short": 3, "long": 1},
                               "want": {"short": 1, "long": 2}}]  # fmt: skip
            # the planner's restart cost is now the one this change measured
            assert state.costs.restart_s == took[1]["restart_s"] > 0
            assert state.switches == 1
            assert empty == []  # no bucket was ever left without a server
            layout = [w.bucket or "" for w in fleet.workers if w.kind == "core-rollout"]
            assert sorted(layout) == ["long", "long", "short"]
            assert all(w.engine is not None and w.role == "rollout" for w in fleet.workers)
            assert {e.version for e in pool.endpoints()} == {1}

            # every stopped instance's engine process is gone
            stopped = {e["worker"] for e in events if e["event"] == "instance-stopped"}
            assert len(stopped) == 3
            for name in stopped:
                assert seen[name].process.returncode is not None

            # no episode lost, and every turn ran on the weights its stamp names
            turns = [t for r in runs for t in r.result()]
            assert all(len(r.result()) >= 4 for r in runs)
            assert ref[0] != ref[1]
            assert {t["version"] for t in turns} == {0, 1}
            for t in turns:
                assert t["tokens"] == ref[t["version"]], t
            # the instances started during the change served turns, at the new version
            started = {e["worker"] for e in events if e["event"] == "instance-started"}
            new_urls = {w.engine.url for w in fleet.workers if w.id in started and w.engine}
            assert {t["version"] for t in turns if t["url"] in new_urls} == {1}
            assert len(started) == 3 and new_urls
            assert all(
                e["version"] == 1 for e in events if e["event"] == "instance-started"
            )  # registered at the version loaded (the publication ran during the start)
            # ... and each names its node (one machine: `local`; Ray: the node id)
            assert {e["node"] for e in events if e["event"] == "instance-started"} == {"local"}
    finally:
        await fleet.close()
