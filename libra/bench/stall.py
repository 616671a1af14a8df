"""`libra bench service --stall`: is `/healthz` answered promptly while hostile but legal
work hits the service at once?

A real `libra serve-rollout` (a subprocess, fsync "always") hosts the workloads of
`libra.bench.stall_envs` against two instant OpenAI-compatible servers. A prober process
sends `GET /healthz` on a kept-alive connection every `--probe-ms` and times each
answer: first with the service idle, then while, at the same time,

- `--tool-episodes` episodes each get a 10 MB tool return and a synchronous reward
  that sleeps 3 s;
- `--agent-episodes` agent episodes each send a 6 MB prompt through the proxy;
- a batch of `--big-batch` episodes is submitted and, `--cancel-after` s later,
  cancelled.

The load window ends when all three batches are finished. Reported: `/healthz` latency
percentiles idle and under load (the figure that matters: p99 under load), how long
each load took, and whether every episode ended with a record.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import re
import select
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import orjson

CONFIG = """
concurrency = {concurrency}
[limits]
reward_timeout_s = 30
[[envs]]
spec = "libra.bench.stall_envs:StallTool"
name = "stall-tool"
[[envs]]
spec = "libra.bench.stall_envs:huge_prompt_agent"
name = "huge-agent"
[[envs]]
spec = "libra.bench.control_plane:NoopEnv"
name = "noop"
"""


def add_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--tool-episodes", type=int, default=8, help="10 MB tool + 3 s sync reward")
    p.add_argument("--agent-episodes", type=int, default=8, help="6 MB prompts via the proxy")
    p.add_argument("--big-batch", type=int, default=100_000, help="episodes of the cancelled batch")
    p.add_argument("--cancel-after", type=float, default=2.0, help="seconds before the cancel")
    p.add_argument("--probe-ms", type=float, default=10.0, help="pause between /healthz probes")
    p.add_argument("--idle-s", type=float, default=3.0, help="idle probing before the loads")


class Prober:
    """Times `GET /healthz` in a loop on one kept-alive connection, in a process of its
    own (`python -m libra.bench.stall URL PAUSE_S`): this process parses 100,000
    records meanwhile, and a prober sharing its GIL would time that too. Samples are
    (start, latency) on the system-wide monotonic clock."""

    def __init__(self, url: str, pause_s: float):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "libra.bench.stall", url, str(pause_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        self.samples: list[tuple[float, float]] = []

    def stop(self) -> None:
        """Close its stdin (it stops) and read its samples."""
        out, _ = self.proc.communicate(timeout=60)
        self.samples = [(float(t), float(lat)) for t, lat in orjson.loads(out)]

    def window(self, start: float, end: float) -> list[float]:
        return [lat for t, lat in self.samples if start <= t <= end]


def _probe(url: str, pause_s: float) -> None:
    """The prober process: probe until stdin closes, then print the samples as JSON."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    samples = []
    while not select.select([sys.stdin], [], [], 0)[0]:
        t0 = time.monotonic()
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        samples.append((t0, time.monotonic() - t0))
        time.sleep(pause_s)
    sys.stdout.buffer.write(orjson.dumps(samples))


