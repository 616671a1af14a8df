"""One call to an OpenAI-compatible `/v1/completions` endpoint, token ids in and out.

Speaks vLLM's response format (see shared/notes/vllm-0.32-openai-api.md): generated ids
in `choices[0].token_ids` (with `return_token_ids: true`), their log-probs in
`choices[0].logprobs.token_logprobs`. Classifies failures into retriable (429, 5xx,
connection errors, timeouts) and final (other 4xx, malformed bodies).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from libra.errors import EndpointDown, EndpointError


@dataclass(slots=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: Any
    text: str


class RetriableError(EndpointError):
    """429 / 5xx / timeout: the same call may succeed later or elsewhere."""


def completion_body(
    model: str | None,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    logprobs: int,
    seed: int | None,
    stop: list[str],
    stop_token_ids: list[int],
) -> bytes:
    body: dict[str, Any] = {
        "prompt": prompt_ids.tolist() if isinstance(prompt_ids, array) else list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "logprobs": logprobs,
        "n": 1,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "stop_token_ids": stop_token_ids,
    }
    if model is not None:
        body["model"] = model
    if stop:
        body["stop"] = stop[:4]  # vLLM rejects a fifth stop string
    if seed is not None:
        body["seed"] = seed
    return orjson.dumps(body)


async def post_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    *,
    headers: dict[str, str] | None = None,
) -> Completion:
    """POST `{url}/v1/completions`; raise EndpointDown / RetriableError / EndpointError.
    The caller bounds it with `asyncio.timeout` (a TimeoutError is retriable)."""
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        async with session.post(f"{url}/v1/completions", data=body, headers=hdrs) as resp:
            raw = await resp.read()
            status = resp.status
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as e:
        raise EndpointDown(f"{url}: {type(e).__name__}: {e}", url=url) from None
    except aiohttp.ClientOSError as e:
        raise EndpointDown(f"{url}: connection error: {e}", url=url) from None
    except aiohttp.ClientPayloadError as e:
        raise RetriableError(f"{url}: broken response: {e}", url=url) from None
    if status == 429 or status >= 500:
        raise RetriableError(f"{url}: HTTP {status}: {_message(raw)}", status=status, url=url)
    if status != 200:
        raise EndpointError(f"{url}: HTTP {status}: {_message(raw)}", status=status, url=url)
    return parse_completion(raw, url)


def parse_completion(raw: bytes, url: str = "") -> Completion:
    try:
        doc = orjson.loads(raw)
        choice = doc["choices"][0]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        raise EndpointError(f"{url}: not a completions response: {raw[:200]!r}") from None
    ids = choice.get("token_ids")
    if ids is None:
        raise EndpointError(
            f"{url}: response has no choices[0].token_ids; Libra needs a vLLM-compatible "
            "server that honours return_token_ids (vLLM >= 0.10, or `libra serve-engine`)"
        )
    lp = choice.get("logprobs") or {}
    token_lps = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if token_lps is None:
        logprobs = [0.0] * len(ids)
    else:
        logprobs = [float(x) if x is not None else 0.0 for x in token_lps]
        if len(logprobs) != len(ids):
            raise EndpointError(
                f"{url}: {len(ids)} token ids but {len(logprobs)} logprobs in the response"
            )
    return Completion(
        token_ids=[int(t) for t in ids],
        logprobs=logprobs,
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        text=choice.get("text") or "",
    )


def _message(raw: bytes) -> str:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:200].decode(errors="replace")
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict):
            return str(err.get("message", err))[:300]
        return str(err)[:300]
    return str(doc)[:300]
