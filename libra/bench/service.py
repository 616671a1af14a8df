"""Service path vs in-process `libra rollout`, on the same endpoints.

The same batch (`--episodes` episodes, `--concurrency` in flight) runs (a) in this
process through `libra.rollout.rollout` (records to a JSONL file) and (b) through
`libra serve-rollout` in a subprocess, submitted and streamed back record by record by
`libra.client.AsyncClient` (records parsed into `Trajectory`s, as a trainer gets them),
once with `fsync = "always"` and once with `"never"`. Rounds alternate the three so that
load from other processes hits them alike; figures are medians over `--rounds`, and
ratios are paired per round. Besides wall time it reports Libra's CPU per episode
(in-process: this process; service: the service process plus the client), which the
shared machine's load disturbs much less than wall time.

Backends: `instant` (default): two OpenAI-compatible servers that answer at once
(`libra.bench.instant_server`, `--turns` turns per episode, a no-op tool): the control
plane is all there is, the worst case for the service's overhead. `engine`: two
embedded engines (`libra serve-engine`) on the tiny model, `arith` tasks: generation
dominates, as it does in real use.

`--stall`: instead, `/healthz` latency while hostile but legal work hits the service at
once (`libra.bench.stall`).
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from libra.bench import stall
from libra.cli.common import count
from libra.client import AsyncClient
from libra.cluster.process import free_port
from libra.endpoints.config import BucketConfig, EndpointConfig, SamplingConfig
from libra.errors import LibraError
from libra.rollout.config import LimitsConfig, RolloutConfig
from libra.rollout.run import rollout, run_sync

NOOP_ENV = "libra.bench.control_plane:NoopEnv"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["instant", "engine"], default="instant")
    p.add_argument("--episodes", type=count, default=1000, help="episodes per run")
    p.add_argument("--concurrency", type=count, default=256, help="episodes in flight")
    p.add_argument("--turns", type=count, default=4, help="turns per episode (instant backend)")
    p.add_argument("--max-tokens", type=count, default=32, help="tokens per turn (engine backend)")
    p.add_argument("--rounds", type=count, default=5, help="alternating rounds (median)")
    p.add_argument("--model", help="model folder (default: a fresh tiny one)")
    p.add_argument(
        "--stall", action="store_true", help="/healthz latency under hostile loads instead"
    )
    stall.add_arguments(p.add_argument_group("--stall"))


def _spawn(
    args: list[str], ready: str | None, stack: ExitStack, timeout: float = 180
) -> tuple[str, subprocess.Popen[bytes]]:
    """Start a process; return the first stdout line (when `ready` is None) or the URL
    `ready` once it answers, and the process."""
    import urllib.request

    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE)

    def stop() -> None:
        proc.terminate()
        proc.wait(30)

    stack.callback(stop)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LibraError(f"{' '.join(args[:3])} exited with {proc.returncode}")
        if ready is None:
            assert proc.stdout is not None
            if select.select([proc.stdout], [], [], 0.2)[0]:
                line = proc.stdout.readline().decode().strip()
                if line:
                    return line, proc
            continue
        try:
            with urllib.request.urlopen(ready, timeout=1):
                return ready.removesuffix("/health"), proc
        except OSError:
            time.sleep(0.2)
    raise LibraError(f"{' '.join(args[:3])} did not start in {timeout:g} s")


def _endpoints(backend: str, model: Path, turns: int, stack: ExitStack) -> list[str]:
    urls = []
    for _ in range(2):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if backend == "instant":
            cmd = ["-m", "libra.bench.instant_server", "--model", str(model),
                   "--port", str(port), "--turns", str(turns)]  # fmt: skip
        else:
            cmd = ["-m", "libra", "serve-engine", "--model", str(model), "--port", str(port)]
        urls.append(_spawn(cmd, url + "/health", stack)[0])
    return urls


def _tasks(backend: str, n: int) -> list[dict[str, Any]]:
    if backend == "instant":
        return [{"id": f"t{i}"} for i in range(n)]
    from libra.envs.arith import make_tasks

    return make_tasks(n, seed=0)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _in_process(cfg: RolloutConfig, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """`wall_s`: the batch alone (`rollout`'s own clock starts after the tokenizer, env
    and endpoint pool are up, which the service has done before a submit arrives);
    `cpu_s`: this process's CPU for the whole call."""
    cpu = time.process_time()
    summary = await rollout(cfg, tasks=tasks, progress=False)
    return {"wall_s": summary["wall_s"], "cpu_s": time.process_time() - cpu,
            "episodes": summary["episodes"], "status": summary["status"]}  # fmt: skip


