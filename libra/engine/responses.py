"""Response bodies of the embedded server, field for field as vLLM 0.32 writes them
(key order included; fields vLLM sets to null for these requests are null here too)."""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from tokenizers import Tokenizer

from libra import __version__
from libra.engine.core import Choice

FINGERPRINT = f"libra-{__version__}"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tok: Tokenizer, c: Choice) -> dict[str, Any] | None:
    if c.logprobs is None or c.top_logprobs is None:
        return None
    tokens = [_token_text(tok, t) for t in c.token_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    tops = []
    for t, lp, top in zip(tokens, c.logprobs, c.top_logprobs, strict=True):
        entry = {t: lp}  # the sampled token first, then the top k (vLLM's order)
        for tid, v in top:
            entry.setdefault(_token_text(tok, tid), v)
        tops.append(entry)
    return {
        "text_offset": offsets,
        "token_logprobs": c.logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def completion(
    model: str, tok: Tokenizer, batch: list[tuple[list[int], list[Choice]]], return_ids: bool
) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for prompt, outs in batch:
        for c in outs:
            choices.append(
                {
                    "index": len(choices),
                    "text": c.text,
                    "logprobs": completion_logprobs(tok, c),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "token_ids": c.token_ids if return_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt if return_ids else None,
                    "routed_experts": None,
                }
            )
    prompt_tokens = sum(len(p) for p, _ in batch)
    completion_tokens = sum(len(c.token_ids) for _, outs in batch for c in outs)
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:16]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": _usage(prompt_tokens, completion_tokens),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """vLLM's Hermes parser: (content before the first call or None, tool calls). If any
    call is not valid JSON with a name, nothing is parsed and the text stays content."""
    if "<tool_call>" not in text:
        return text, []
    try:
        calls = []
        for a, b in _TOOL_CALL.findall(text):
            obj = json.loads(a or b)
            calls.append(
                {
                    "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
                    "type": "function",
                    "function": {
                        "name": obj["name"],
                        "arguments": json.dumps(obj["arguments"], ensure_ascii=False),
                    },
                }
            )
    except (ValueError, KeyError, TypeError):
        return text, []
    content = text[: text.find("<tool_call>")]
    return content or None, calls


def _chat_logprobs(tok: Tokenizer, c: Choice) -> dict[str, Any] | None:
    if c.logprobs is None or c.top_logprobs is None:
        return None

    def item(tid: int, lp: float) -> dict[str, Any]:
        text = _token_text(tok, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for tid, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
        content.append({**item(tid, lp), "top_logprobs": [item(t, v) for t, v in top]})
    return {"content": content}


def chat(
    model: str,
    tok: Tokenizer,
    prompt: list[int],
    outs: list[Choice],
    *,
    parse_tools: bool,
    return_ids: bool,
) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(outs):
        content, calls = parse_tool_calls(c.text) if parse_tools else (c.text, [])
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if calls:
            message["tool_calls"] = calls
        message["reasoning"] = None
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": _chat_logprobs(tok, c),
                "finish_reason": "tool_calls" if calls else c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": c.token_ids if return_ids else None,
                "routed_experts": None,
            }
        )
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": _usage(len(prompt), sum(len(c.token_ids) for c in outs)),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt if return_ids else None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


__all__ = ["FINGERPRINT", "chat", "completion", "parse_tool_calls"]
