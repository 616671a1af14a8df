"""Parse tool calls out of a model turn's text (Hermes / Qwen convention).

    <tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>

A call that cannot be parsed is returned as a `ParsedCall` with `error` set, so the
episode answers it with an error tool response instead of crashing. The parser is
pluggable: anything with `parse(text) -> list[ParsedCall]` works.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call is malformed (None when it parsed)."""


class ToolCallParser(Protocol):
    def parse(self, text: str) -> list[ParsedCall]: ...


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks; `arguments` may be an object or a JSON string."""

    def parse(self, text: str) -> list[ParsedCall]:
        calls = []
        for m in _CALL.finditer(text):
            body, closed = m.group(1).strip(), bool(m.group(2))
            if not closed:
                calls.append(
                    ParsedCall("", error="unterminated <tool_call> (missing </tool_call>)")
                )
                continue
            calls.append(_parse_body(body))
        return calls


def _parse_body(body: str) -> ParsedCall:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        return ParsedCall("", error=f"tool call is not valid JSON ({e})")
    if not isinstance(obj, dict):
        return ParsedCall("", error="tool call must be a JSON object with name and arguments")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall("", error='tool call has no "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = orjson.loads(args) if args.strip() else {}
        except orjson.JSONDecodeError as e:
            return ParsedCall(name, error=f"arguments of {name} are not valid JSON ({e})")
    if not isinstance(args, dict):
        return ParsedCall(name, error=f"arguments of {name} must be a JSON object")
    return ParsedCall(name, args)


__all__ = ["HermesParser", "ParsedCall", "ToolCallParser"]