async def _service(
    url: str, pid: int, env: str, tasks: list[dict[str, Any]], bid: str
) -> dict[str, Any]:
    """Submit, stream every record back; `cpu_s`: the service's CPU plus the client's."""
    async with AsyncClient(url) as c:
        cpu, svc_cpu = time.process_time(), _cpu_s(pid)
        t0 = time.perf_counter()
        batch = await c.submit(env, tasks, batch_id=bid)
        first = None
        ids: set[str] = set()
        status: Counter[str] = Counter()
        async for rec in c.trajectories(batch):
            first = first or time.perf_counter() - t0
            ids.add(rec.id)
            status[rec.status] += 1
        wall = time.perf_counter() - t0
        client_cpu, svc_cpu = time.process_time() - cpu, _cpu_s(pid) - svc_cpu
    return {"wall_s": wall, "cpu_s": client_cpu + svc_cpu, "client_cpu_s": client_cpu,
            "episodes": len(ids), "status": dict(status), "first_record_s": first}  # fmt: skip


def _summarise(runs: list[dict[str, Any]], base: list[dict[str, Any]] | None) -> dict[str, Any]:
    n = runs[0]["episodes"]
    wall = statistics.median(r["wall_s"] for r in runs)
    out: dict[str, Any] = {
        "episodes_per_s": n / wall,
        "wall_s": [round(r["wall_s"], 2) for r in runs],
        "cpu_ms_per_episode": 1e3 * statistics.median(r["cpu_s"] for r in runs) / n,
        "complete": all(r["episodes"] == n for r in runs),
        "status": dict(sum((Counter(r["status"]) for r in runs), Counter())),
    }
    if "first_record_s" in runs[0]:
        out["first_record_s"] = statistics.median(r["first_record_s"] for r in runs)
        out["client_cpu_ms_per_episode"] = (
            1e3 * statistics.median(r["client_cpu_s"] for r in runs) / n
        )
    if base is not None:  # paired by round: both saw the same background load
        out["throughput_vs_in_process"] = statistics.median(
            b["wall_s"] / r["wall_s"] for b, r in zip(base, runs, strict=True)
        )
        out["cpu_vs_in_process"] = statistics.median(
            r["cpu_s"] / b["cpu_s"] for b, r in zip(base, runs, strict=True)
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.stall:
        return stall.run(args)
    with tempfile.TemporaryDirectory(prefix="libra-bench-svc-") as d, ExitStack() as stack:
        tmp = Path(d)
        if args.model:
            model = Path(args.model)
        else:
            from libra.engine.model_maker import make_model

            model = make_model(tmp / "model", seed=0)
        urls = _endpoints(args.backend, model, args.turns, stack)
        env = NOOP_ENV if args.backend == "instant" else "arith"
        sampling = SamplingConfig(max_tokens=64 if args.backend == "instant" else args.max_tokens)
        limits = LimitsConfig(max_turns=args.turns + 1 if args.backend == "instant" else 1)
        tasks = _tasks(args.backend, args.episodes)
        services = {}
        for fsync in ("always", "never"):
            config = tmp / f"svc-{fsync}.toml"
            config.write_text(
                f'[sampling]\nmax_tokens = {sampling.max_tokens}\n'
                f'[limits]\nmax_turns = {limits.max_turns}\n'
            )  # fmt: skip
            cmd = ["-m", "libra", "serve-rollout", str(config), "--model", str(model),
                   "--port", "0", "--env", f"{env}", "--concurrency", str(args.concurrency),
                   "--spool", str(tmp / f"spool-{fsync}"), "--fsync", fsync,
                   *(a for u in urls for a in ("--endpoint", f"tp1={u}"))]  # fmt: skip
            url, proc = _spawn(cmd, None, stack)
            services[fsync] = (url, proc.pid)
        results: dict[str, list[dict[str, Any]]] = {"in_process": [], "always": [], "never": []}
        for r in range(args.rounds):
            cfg = RolloutConfig(
                model=str(model), env=env, concurrency=args.concurrency,
                out=str(tmp / f"inproc-{r}.jsonl"), batch_id=f"inproc{r}",
                buckets=[BucketConfig(name="tp1", endpoints=urls)],
                sampling=sampling, limits=limits, endpoint=EndpointConfig(),
            )  # fmt: skip
            results["in_process"].append(run_sync(_in_process(cfg, tasks)))
            for fsync, (url, pid) in services.items():
                results[fsync].append(run_sync(_service(url, pid, env, tasks, f"r{r}")))
    base = results["in_process"]
    doc: dict[str, Any] = {
        "backend": args.backend,
        "episodes": args.episodes,
        "concurrency": args.concurrency,
        "turns_per_episode": args.turns if args.backend == "instant" else 1,
        "rounds": args.rounds,
        "in_process_rollout": _summarise(base, None),
    }
    for fsync in ("always", "never"):
        doc[f"service_fsync_{fsync}"] = _summarise(results[fsync], base)
    return doc
