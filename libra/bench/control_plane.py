"""Control-plane overhead: latency Libra adds per turn, and 10,000 episodes in flight.

Against an OpenAI-compatible server on loopback, in a separate process, that answers
instantly (`libra.bench.instant_server`), with a one-tool env whose tool does nothing:
(a) the latency Libra adds per turn over a bare HTTP call of the same request, at
concurrency 1 and 100 (goal <= 1 ms at p50); (b) `--episodes` episodes (default 10,000)
all in flight at once x `--turns` turns: turns/s, event-loop lag p99 (goal <= 50 ms)
and max, the garbage collector's full passes (count, longest; `run_sync` sets the
thresholds, reported) and its longest young pass, RSS per in-flight episode, and
whether every episode completed; (c) with `--workers 1,2`, part (b) once per worker count
in the same invocation (N > 1: N rollout worker processes, `libra.bench.scaling`), with
turns/s over the first count's, CPU per turn of Libra and of the instant server (it
shares the cores), and each process's loop lag.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

import libra
from libra.bench import instant_server
from libra.bench.lag import LagMonitor, percentile, rss_mb
from libra.bench.scaling import proc_cpu_s, worker_turns
from libra.chat import ChatTokenizer
from libra.cli.common import count
from libra.endpoints.client import completion_body
from libra.endpoints.config import EndpointConfig, SamplingConfig
from libra.endpoints.pool import EndpointPool
from libra.errors import ConfigError
from libra.rollout.batch import run_episodes
from libra.rollout.config import LimitsConfig
from libra.rollout.episode import EpisodeRunner
from libra.rollout.run import run_sync
from libra.rollout.sink import JsonlSink
from libra.rollout.tasks import episode_specs
from libra.routing.base import Bucket, StaticPolicy


@libra.tool
async def noop(x: int) -> str:
    """Do nothing."""
    return "ok"


class NoopEnv(libra.Env):
    tools = [noop]
    max_turns = 16

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"Task {task['id']}: call noop, then answer."}]

    async def reward(self, task: dict[str, Any], trajectory: libra.Trajectory) -> float:
        return float(trajectory.answer == "42")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--episodes", type=count, default=10_000, help="episodes in flight at once")
    p.add_argument("--turns", type=count, default=4, help="model turns per episode")
    p.add_argument("--latency-turns", type=count, default=2000, help="turns per latency sample")
    p.add_argument("--model", help="model folder for the tokenizer (default: a fresh tiny one)")
    p.add_argument("--workers", default="1", metavar="N,N,...",
                   help="run the in-flight part once per worker count (1: in this process; "
                   "N > 1: N rollout worker processes), e.g. 1,2; turns/s ratios to 1")  # fmt: skip
    p.add_argument("--rounds", type=count, default=1,
                   help="repeat the worker counts, alternated, this many times")  # fmt: skip


async def _bare_latency(url: str, body: bytes, concurrency: int, calls: int) -> list[float]:
    lat: list[float] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def worker(n: int) -> None:
            for _ in range(n):
                t = time.perf_counter()
                async with s.post(
                    f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                lat.append(time.perf_counter() - t)

        per = max(1, calls // concurrency)
        async with asyncio.TaskGroup() as tg:
            for _ in range(concurrency):
                tg.create_task(worker(per))
    return lat


def _runner(tok: ChatTokenizer, pool: EndpointPool, turns: int) -> EpisodeRunner:
    bucket = pool.buckets[0]
    return EpisodeRunner(
        env=NoopEnv(),
        env_name="bench-noop",
        tokenizer=tok,
        pool=pool,
        policy=StaticPolicy([bucket]),
        sampling=SamplingConfig(max_tokens=64),
        limits=LimitsConfig(max_turns=turns + 1),
        max_context=bucket.bound,
    )


async def _libra_turns(
    url: str, tok: ChatTokenizer, out: Path, concurrency: int, episodes: int, turns: int
) -> tuple[list[float], dict[str, Any]]:
    """Per-turn latency of each episode (total / turns) and the run's figures."""
    bucket = Bucket("tp1", 1, 4096)
    cfg = EndpointConfig(max_inflight=512)
    per_turn: list[float] = []
    status: dict[str, int] = {}
    tasks = [{"id": f"b{i}"} for i in range(episodes)]
    monitor = LagMonitor()
    async with EndpointPool([(bucket, [url])], cfg) as pool:
        runner = _runner(tok, pool, turns)
        sink = JsonlSink(out)

        def emit(rec: libra.Trajectory) -> None:
            sink(rec)
            status[rec.status] = status.get(rec.status, 0) + 1
            per_turn.append(rec.timings.total_s / max(1, len(rec.turns)))

        base_rss = rss_mb()
        gc.callbacks.append(monitor.on_gc)
        mon = asyncio.create_task(monitor.run())
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        try:
            specs = episode_specs(tasks, 1, "bench")
            await run_episodes(runner, specs, concurrency=concurrency, emit=emit)
        finally:
            wall = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            mon.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await mon  # we cancelled it: its end is expected
            gc.callbacks.remove(monitor.on_gc)
            sink.close()
    figures = {
        "episodes": episodes,
        "completed_ok": status.get("ok", 0),
        "status": status,
        "wall_s": wall,
        "turns_per_s": episodes * turns / wall,
        # CPU of the Libra process alone (the server runs in another process): the figure
        # that holds up on a shared machine, where wall-clock rates depend on the load.
        "cpu_us_per_turn": cpu / (episodes * turns) * 1e6,
        "loop_lag_p50_ms": percentile(monitor.lags, 0.5) * 1e3,
        "loop_lag_p99_ms": percentile(monitor.lags, 0.99) * 1e3,
        "loop_lag_max_ms": max(monitor.lags, default=0.0) * 1e3,
        "full_gc_passes": len(monitor.full_gc_s),
        "full_gc_ms_max": max(monitor.full_gc_s, default=0.0) * 1e3,
        "young_gc_ms_max": monitor.young_gc_s_max * 1e3,
        "gc_thresholds": list(gc.get_threshold()),
        "rss_base_mb": base_rss,
        "rss_peak_mb": monitor.peak_rss,
        "rss_per_episode_kb": (monitor.peak_rss - base_rss) * 1024 / episodes,
    }
    return per_turn, figures


