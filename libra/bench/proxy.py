"""Proxy overhead: an `openai`-SDK agent through `libra.proxy` against the same native env.

Against the instant OpenAI-compatible server (`libra.bench.instant_server`, its own
process), the control-plane benchmark's one-tool workload runs three ways per round: the
native `NoopEnv` (EpisodeRunner); an agent function doing the same with the
`openai.AsyncOpenAI` client Libra hands it (AgentRunner; requests reach the proxy in
process); and the same agent posting its requests with a bare aiohttp client to the
proxy's HTTP server (loopback HTTP, but none of the SDK's own work). Figures, medians
over rounds: per-turn latency p50 at concurrency 1; with `--concurrency` episodes in
flight, this process's CPU time per turn (agent, proxy and runner all run in it; the
figure that holds up on a shared machine) and wall turns/s; ratios to native. It also
checks that all three produce the same tokens, and times what an episode's client costs
to build: a default `AsyncOpenAI()` against one on the runner's shared pool.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from libra.bench import instant_server
from libra.bench.control_plane import NoopEnv, noop
from libra.chat import ChatTokenizer
from libra.cli.common import count
from libra.endpoints.config import EndpointConfig, SamplingConfig
from libra.endpoints.pool import EndpointPool
from libra.proxy.agent import AgentEnv
from libra.proxy.runner import AgentRunner
from libra.record import Trajectory
from libra.rollout.batch import run_episodes
from libra.rollout.config import LimitsConfig
from libra.rollout.episode import EpisodeRunner
from libra.rollout.run import run_sync
from libra.rollout.tasks import episode_specs
from libra.routing.base import Bucket, StaticPolicy

TOOLS = [noop.schema]


async def noop_agent(task: dict[str, Any], client: Any) -> float:
    """NoopEnv written against the openai SDK: call noop until the model answers."""
    messages: list[dict[str, Any]] = NoopEnv().prompt(task)
    while True:
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=64
        )
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return float("<answer>42</answer>" in (msg.content or ""))
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})


async def http_agent(task: dict[str, Any], client: Any, session: Any = None) -> float:
    """`noop_agent` without the SDK: the same requests with a bare aiohttp session, over
    loopback HTTP to the proxy's server."""
    url = f"{str(client.base_url).rstrip('/')}/chat/completions"
    headers = {"Authorization": f"Bearer {client.api_key}", "Content-Type": "application/json"}
    messages: list[dict[str, Any]] = NoopEnv().prompt(task)
    while True:
        body = {"model": "policy", "messages": messages, "tools": TOOLS, "max_tokens": 64}
        async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
            msg = orjson.loads(await resp.read())["choices"][0]["message"]
        messages.append(msg)
        if not msg.get("tool_calls"):
            return float("<answer>42</answer>" in (msg.get("content") or ""))
        for call in msg["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=count, default=4, help="model turns per episode")
    p.add_argument("--latency-episodes", type=count, default=150, help="episodes at concurrency 1")
    p.add_argument("--episodes", type=count, default=1024, help="episodes of the throughput run")
    p.add_argument("--concurrency", type=count, default=256, help="episodes in flight")
    p.add_argument("--rounds", type=count, default=3, help="alternating native/agent rounds")
    p.add_argument("--model", help="model folder for the tokenizer (default: a fresh tiny one)")


async def _batch(
    kind: str, url: str, tok: ChatTokenizer, turns: int, episodes: int, concurrency: int
) -> tuple[list[Trajectory], float, float]:
    bucket = Bucket("tp1", 1, 4096)
    kw: dict[str, Any] = {
        "env_name": f"bench-{kind}",
        "tokenizer": tok,
        "policy": StaticPolicy([bucket]),
        "sampling": SamplingConfig(max_tokens=64),
        "limits": LimitsConfig(max_turns=turns + 1),
        "max_context": bucket.bound,
    }
    recs: list[Trajectory] = []
    specs = list(episode_specs([{"id": f"b{i}"} for i in range(episodes)], 1, "bench"))
    async with EndpointPool([(bucket, [url])], EndpointConfig(max_inflight=512)) as pool:
        if kind == "native":
            t0, c0 = time.perf_counter(), time.process_time()
            runner = EpisodeRunner(env=NoopEnv(), pool=pool, **kw)
            await run_episodes(runner, specs, concurrency=concurrency, emit=recs.append)
            return recs, time.perf_counter() - t0, time.process_time() - c0
        async with contextlib.AsyncExitStack() as stack:
            if kind == "sdk":
                env = AgentEnv(noop_agent)
            else:
                conn = aiohttp.TCPConnector(limit=0)
                session = await stack.enter_async_context(aiohttp.ClientSession(connector=conn))
                env = AgentEnv(http_agent, session=session)
            agent = await stack.enter_async_context(AgentRunner(agent=env, pool=pool, **kw))
            t0, c0 = time.perf_counter(), time.process_time()
            await run_episodes(agent, specs, concurrency=concurrency, emit=recs.append)
            return recs, time.perf_counter() - t0, time.process_time() - c0


def _client_build_ms() -> dict[str, float]:
    import openai

    from libra.proxy.runner import _httpx
    from libra.proxy.server import ProxyServer, in_process_transport

    httpx = _httpx()
    shared = in_process_transport(httpx, ProxyServer())
    out = {}
    for name, n, make in [
        ("default_client_ms", 10, lambda: openai.AsyncOpenAI(base_url="http://x/v1", api_key="k")),
        ("shared_transport_client_ms", 300, lambda: openai.AsyncOpenAI(
            base_url="http://x/v1", api_key="k", max_retries=0,
            http_client=httpx.AsyncClient(transport=shared, trust_env=False))),
    ]:  # fmt: skip
        t = time.perf_counter()
        for _ in range(n):
            make()
        out[name] = (time.perf_counter() - t) / n * 1e3
    return out


def _tokens(rec: Trajectory) -> tuple[Any, ...]:
    return (rec.prompt_token_ids, rec.response_token_ids, rec.loss_mask, rec.logprobs)


KINDS = ("native", "sdk", "http")


async def _bench(url: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    tok = ChatTokenizer(model)
    lat: dict[str, list[float]] = {k: [] for k in KINDS}
    tput: dict[str, list[float]] = {k: [] for k in KINDS}
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    ok = dict.fromkeys(KINDS, 0)
    errors: dict[str, int] = {}
    same, compared = True, 0
    for _ in range(args.rounds):
        got: dict[str, dict[str, Any]] = {}
        for kind in KINDS:
            recs, _, _ = await _batch(kind, url, tok, args.turns, args.latency_episodes, 1)
            lat[kind].append(statistics.median(r.timings.total_s / len(r.turns) for r in recs))
            recs, wall, used = await _batch(
                kind, url, tok, args.turns, args.episodes, args.concurrency
            )
            turns = sum(len(r.turns) for r in recs)
            tput[kind].append(turns / wall)
            cpu[kind].append(used / turns * 1e3)
            ok[kind] += sum(r.status == "ok" for r in recs)
            for r in recs:
                if r.status != "ok":
                    why = f"{kind}: {r.status}: {(r.error or '')[:120]}"
                    errors[why] = errors.get(why, 0) + 1
            got[kind] = {r.id: _tokens(r) for r in recs if r.status == "ok"}
        both = got["native"].keys() & got["sdk"].keys() & got["http"].keys()
        compared += len(both)
        same = same and all(got["native"][i] == got["sdk"][i] == got["http"][i] for i in both)
    p50 = {k: statistics.median(v) * 1e3 for k, v in lat.items()}
    tps = {k: statistics.median(v) for k, v in tput.items()}
    cms = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "turn_p50_ms": p50,
        "added_turn_p50_ms": {k: p50[k] - p50["native"] for k in ("sdk", "http")},
        "cpu_ms_per_turn": cms,
        "cpu_over_native": {k: cms[k] / cms["native"] for k in ("sdk", "http")},
        "turns_per_s": tps,
        "over_native_turns_per_s": {k: tps[k] / tps["native"] for k in ("sdk", "http")},
        "rounds": {
            "turn_p50_ms": {k: [x * 1e3 for x in v] for k, v in lat.items()},
            "turns_per_s": tput,
            "cpu_ms_per_turn": cpu,
        },
        "ok_episodes": ok,
        "not_ok": errors,
        "same_tokens": same,
        "episodes_compared": compared,
        "client_build": _client_build_ms(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with instant_server.running(args.model, args.turns) as (url, model):
        result = run_sync(_bench(url, model, args))
    result["config"] = {k: getattr(args, k) for k in ("turns", "latency_episodes", "episodes",
                                                      "concurrency", "rounds")}  # fmt: skip
    return result
