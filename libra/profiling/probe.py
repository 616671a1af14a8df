"""Timing an inference endpoint's decode and prefill steps from outside, through
`/v1/completions` with token-id prompts (the same on vLLM and the embedded engine: no
engine internals, no streaming).

- **Decode** at batch B and context c: one prompt of c token ids with `n = B` choices,
  temperature 1, `ignore_eos`, sent twice: `max_tokens = 1` (the prefill and its first
  token) and `max_tokens = N`. The second runs N - 1 more engine steps, each decoding
  the B sequences, so (t_N - t_1) / (N - 1) is one decode step at a mean context of
  c + N/2 tokens per sequence. Everything else in a request (HTTP, parsing, the prefill,
  building the response) is in both and cancels. The prompt is sent once beforehand so
  that vLLM's prefix cache holds it (the `n` choices then share it); the embedded
  engine, which has no prefix cache, prefills it once per request, in both.
- **Prefill** of u tokens: a fresh prompt (never cached) of u random ids, one choice,
  `max_tokens = 1`: the request's wall time is the engine's prefill step plus a fixed
  cost per request, which the fit estimates per endpoint (`libra.planner.fit`).

The machine an endpoint runs on may be shared (the reference machine has 2 cores for
three engineers), and contention only ever adds time. So a point is timed many times,
in short requests, in rounds over the whole grid (each round visits every point once,
so every point sees the same spread of load over the run), and a point keeps the first
quartile of its requests (`fast`: the time the fastest quarter stays under): decode
(fast t_N - fast t_1) / (N - 1), prefill the fast request. The lower tail is the
engine's own speed; the single fastest request hangs on one lucky moment (under a load
of 3 on 2 cores a point without one came out twice as slow as its neighbours), the
median on how busy the machine was (docs/benchmarks.md has the comparison). Every
request is recorded. A warm-up request at the largest batch and context runs first, so
allocations (the embedded engine's KV cache grows by doubling) and first-call costs are
not timed.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from libra.errors import ConfigError, EndpointDown, EndpointError

OWNERS = {"libra": "embedded", "vllm": "vllm"}
"""`owned_by` of `/v1/models` -> endpoint kind (as `libra.service.weights.detect_kind`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """One endpoint as `/v1/models` describes it."""

    bucket: str
    url: str
    tp: int
    kind: str
    """`embedded` or `vllm`."""
    served_model: str
    root: str
    """The model path the server loaded (`root` of `/v1/models`)."""
    max_model_len: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """A point's estimate and the requests behind it (seconds)."""

    seconds: float
    """Decode: (fast t_N - fast t_1) / (N - 1), one step. Prefill: the fast request
    (`fast`: the first quartile)."""
    short: tuple[float, ...]
    """Decode: t_1 of each round. Prefill: each request."""
    long: tuple[float, ...] = ()
    """Decode: t_N of each round."""


async def _get(session: aiohttp.ClientSession, url: str) -> Any:
    try:
        async with session.get(url) as r:
            body = await r.read()
            if r.status != 200:
                raise EndpointError(f"GET {url}: HTTP {r.status}", status=r.status, url=url)
            return orjson.loads(body)
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise EndpointDown(f"{url}: cannot reach the endpoint ({type(e).__name__}: {e})") from None
    except orjson.JSONDecodeError:
        raise EndpointError(f"GET {url}: the response is not JSON", url=url) from None


async def describe(
    session: aiohttp.ClientSession, bucket: str, url: str, tp: int, kind: str = "auto"
) -> Endpoint:
    """Ask the endpoint what it serves; `kind` "auto" reads it from `owned_by`."""
    doc = await _get(session, f"{url}/v1/models")
    data = (doc.get("data") or [{}])[0] if isinstance(doc, dict) else {}
    owner = data.get("owned_by")
    if kind == "auto":
        if owner not in OWNERS:
            raise ConfigError(
                f"cannot tell what serves {url} (owned_by={owner!r}); pass --kind embedded or "
                "--kind vllm"
            )
        kind = OWNERS[owner]
    served = str(data.get("id") or "")
    return Endpoint(
        bucket=bucket,
        url=url,
        tp=tp,
        kind=kind,
        served_model=served,
        root=str(data.get("root") or served),
        max_model_len=int(data["max_model_len"]) if data.get("max_model_len") else None,
    )


class Prober:
    """Sends the timed requests of one endpoint, one at a time."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        endpoint: Endpoint,
        *,
        vocab: int,
        seed: int = 0,
        clock: Callable[[], float],
    ):
        self.session = session
        self.ep = endpoint
        # Random ids from the lower 90% of the vocabulary: Qwen and Llama keep their added
        # and special tokens at the top, and a config's vocab may exceed the tokenizer's.
        self.high = max(2, int(vocab * 0.9))
        self.rng = random.Random(seed)
        self.clock = clock

    def prompt(self, tokens: int) -> list[int]:
        return [self.rng.randrange(1, self.high) for _ in range(tokens)]

    async def complete(self, prompt: list[int], n: int, max_tokens: int) -> float:
        """Wall seconds of one completion that must generate exactly `max_tokens` per
        choice (`ignore_eos`)."""
        body = {
            "model": self.ep.served_model,
            "prompt": prompt,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
        }
        url = f"{self.ep.url}/v1/completions"
        t0 = self.clock()
        try:
            async with self.session.post(
                url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
            ) as r:
                raw = await r.read()
                dt = self.clock() - t0
                if r.status != 200:
                    raise EndpointError(
                        f"POST {url}: HTTP {r.status}: {raw[:300].decode(errors='replace')}",
                        status=r.status,
                        url=url,
                    )
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise EndpointDown(f"{url}: request failed ({type(e).__name__}: {e})") from None
        usage = orjson.loads(raw).get("usage") or {}
        if usage.get("completion_tokens") != n * max_tokens:
            raise EndpointError(
                f"{url} generated {usage.get('completion_tokens')} tokens, expected "
                f"{n * max_tokens} (n={n} x max_tokens={max_tokens}): it must honour "
                "ignore_eos for step timings",
                url=url,
            )
        return dt

    async def warm_up(self, batch: int, context: int, tokens: int) -> None:
        await self.complete(self.prompt(context), batch, tokens)
        await self.complete(self.prompt(context), 1, 1)


def fast(times: list[float]) -> float:
    """The first quartile of `times` (the smallest, with fewer than two)."""
    if len(times) < 2:
        return min(times)
    return statistics.quantiles(times, n=4, method="inclusive")[0]


@dataclass(frozen=True, slots=True)
class DecodePoint:
    batch: int
    context: int


async def measure_grid(
    probe: Prober,
    decode: list[DecodePoint],
    prefill: list[int],
    *,
    tokens: int,
    repeats: int,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[list[Timing], list[Timing]]:
    """Decode step times for `decode` and prefill request times for `prefill` (token
    counts), in rounds over the whole grid (see the module docstring)."""
    prompts = [probe.prompt(p.context) for p in decode]
    for p, prompt in zip(decode, prompts, strict=True):
        await probe.complete(prompt, p.batch, 1)  # into vLLM's prefix cache
    short: list[list[float]] = [[] for _ in decode]
    long: list[list[float]] = [[] for _ in decode]
    fills: list[list[float]] = [[] for _ in prefill]
    for r in range(repeats):
        progress(f"  round {r + 1} of {repeats}")
        for i, (p, prompt) in enumerate(zip(decode, prompts, strict=True)):
            short[i].append(await probe.complete(prompt, p.batch, 1))
            long[i].append(await probe.complete(prompt, p.batch, tokens))
        for j, u in enumerate(prefill):
            fills[j].append(await probe.complete(probe.prompt(u), 1, 1))
    steps = [
        Timing(
            seconds=(fast(tn) - fast(t1)) / (tokens - 1),
            short=tuple(t1),
            long=tuple(tn),
        )
        for t1, tn in zip(short, long, strict=True)
    ]
    return steps, [Timing(seconds=fast(ts), short=tuple(ts)) for ts in fills]


__all__ = [
    "OWNERS",
    "DecodePoint",
    "Endpoint",
    "Prober",
    "Timing",
    "describe",
    "fast",
    "measure_grid",
]