def _stats(lat: list[float]) -> dict[str, Any]:
    xs = sorted(lat)

    def pct(q: float) -> float:
        return round(1e3 * xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else float("nan")

    return {"probes": len(xs), "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "max_ms": round(1e3 * xs[-1], 2) if xs else float("nan")}  # fmt: skip


async def _until_done(s: aiohttp.ClientSession, url: str, bid: str) -> dict[str, Any]:
    while True:
        async with s.get(f"{url}/v1/rollouts/{bid}") as r:
            doc = orjson.loads(await r.read())
        if doc["finished"] >= doc["episodes"] and doc["counts"]["running"] == 0:
            return dict(doc)
        await asyncio.sleep(0.2)


async def _batch(
    s: aiohttp.ClientSession, url: str, env: str, n: int, bid: str, cancel_after: float | None
) -> dict[str, Any]:
    tasks = [{"id": f"t{i}"} for i in range(n)]
    t0 = time.perf_counter()
    async with s.post(f"{url}/v1/rollouts", data=orjson.dumps(
            {"env": env, "tasks": tasks, "batch_id": bid})) as r:  # fmt: skip
        if r.status != 201:
            raise RuntimeError(f"submit {bid}: HTTP {r.status}: {await r.text()}")
    out: dict[str, Any] = {"episodes": n, "submit_s": round(time.perf_counter() - t0, 3)}
    if cancel_after is not None:
        await asyncio.sleep(cancel_after)
        t1 = time.perf_counter()
        async with s.delete(f"{url}/v1/rollouts/{bid}") as r:
            await r.read()
        out["cancel_s"] = round(time.perf_counter() - t1, 3)
    doc = await _until_done(s, url, bid)
    out["done_s"] = round(time.perf_counter() - t0, 3)
    out["counts"] = {k: v for k, v in doc["counts"].items() if v}
    out["errors"] = await _errors(s, url, bid)
    return out


async def _errors(s: aiohttp.ClientSession, url: str, bid: str) -> dict[str, int]:
    """The batch's records' `error` texts (numbers cut out), with their counts."""
    found: Counter[str] = Counter()
    buf = b""
    async with s.get(f"{url}/v1/rollouts/{bid}/trajectories") as r:
        async for chunk in r.content.iter_any():
            *lines, buf = (buf + chunk).split(b"\n")
            for line in lines:
                error = orjson.loads(line).get("error")
                if error:
                    found[re.sub(r"\d+(\.\d+)?", "N", error)[:120]] += 1
    return dict(found.most_common(5))


async def _loads(url: str, args: argparse.Namespace) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        jobs = {
            "tool_10mb_sync_reward_3s": _batch(s, url, "stall-tool", args.tool_episodes, "tool",
                                               None),
            "proxy_prompt_6mb": _batch(s, url, "huge-agent", args.agent_episodes, "agent", None),
            "cancel_big_batch": _batch(s, url, "noop", args.big_batch, "big", args.cancel_after),
        }  # fmt: skip
        results = await asyncio.gather(*jobs.values())
    return dict(zip(jobs, results, strict=True))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from libra.bench.service import _endpoints, _spawn

    with tempfile.TemporaryDirectory(prefix="libra-bench-stall-") as d, ExitStack() as stack:
        tmp = Path(d)
        from libra.engine.model_maker import make_model

        model = make_model(tmp / "model", seed=0)
        urls = _endpoints("instant", model, 2, stack)
        config = tmp / "stall.toml"
        config.write_text(CONFIG.format(concurrency=64))
        cmd = ["-m", "libra", "serve-rollout", str(config), "--model", str(model),
               "--port", "0", "--spool", str(tmp / "spool"),
               *(a for u in urls for a in ("--endpoint", f"tp1={u}"))]  # fmt: skip
        url, _ = _spawn(cmd, None, stack)
        prober = Prober(url, args.probe_ms / 1e3)
        time.sleep(args.idle_s)
        start = time.monotonic()
        loads = asyncio.run(_loads(url, args))
        end = time.monotonic()
        prober.stop()
    idle = [lat for t, lat in prober.samples if t < start]
    under = prober.window(start, end)
    worst = sorted((s for s in prober.samples if start <= s[0] <= end), key=lambda s: -s[1])[:5]
    return {
        "healthz_idle": _stats(idle),
        "healthz_under_load": _stats(under),
        "load_window_s": round(end - start, 2),
        "worst_probes": [
            {"at_s": round(t - start, 2), "ms": round(1e3 * lat, 1)} for t, lat in worst
        ],
        "loads": loads,
        "p99_under_100ms": _stats(under)["p99_ms"] <= 100,
    }


if __name__ == "__main__":
    _probe(sys.argv[1], float(sys.argv[2]))


__all__ = ["Prober", "add_arguments", "run"]
