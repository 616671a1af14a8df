"""`libra bench control-plane --workers 1,2`: the 10,000-in-flight run of the control-plane
bench with its episodes in N rollout worker processes (`libra.rollout.workers`, the path
of `libra rollout --workers N` and `libra serve-rollout --workers N`), figures comparable
with the in-process run (N = 1) of the same invocation.

Per run: turns/s; CPU per turn of Libra (the front and its workers) and of the instant
server (a separate process that shares the cores); event-loop lag of the front and of
each worker; the workers' full GC passes; whether every episode completed `ok`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

from libra.bench.lag import LagMonitor
from libra.endpoints.config import BucketConfig, EndpointConfig, SamplingConfig
from libra.rollout.batch import run_episodes
from libra.rollout.config import LimitsConfig
from libra.rollout.sink import JsonlSink
from libra.rollout.tasks import episode_specs
from libra.rollout.worker import HostedEnv, WorkerInit
from libra.rollout.workers import BatchInfo, WorkerPool, split_limits
from libra.routing.base import Bucket, StaticPolicy

ENV = "libra.bench.control_plane:NoopEnv"
_TICK = os.sysconf("SC_CLK_TCK")
PER_WORKER = ("loop_lag_p50_ms", "loop_lag_p99_ms", "loop_lag_max_ms", "full_gc_passes",
              "rss_peak_mb")  # fmt: skip


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


async def worker_turns(
    url: str, model: Path, workers: int, episodes: int, turns: int, out: Path
) -> dict[str, Any]:
    """`episodes` episodes all in flight x `turns` turns in `workers` worker processes."""
    bucket = Bucket("tp1", 1, 4096)
    init = WorkerInit(
        model=str(model),
        max_context=bucket.bound,
        buckets=[BucketConfig(name="tp1", tp=1, bound=bucket.bound, endpoints=[url])],
        endpoint=split_limits(EndpointConfig(max_inflight=512), workers),
        limits=LimitsConfig(max_turns=turns + 1),
        envs=[HostedEnv(name="bench-noop", spec=ENV)],
        policy="static",
        monitor=True,
    )
    status: dict[str, int] = {}
    tasks = [{"id": f"b{i}"} for i in range(episodes)]
    monitor = LagMonitor()
    sink = JsonlSink(out)

    def emit(rec: Any) -> None:
        sink(rec)
        status[rec.status] = status.get(rec.status, 0) + 1

    async with WorkerPool(workers, lambda: init) as pool:
        sampling = SamplingConfig(max_tokens=64).model_dump(mode="json")
        runner = pool.runner(BatchInfo("bench", "bench-noop", sampling), StaticPolicy([bucket]))
        before = {f["pid"]: f["cpu_s"] for f in await pool.monitor()}  # resets their monitors
        mon = asyncio.create_task(monitor.run())
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        try:
            specs = episode_specs(tasks, 1, "bench")
            await run_episodes(runner, specs, concurrency=episodes, emit=emit)
        finally:
            wall = time.perf_counter() - t0
            front_cpu = time.process_time() - cpu0
            mon.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await mon  # we cancelled it: its end is expected
            sink.close()
        after = await pool.monitor()
    n_turns = episodes * turns
    worker_cpu = sum(f["cpu_s"] - before.get(f["pid"], 0.0) for f in after)
    front = monitor.figures()
    return {
        "workers": workers,
        "episodes": episodes,
        "completed_ok": status.get("ok", 0),
        "status": status,
        "wall_s": wall,
        "turns_per_s": n_turns / wall,
        "cpu_us_per_turn": (front_cpu + worker_cpu) / n_turns * 1e6,
        "front_cpu_us_per_turn": front_cpu / n_turns * 1e6,
        "loop_lag_p50_ms": max(f["loop_lag_p50_ms"] for f in after),
        "loop_lag_p99_ms": max(f["loop_lag_p99_ms"] for f in after),
        "loop_lag_max_ms": max(f["loop_lag_max_ms"] for f in after),
        "full_gc_passes": sum(f["full_gc_passes"] for f in after),
        "front_loop_lag_p99_ms": front["loop_lag_p99_ms"],
        "front_loop_lag_max_ms": front["loop_lag_max_ms"],
        "per_worker": [
            {k: f[k] for k in PER_WORKER} | {"cpu_s": f["cpu_s"] - before.get(f["pid"], 0.0)}
            for f in after
        ],
    }


__all__ = ["proc_cpu_s", "worker_turns"]
