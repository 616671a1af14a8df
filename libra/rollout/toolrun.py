"""Run the tool calls of one model turn, in order; every failure is a `ToolResult`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from libra.toolcalls import ParsedCall
from libra.tooling import Context, Tool, ToolResult


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
    clock: Callable[[], float] = time.monotonic,
) -> list[CallOutcome]:
    """Sequentially (tools of one episode may share a sandbox, so order matters)."""
    out = []
    for i, call in enumerate(calls):
        t = clock()
        if i >= max_calls:
            result = ToolResult(f"Error: at most {max_calls} tool calls per turn", "error")
        else:
            result = await _call(call, ctx, tools, timeout_cap_s)
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
    if cap is None or cap >= tool.timeout:
        return await tool.invoke(call.arguments, ctx)
    try:
        async with asyncio.timeout(cap):
            return await tool.invoke(call.arguments, ctx)
    except TimeoutError:
        return ToolResult(f"Error: {call.name} timed out after {cap:g} s", "timeout")


__all__ = ["CallOutcome", "run_calls"]
