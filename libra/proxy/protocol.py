"""The OpenAI chat-completions wire format the proxy speaks: requests in, bodies out.

What a request may ask for, and what the proxy does with it:

- `messages`, `tools`, `tool_choice` (`auto` / `none`), `stop` (up to 4), `max_tokens` /
  `max_completion_tokens` (capped by Libra's `sampling.max_tokens`), `stream` (+
  `stream_options.include_usage`), `logprobs` (the sampled tokens' log-probs;
  `top_logprobs` lists stay empty), vLLM's `include_stop_str_in_output`: honoured.
- `temperature`, `top_p`, `seed`, penalties, `logit_bias`, `parallel_tool_calls`, `user`,
  `metadata`: ignored. In RL the sampling distribution belongs to the run (the trainer's
  policy ratio depends on it), so Libra's `[sampling]` config decides.
- `n` > 1, `tool_choice` `required` or a named function, `response_format` other than
  text, legacy `functions`, non-text content parts: a 400 naming the field. Libra cannot
  do them faithfully with token-in/token-out completions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from libra.jsonlimits import MAX_DEPTH, deeper_than


class ProxyError(Exception):
    """An answer other than a completion: HTTP status + OpenAI error body."""

    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None,
                          "code": self.code}}  # fmt: skip


def bad_request(message: str, code: str = "invalid_request") -> ProxyError:
    return ProxyError(400, message, code)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: list[Any]
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True
    """False for `tool_choice: none`: the text comes back as content."""
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False


def parse_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise bad_request(f"`{key}` (legacy) is not supported; pass `tools`")
    n = body.get("n")
    if n not in (None, 1):
        raise bad_request("`n` must be 1: one episode holds one conversation")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise bad_request(f"response_format {fmt.get('type')!r} is not supported (text only)")
    tools = body.get("tools") or None
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise bad_request("`tools` must be a list of objects")
    if tools is not None and deeper_than(tools):
        raise bad_request(f"`tools` nests lists and objects more than {MAX_DEPTH} levels deep")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise bad_request(
            f"tool_choice {choice!r} is not supported (auto or none): Libra samples the "
            "policy freely and cannot force a call"
        )
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("`stop` must be a string or a list of at most 4 non-empty strings")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise bad_request("`max_tokens` must be a positive integer")
    options = body.get("stream_options") or {}
    return ChatRequest(
        model=str(body.get("model") or "libra"),
        messages=body.get("messages") or [],
        tools=tools,
        parse_tools=tools is not None and choice != "none",
        max_tokens=max_tokens,
        stop=stops,
        include_stop_str=bool(body.get("include_stop_str_in_output")),
        stream=bool(body.get("stream")),
        include_usage=bool(options.get("include_usage")) if isinstance(options, dict) else False,
        logprobs=bool(body.get("logprobs")),
    )


@dataclass(slots=True)
class Reply:
    """One model turn as the agent sees it."""

    id: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    """OpenAI form: `{"id", "type": "function", "function": {"name", "arguments"}}`."""
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_logprobs: list[tuple[str, float]] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content, "refusal": None}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def _logprobs(reply: Reply) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in reply.token_logprobs
        ],
        "refusal": None,
    }


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def completion(req: ChatRequest, reply: Reply) -> dict[str, Any]:
    return {
        "id": reply.id,
        "object": "chat.completion",
        "created": reply.created,
        "model": req.model,
        "choices": [
            {
                "index": 0,
                "message": reply.message(),
                "logprobs": _logprobs(reply) if req.logprobs else None,
                "finish_reason": reply.finish_reason,
            }
        ],
        "usage": _usage(reply),
    }


def stream_events(req: ChatRequest, reply: Reply) -> list[bytes]:
    """Server-sent events of a finished turn: the whole message in one delta chunk."""

    def chunk(delta: dict[str, Any], finish: str | None, **extra: Any) -> bytes:
        doc = {
            "id": reply.id,
            "object": "chat.completion.chunk",
            "created": reply.created,
            "model": req.model,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": extra.pop("logprobs", None),
                    "finish_reason": finish,
                }
            ],
            **extra,
        }
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    delta: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(reply.tool_calls)]
    lps = _logprobs(reply) if req.logprobs else None
    events = [chunk(delta, None, logprobs=lps), chunk({}, reply.finish_reason)]
    if req.include_usage:
        usage = {"id": reply.id, "object": "chat.completion.chunk", "created": reply.created,
                 "model": req.model, "choices": [], "usage": _usage(reply)}  # fmt: skip
        events.append(b"data: " + orjson.dumps(usage) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def models(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                        "owned_by": "libra"}]}  # fmt: skip


__all__ = [
    "ChatRequest",
    "ProxyError",
    "Reply",
    "bad_request",
    "completion",
    "models",
    "parse_request",
    "stream_events",
]
