"""OpenAI chat messages in canonical form, history comparison, tool-return status (pure).

An agent sends its whole conversation on every request. The proxy compares it with the
conversation it holds (the previous request's messages + the reply it returned) in a
*canonical* form: what the chat template renders, nothing else. So an echoed reply
matches however the agent serialised it (`content: None` or `""`, arguments as a JSON
string in any spacing, extra keys such as `refusal` or `annotations`, changed tool-call
ids — ids are not rendered by Hermes templates); a change to anything that is rendered
(a message dropped, content rewritten, arguments changed, tools changed) is an edit.

Tool-return status (OpenAI tool messages carry none), first rule that applies:

1. an explicit `"status": "ok" | "error" | "timeout"` key on the tool message (the SDK
   passes extra keys through);
2. `timeout` when the text starts with `timeout`, `timed out` or `time limit exceeded`
   (optionally after `error:`);
3. `error` when the text starts with `error`, `exception`, `traceback (most recent call
   last)` or `SomethingError:` / `SomethingException:`, or is a JSON object with a truthy
   `error` or `is_error` key;
4. otherwise `ok`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from libra.jsonlimits import MAX_DEPTH, deeper_than
from libra.record import ToolStatus

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

_TIMEOUT = re.compile(r"(error:?\s*)?(timeout|timed out|time limit exceeded)", re.IGNORECASE)
_ERROR = re.compile(
    r"(error|exception|traceback \(most recent call last\)|\w+(error|exception):)",
    re.IGNORECASE,
)


class BadMessages(ValueError):
    """The request's messages cannot be rendered (the agent gets a 400 naming why)."""


def text_of(content: Any, where: str) -> str:
    """Message content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise BadMessages(f"{where}: content part of type {kind!r} is not supported "
                                  "(only text)")  # fmt: skip
        return "".join(parts)
    raise BadMessages(f"{where}: content must be a string, null or a list of text parts")


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as an object when they parse (agents re-serialise them)."""
    if isinstance(raw, str):
        try:
            return orjson.loads(raw) if raw.strip() else {}
        except orjson.JSONDecodeError:
            return raw
    return raw


def canonical(msg: Any, index: int, names: Mapping[str, str]) -> dict[str, Any]:
    """The rendered essence of one message; `names` maps tool-call ids to tool names."""
    where = f"messages[{index}]"
    if not isinstance(msg, Mapping):
        raise BadMessages(f"{where} is not an object")
    role = msg.get("role")
    if role not in ROLES:
        raise BadMessages(f"{where}: role {role!r} is not supported; use one of {sorted(ROLES)}")
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": text_of(msg.get("content"), where),
    }
    if role == "tool":
        call_id = msg.get("tool_call_id")
        out["name"] = str(msg.get("name") or names.get(str(call_id), ""))
    elif role == "assistant" and msg.get("tool_calls"):
        calls = []
        for j, call in enumerate(msg["tool_calls"]):
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise BadMessages(f"{where}.tool_calls[{j}] has no function name")
            args = _arguments(fn.get("arguments"))
            if isinstance(args, dict | list) and deeper_than(args):
                raise BadMessages(
                    f"{where}.tool_calls[{j}]: arguments nest more than {MAX_DEPTH} levels"
                )
            calls.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = calls
    return out


def canonical_all(messages: Any, names: Mapping[str, str]) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadMessages("messages must be a non-empty list")
    return [canonical(m, i, names) for i, m in enumerate(messages)]


def extends(history: Sequence[dict[str, Any]], messages: Sequence[dict[str, Any]]) -> bool:
    """`messages` starts with the whole of `history` (canonical forms)."""
    n = len(history)
    return len(messages) >= n and all(a == b for a, b in zip(history, messages, strict=False))


def describe_edit(history: Sequence[dict[str, Any]], messages: Sequence[dict[str, Any]]) -> str:
    """One line saying where `messages` leaves `history` (which it does not extend)."""
    for i, (old, new) in enumerate(zip(history, messages, strict=False)):
        if old == new:
            continue
        rest = history[i + 1 :]
        if (rest and extends(rest, messages[i:])) or (not rest and old["role"] != new["role"]):
            return f"message {i} ({old['role']}) dropped"
        what = "rewritten" if old["role"] == new["role"] else "replaced"
        return f"message {i} ({old['role']}) {what}"
    i = len(messages)
    return f"message {i} ({history[i]['role']}) dropped"


def trailing_tools(messages: Sequence[dict[str, Any]]) -> list[int]:
    """Indices of the tool messages after the last assistant message: the tool returns
    the agent reports with this request."""
    out: list[int] = []
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            break
        if messages[i]["role"] == "tool":
            out.append(i)
    return out[::-1]


def tool_status(raw: Mapping[str, Any], text: str) -> ToolStatus:
    """Status of a tool return (see the module docstring for the rules)."""
    explicit = raw.get("status")
    if explicit in ("ok", "error", "timeout"):
        return explicit
    if explicit is not None:
        raise BadMessages(f"tool message status {explicit!r} is not one of ok, error, timeout")
    head = text.lstrip()[:200]
    if _TIMEOUT.match(head):
        return "timeout"
    if _ERROR.match(head):
        return "error"
    if head.startswith("{"):
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError:
            return "ok"
        if isinstance(obj, dict) and (obj.get("error") or obj.get("is_error") is True):
            return "error"
    return "ok"


def render_form(msg: dict[str, Any]) -> dict[str, Any]:
    """A canonical message as the chat template gets it (content `None` for an assistant
    message with only tool calls, as HF templates expect)."""
    if msg["role"] == "assistant" and msg.get("tool_calls") and not msg["content"]:
        return {**msg, "content": None}
    return msg


__all__ = [
    "BadMessages",
    "canonical",
    "canonical_all",
    "describe_edit",
    "extends",
    "render_form",
    "text_of",
    "tool_status",
    "trailing_tools",
]