async def _bench(
    url: str, server_pid: int, model: Path, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    tok = ChatTokenizer(model)
    turns = args.turns
    # A request like a mid-episode turn: prompt + one tool round trip.
    prompt = tok.prompt_ids(NoopEnv().prompt({"id": "b0"}), [noop.schema])
    prompt += tok.encode('<tool_call>{"name": "noop", "arguments": {"x": 1}}</tool_call>')
    prompt += tok.delta_ids([{"role": "tool", "name": "noop", "content": "ok"}], [noop.schema])
    body = completion_body(
        "instant", prompt, max_tokens=64, temperature=1.0, top_p=1.0, logprobs=1,
        seed=None, stop=[], stop_token_ids=tok.eos_token_ids,
    )  # fmt: skip
    latency: dict[str, Any] = {}
    for conc in (1, 100):
        n_turns = args.latency_turns
        bare = await _bare_latency(url, body, conc, n_turns)
        per_turn, figures = await _libra_turns(url, tok, tmp / f"lat{conc}.jsonl", conc,
                                               max(conc, n_turns // turns), turns)  # fmt: skip
        b50, l50 = statistics.median(bare), statistics.median(per_turn)
        latency[f"concurrency_{conc}"] = {
            "bare_http_p50_ms": b50 * 1e3,
            "libra_turn_p50_ms": l50 * 1e3,
            "added_p50_ms": (l50 - b50) * 1e3,
            "bare_http_p99_ms": percentile(bare, 0.99) * 1e3,
            "libra_turn_p99_ms": percentile(per_turn, 0.99) * 1e3,
            "libra_cpu_us_per_turn": figures["cpu_us_per_turn"],
        }
    counts = _worker_counts(args.workers)
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in counts:
            out = tmp / f"scale-{n}-{r}.jsonl"
            cpu0 = proc_cpu_s(server_pid)
            if n == 1:
                _, fig = await _libra_turns(url, tok, out, args.episodes, args.episodes, turns)
            else:
                fig = await worker_turns(url, model, n, args.episodes, turns, out)
            fig["server_cpu_us_per_turn"] = (
                (proc_cpu_s(server_pid) - cpu0) / (args.episodes * turns) * 1e6
            )
            fig["load_average_1m"] = os.getloadavg()[0]
            runs[n].append(fig)
    scale = runs[counts[0]][0]
    result: dict[str, Any] = {
        "load_average": os.getloadavg(),
        "latency": latency,
        "in_flight": scale,
        "goals": {
            "added_p50_ms_max": 1.0,
            "loop_lag_p99_ms_max": 50.0,
            "loop_lag_max_ms_max": 100.0,
            "met": all(v["added_p50_ms"] <= 1.0 for v in latency.values())
            and scale["loop_lag_p99_ms"] <= 50.0
            and scale["loop_lag_max_ms"] <= 100.0
            and scale["completed_ok"] == args.episodes,
        },
    }
    if len(counts) > 1:
        result["workers"] = _compare(runs, args.episodes)
    return result


def _worker_counts(spec: str) -> list[int]:
    try:
        counts = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ConfigError(f"--workers {spec!r}: give worker counts >= 1, e.g. 1,2")
    return list(dict.fromkeys(counts))


def _compare(runs: dict[int, list[dict[str, Any]]], episodes: int) -> dict[str, Any]:
    """Per worker count: its runs and medians; turns/s of each count over the first's."""
    keys = ("turns_per_s", "cpu_us_per_turn", "server_cpu_us_per_turn", "loop_lag_p99_ms",
            "loop_lag_max_ms")  # fmt: skip
    med = {n: {k: statistics.median(f[k] for f in fs) for k in keys} for n, fs in runs.items()}
    base = next(iter(med))
    return {
        "runs": {str(n): fs for n, fs in runs.items()},
        "median": {str(n): m for n, m in med.items()},
        "turns_per_s_over_first": {
            str(n): m["turns_per_s"] / med[base]["turns_per_s"] for n, m in med.items()
        },
        "all_ok": all(f["completed_ok"] == episodes for fs in runs.values() for f in fs),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    _worker_counts(args.workers)  # a bad list fails before anything starts
    pids: list[int] = []
    with (
        tempfile.TemporaryDirectory(prefix="libra-bench-cp-") as d,
        instant_server.running(args.model, args.turns, pids) as (url, model),
    ):
        result = run_sync(_bench(url, pids[0], model, args, Path(d)))
    result["turns_per_episode"] = args.turns
    return result
