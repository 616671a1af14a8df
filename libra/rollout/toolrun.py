"""Run the tool calls of one model turn, in order; every failure is a `ToolResult`.

Each result's text is cut to `max_output_bytes` before anything tokenizes it
(`cap_output`, work bounded by the cap whatever the tool returned); `encode_returns`
is the tokenizer work on the results, run inline or in a worker thread by the caller
(`libra.rollout.offload`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from libra.chat import ChatTokenizer
from libra.toolcalls import ParsedCall
from libra.tooling import Context, Tool, ToolResult

DEFAULT_MAX_OUTPUT_BYTES = 256 * 1024
"""`LimitsConfig.max_tool_output_bytes`' default."""


@dataclass(frozen=True, slots=True)
class CallOutcome:
    call: ParsedCall
    result: ToolResult
    latency_s: float


async def run_calls(
    calls: Sequence[ParsedCall],
    ctx: Context,
    tools: dict[str, Tool],
    *,
    max_calls: int,
    timeout_cap_s: float | None,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    clock: Callable[[], float] = time.monotonic,
) -> list[CallOutcome]:
    """Sequentially (tools of one episode may share a sandbox, so order matters)."""
    out = []
    for i, call in enumerate(calls):
        t = clock()
        if i >= max_calls:
            result = ToolResult(f"Error: at most {max_calls} tool calls per turn", "error")
        else:
            result = cap_output(await _call(call, ctx, tools, timeout_cap_s), max_output_bytes)
        out.append(CallOutcome(call, result, clock() - t))
    return out


async def _call(
    call: ParsedCall, ctx: Context, tools: dict[str, Tool], cap: float | None
) -> ToolResult:
    if call.error is not None:
        return ToolResult(f"Error: malformed tool call: {call.error}", "error")
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(tools) or "none"
        return ToolResult(f"Error: unknown tool {call.name!r}; available: {known}", "error")
    return await tool.invoke(call.arguments, ctx, limit_s=cap)


def cap_output(result: ToolResult, max_bytes: int) -> ToolResult:
    """`result` with its text cut to `max_bytes` bytes of UTF-8 (at a character
    boundary) and a note saying so; `info["output_cut_chars"]` = characters it had. Lone
    surrogates (text no UTF-8 can hold; a tokenizer refused them and the episode ended)
    become `?`."""
    text = result.content
    if len(text) <= max_bytes:
        try:
            size = len(text.encode())
        except UnicodeEncodeError:  # lone surrogates: no tokenizer takes them
            text = text.encode("utf-8", "replace").decode()
            result = ToolResult(text, result.status, result.info)
            size = len(text.encode())
        if size <= max_bytes:
            return result
    kept = text[:max_bytes].encode("utf-8", "replace")[:max_bytes].decode("utf-8", "ignore")
    note = f"\n[output cut at {max_bytes} bytes: the tool returned {len(text)} characters]"
    info = {**(result.info or {}), "output_cut_chars": len(text)}
    return ToolResult(kept + note, result.status, info)


def encode_returns(
    tok: ChatTokenizer,
    tool_msgs: list[dict[str, Any]],
    schemas: list[dict[str, Any]] | None,
    closed: bool,
) -> tuple[list[int], list[int]]:
    """(payload tokens of each tool message, the delta to append after the model turn)."""
    payloads = [len(tok.encode(m["content"])) for m in tool_msgs]
    return payloads, tok.delta_ids(tool_msgs, schemas, model_closed_turn=closed)


__all__ = ["CallOutcome", "cap_output", "encode_returns", "run_calls"]
