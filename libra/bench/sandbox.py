"""Sandbox backends: create+start, exec and copy latencies, sustained concurrency.

For each backend that is available here (Docker when an engine answers, bubblewrap when
installed), on the `busybox` image:
- create: `backend.create()` to a started sandbox, and close; sequential, median and p90;
  Docker also from a warm pool of started containers;
- exec: `true` in a live sandbox, sequential, median and p90;
- copy: write + read back a 1 MiB file, and copy_in a tree of 100 files of 4 KiB;
- sustained: K sandboxes alive at once, each running `echo` in a loop for `--hold-s`
  seconds; execs per second in all, p90 exec latency, errors.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from libra.cli.common import count
from libra.sandboxes.base import Backend, SandboxSpec

SPEC = SandboxSpec(image="busybox", memory_mb=128, pids=64)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        action="append",
        choices=["docker", "bwrap"],
        help="backend to measure (repeatable; default: every available one)",
    )
    p.add_argument("--repeats", type=count, default=10, help="samples per latency (default 10)")
    p.add_argument(
        "--levels",
        default="1,8,32",
        help="concurrent sandbox counts for the sustained test (default 1,8,32)",
    )
    p.add_argument(
        "--hold-s", type=float, default=5.0, help="seconds each sustained level runs (default 5)"
    )


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median_ms": round(1000 * statistics.median(s), 2),
        "p90_ms": round(1000 * s[min(len(s) - 1, int(0.9 * len(s)))], 2),
        "n": len(s),
    }


async def _timed(coro: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = await coro
    return time.perf_counter() - t, out


async def _latencies(backend: Backend, repeats: int, tree: Path) -> dict[str, Any]:
    creates, closes = [], []
    for _ in range(repeats):
        dt, sb = await _timed(backend.create(SPEC))
        creates.append(dt)
        closes.append((await _timed(sb.close()))[0])
    out: dict[str, Any] = {"create_start": _stats(creates), "close": _stats(closes)}
    async with await backend.create(SPEC) as sb:
        await sb.exec("true")  # first exec may warm caches
        out["exec"] = _stats([(await _timed(sb.exec("true")))[0] for _ in range(3 * repeats)])
        blob = b"x" * (1 << 20)
        writes, reads = [], []
        for _ in range(repeats):
            writes.append((await _timed(sb.write_file("blob", blob)))[0])
            dt, data = await _timed(sb.read_file("blob"))
            assert data == blob
            reads.append(dt)
        out["write_1mib"], out["read_1mib"] = _stats(writes), _stats(reads)
        out["copy_in_100_files"] = _stats(
            [(await _timed(sb.copy_in(tree, "/work/tree")))[0] for _ in range(repeats)]
        )
    return out


async def _sustained(backend: Backend, k: int, hold_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    sandboxes = await asyncio.gather(*(backend.create(SPEC) for _ in range(k)))
    created_s = time.perf_counter() - t0
    latencies: list[float] = []
    errors = refused = 0
    first_error = ""

    async def loop(sb: Any) -> None:
        nonlocal errors, refused, first_error
        end = time.perf_counter() + hold_s
        while time.perf_counter() < end:
            dt, r = await _timed(sb.exec("echo ok", timeout=30))
            latencies.append(dt)
            if r.stdout == "ok\n":
                continue
            if "Resource temporarily unavailable" in r.stderr:  # fork refused: pids limit
                refused += 1
            else:
                errors += 1
            first_error = first_error or repr(r)[:300]

    try:
        start = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for sb in sandboxes:
                tg.create_task(loop(sb))
        elapsed = time.perf_counter() - start
    finally:
        await asyncio.gather(*(sb.close() for sb in sandboxes))
    return {
        "sandboxes": k,
        "create_all_s": round(created_s, 2),
        "execs_per_s": round(len(latencies) / elapsed, 1),
        "exec_p90_ms": _stats(latencies)["p90_ms"],
        "errors": errors,
        # Each bwrap exec leaves one zombie that the host's PID 1 reaps (bwrap's PID
        # namespace init is reparented there); where PID 1 reaps lazily, fast execs in
        # one sandbox reach its pids limit until it catches up (docs/sandboxes.md)
        "fork_refused": refused,
        "first_error": first_error,
    }


async def _measure(name: str, args: argparse.Namespace, tree: Path) -> dict[str, Any]:
    from libra.sandboxes.bwrap import BwrapBackend
    from libra.sandboxes.docker import DockerBackend

    backend: Backend = DockerBackend() if name == "docker" else BwrapBackend()
    async with backend:
        out = {"info": backend.info(), **await _latencies(backend, args.repeats, tree)}
        out["sustained"] = [
            await _sustained(backend, int(k), args.hold_s) for k in args.levels.split(",")
        ]
    if name == "docker":
        async with DockerBackend(pool_size=4, pool_spec=SPEC) as pooled:
            await asyncio.sleep(3)  # let the pool fill
            samples = []
            for _ in range(min(args.repeats, 4)):
                dt, sb = await _timed(pooled.create(SPEC))
                samples.append(dt)
                await sb.close()
            out["create_from_warm_pool"] = _stats(samples)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from libra.errors import ConfigError
    from libra.sandboxes.bwrap import BwrapBackend
    from libra.sandboxes.docker import engine_answers

    try:
        levels = [int(k) for k in args.levels.split(",")]
    except ValueError:
        raise ConfigError(f"--levels {args.levels!r}: expected counts like 1,8,32") from None
    if args.repeats < 1 or args.hold_s <= 0 or min(levels) < 1:
        raise ConfigError("--repeats, --hold-s and every --levels count must be positive")
    args.levels = ",".join(map(str, levels))

    names = args.backend or [
        n
        for n, why in (("docker", engine_answers()), ("bwrap", BwrapBackend.available()))
        if why is None
    ]
    if not names:
        raise ConfigError("no sandbox backend here: start dockerd or install bubblewrap")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        for i in range(100):
            (tree / f"d{i % 10}").mkdir(parents=True, exist_ok=True)
            (tree / f"d{i % 10}" / f"f{i}.txt").write_bytes(b"y" * 4096)
        results = {n: asyncio.run(_measure(n, args, tree)) for n in names}
    doc: dict[str, Any] = {"backends": results}
    if {"docker", "bwrap"} <= results.keys():
        d, b = results["docker"], results["bwrap"]
        doc["ratios_docker_over_bwrap"] = {
            k: round(d[k]["median_ms"] / b[k]["median_ms"], 2)
            for k in ("create_start", "exec", "write_1mib", "read_1mib", "copy_in_100_files")
        }
    return doc
