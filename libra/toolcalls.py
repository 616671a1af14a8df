"""Parse tool calls out of a model turn's text, in the format the model was trained on.

Named as vLLM's `--tool-call-parser` names them (`PARSERS`):

    hermes       <tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>
    qwen3_coder  <tool_call><function=search><parameter=query>...</parameter></function></tool_call>
    llama3_json  <|python_tag|>{"name": "search", "parameters": {"query": "..."}}  (";" between)
    mistral      [TOOL_CALLS][{"name": "search", "arguments": {...}}]  or
                 [TOOL_CALLS]search[ARGS]{"query": "..."}

`parser_for(name, chat_template)` picks one; `auto` reads the model's chat template
(`template_format`). A call that cannot be parsed is returned as a `ParsedCall` with
`error` set, so the episode answers it with an error tool response instead of crashing.
The parser is pluggable: anything with `parse(text) -> list[ParsedCall]` works.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from libra.errors import ConfigError
from libra.jsonlimits import MAX_DEPTH, deeper_than

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
    return _checked(name, args)


def _checked(name: str, args: dict[str, Any]) -> ParsedCall:
    """The call, or an error when its arguments nest deeper than the record can be
    written (`libra.jsonlimits`): a degenerate policy can repeat brackets."""
    if deeper_than(args):
        return ParsedCall(name, error=f"arguments of {name} nest more than {MAX_DEPTH} levels")
    return ParsedCall(name, args)


_QWEN_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_QWEN_FUNC = re.compile(r"^\s*<function=([^>\n]+)>(.*?)(</function>|$)", re.DOTALL)
_QWEN_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(</parameter>|$)", re.DOTALL)


class Qwen3CoderParser:
    """Qwen3-Coder's XML calls: `<tool_call><function=NAME><parameter=KEY>VALUE
    </parameter>...</function></tool_call>`. A value is text (one leading and one
    trailing newline dropped); one that reads as a JSON number, boolean, null, object or
    array is taken as that (the format carries no types; vLLM converts by the tool's
    schema, which a parser of text does not see)."""

    def parse(self, text: str) -> list[ParsedCall]:
        calls = []
        for m in _QWEN_CALL.finditer(text):
            if not m.group(2):
                calls.append(
                    ParsedCall("", error="unterminated <tool_call> (missing </tool_call>)")
                )
                continue
            f = _QWEN_FUNC.match(m.group(1))
            if f is None or not f.group(1).strip():
                calls.append(ParsedCall("", error="tool call has no <function=NAME>"))
                continue
            name = f.group(1).strip()
            if not f.group(3):
                calls.append(ParsedCall(name, error=f"{name}: missing </function>"))
                continue
            args: dict[str, Any] = {}
            error = None
            for p in _QWEN_PARAM.finditer(f.group(2)):
                if not p.group(3):
                    error = f"{name}: parameter {p.group(1).strip()} misses </parameter>"
                    break
                args[p.group(1).strip()] = _qwen_value(p.group(2))
            calls.append(ParsedCall(name, error=error) if error else _checked(name, args))
        return calls


def _qwen_value(raw: str) -> Any:
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    head = value.strip()[:1]
    if head and (head in "{[-" or head.isdigit() or value.strip() in ("true", "false", "null")):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            pass
    return value


class Llama3JsonParser:
    """Llama 3.x JSON calls: `{"name": ..., "parameters"|"arguments": {...}}` objects,
    optionally after `<|python_tag|>`, several separated by `;`. As vLLM's
    `llama3_json`: every JSON object in the text is a call, and the turn has no call
    unless all of them name a function."""

    def parse(self, text: str) -> list[ParsedCall]:
        if "{" not in text:
            return []
        calls: list[ParsedCall] = []
        at = 0
        decoder = json.JSONDecoder()
        while (start := text.find("{", at)) >= 0:
            try:
                obj, end = decoder.raw_decode(text, start)
            except (ValueError, RecursionError) as e:
                return calls + [ParsedCall("", error=f"tool call is not valid JSON ({e})")]
            at = end
            if not isinstance(obj, dict) or "name" not in obj:
                return []  # a JSON answer, not a call
            calls.append(_parse_body(json.dumps(obj)))
        return calls


class MistralParser:
    """Mistral's `[TOOL_CALLS]`: a JSON list of `{"name", "arguments"}` (tokenizers
    before v11), or `NAME[ARGS]{...}` per call (v11 and later)."""

    def parse(self, text: str) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        for part in text.split("[TOOL_CALLS]")[1:]:
            body = part.strip()
            if body.startswith("["):
                try:
                    items, _ = decoder.raw_decode(body)
                except (ValueError, RecursionError) as e:
                    calls.append(ParsedCall("", error=f"[TOOL_CALLS] list is not valid JSON ({e})"))
                    continue
                if not isinstance(items, list):
                    items = [items]
                calls += [_parse_body(json.dumps(c)) for c in items]
                continue
            name, sep, rest = body.partition("[ARGS]")
            if not sep or not name.strip():
                calls.append(
                    ParsedCall("", error="[TOOL_CALLS] needs a JSON list or NAME[ARGS]{...}")
                )
                continue
            try:
                args, _ = decoder.raw_decode(rest.strip())
            except (ValueError, RecursionError) as e:
                calls.append(ParsedCall(name.strip(), error=f"arguments of {name.strip()} are "
                                                            f"not valid JSON ({e})"))  # fmt: skip
                continue
            calls.append(_parse_body(json.dumps({"name": name.strip(), "arguments": args})))
        return calls


PARSERS: dict[str, type] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
"""vLLM's `--tool-call-parser` name -> Libra's parser of that format."""


def template_format(chat_template: str) -> str:
    """The call format a chat template teaches (how it renders an assistant's
    `tool_calls`): `hermes` unless it writes another format's markers."""
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or (
        "<|start_header_id|>" in chat_template and '"parameters"' in chat_template
    ):
        return "llama3_json"
    return "hermes"


def parser_for(name: str, chat_template: str = "") -> ToolCallParser:
    """The parser called `name` (`auto`: the one `chat_template` teaches)."""
    if name == "auto":
        name = template_format(chat_template)
    if name not in PARSERS:
        raise ConfigError(f"tool_parser {name!r} is not known: use auto or one of "
                          f"{', '.join(PARSERS)} (vLLM's names)")  # fmt: skip
    parser: ToolCallParser = PARSERS[name]()
    return parser


__all__ = [
    "PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedCall",
    "Qwen3CoderParser",
    "ToolCallParser",
    "parser_for",
    "template_format",
]
