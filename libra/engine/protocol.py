"""Request validation for the embedded server, with vLLM 0.32's defaults and limits.

Every check raises `ApiError` (HTTP status + message in vLLM's error body); unknown
fields are ignored, as vLLM does. Differences from vLLM are deliberate and listed in
docs/engine.md (no `echo`, no `stream`, no guided decoding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from libra.engine.sampling import SamplingParams

MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        kind = {400: "BadRequestError", 403: "PermissionDeniedError", 404: "NotFoundError"}.get(
            self.status, "InternalServerError"
        )
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.status,
            }
        }


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


@dataclass(frozen=True, slots=True)
class Limits:
    model_name: str
    context: int
    vocab_size: int
    max_n: int = 64
    """Most choices (`n`) one request may ask for: the engine's `max_num_seqs`, the most
    sequences it decodes at once (n = 1,000,000 was admitted and allocated its KV cache
    whole, past `--kv-cache-gib`)."""


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    return body


def check_model(body: dict[str, Any], limits: Limits) -> None:
    model = body.get("model")
    if model is not None and model != limits.model_name:
        raise ApiError(
            404,
            f"The model `{model}` does not exist. Served model: `{limits.model_name}` "
            "(see /v1/models).",
            "model",
        )


def _get(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise bad(f"{key} must be a number, got {value!r}", key)
    if not isinstance(value, kind):
        name = kind.__name__ if isinstance(kind, type) else "number"
        raise bad(f"{key} must be of type {name}, got {value!r}", key)
    return value


def prompts(body: dict[str, Any], encode: Any, limits: Limits) -> list[list[int]]:
    """`prompt` as token-id lists: a string, a list of strings, token ids, or a batch."""
    p = body.get("prompt")
    if isinstance(p, str):
        batch = [encode(p)]
    elif (
        isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
    ):
        batch = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        batch = [encode(x) for x in p]
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        batch = p
    elif p is None or p == []:
        raise bad("You must pass at least one prompt", "prompt")
    else:
        raise bad(
            "prompt must be a string, a list of strings, token ids or lists of token ids", "prompt"
        )
    for ids in batch:
        check_prompt(ids, limits)
    return batch


def check_prompt(ids: list[Any], limits: Limits) -> None:
    if not ids:
        raise bad("You must pass at least one prompt (a prompt has no tokens)", "prompt")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limits.vocab_size:
            raise bad(f"Token id {t} is out of vocabulary", "prompt")
    if len(ids) >= limits.context:
        raise bad(
            f"This model's maximum context length is {limits.context} tokens. However, your "
            f"prompt contains {len(ids)} input tokens, which leaves no room for output tokens. "
            "Please reduce the length of the input prompt.",
            "input_tokens",
        )


def sampling(
    body: dict[str, Any], prompt_len: int, limits: Limits, *, default_max: int | None, chat: bool
) -> list[SamplingParams]:
    """One `SamplingParams` per choice (`n`); seeds differ per choice."""
    room = limits.context - prompt_len
    max_key = (
        "max_completion_tokens" if chat and body.get("max_completion_tokens") else "max_tokens"
    )
    max_tokens = _get(body, max_key, int, default_max if default_max is not None else room)
    if max_tokens < 1:
        raise bad(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    if temperature < 0:
        raise bad(f"temperature must be non-negative, got {temperature}.", "temperature")
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    if not 0 < top_p <= 1:
        raise bad(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    n = _get(body, "n", int, 1)
    if n < 1:
        raise bad(f"n must be at least 1, got {n}.", "n")
    if n > limits.max_n:
        raise bad(f"n must be at most {limits.max_n} (this engine's max_num_seqs), got {n}.",
                  "n")  # fmt: skip
    if n > 1 and temperature == 0:
        raise bad(f"n must be 1 when using greedy sampling, got {n}.", "n")
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise bad(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    stop_ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise bad("stop_token_ids must be a list of integers", "stop_token_ids")
    seed = _get(body, "seed", int, None)
    if chat:
        top = _get(body, "top_logprobs", int, 0)
        logprobs = top if _get(body, "logprobs", bool, False) else None
    else:
        logprobs = _get(body, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad(
            f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
            "logprobs",
        )
    for key in ("echo", "stream"):
        if body.get(key):
            raise bad(f"{key}=true is not supported by the embedded engine (use vLLM)", key)
    return [
        SamplingParams(
            max_tokens=min(max_tokens, room),
            temperature=temperature,
            top_p=top_p,
            seed=None if seed is None else seed + j,
            logprobs=logprobs,
            stop=list(stop),
            stop_token_ids=list(stop_ids),
            ignore_eos=bool(body.get("ignore_eos", False)),
            include_stop_str_in_output=bool(body.get("include_stop_str_in_output", False)),
            skip_special_tokens=bool(body.get("skip_special_tokens", True)),
        )
        for j in range(n)
    ]


__all__ = [
    "ApiError",
    "Limits",
    "bad",
    "check_model",
    "check_prompt",
    "parse_json",
    "prompts",
    "sampling",
]
