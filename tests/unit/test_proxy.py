"""The proxy's pure parts: canonical messages, history edits, tool-return status, the
OpenAI request rules, and how `load_env` tells an agent function from an env class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from libra.errors import ConfigError
from libra.proxy import AgentEnv
from libra.proxy import messages as m
from libra.proxy.protocol import ChatRequest, ProxyError, Reply, parse_request, stream_events
from libra.rollout.run import load_env

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "search", "arguments": '{"query": "x", "k": 2}'}}  # fmt: skip
HISTORY_RAW = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who?"},
    {"role": "assistant", "content": "Searching.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Doc 1"},
    {"role": "assistant", "content": "Done."},
]


def canon(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return m.canonical_all(msgs, {"call_1": "search"})


HISTORY = canon(HISTORY_RAW)


def test_an_echoed_reply_matches_however_the_sdk_serialised_it() -> None:
    echoed = {  # what `message.model_dump()` sends back, arguments re-serialised
        "role": "assistant", "content": [{"type": "text", "text": "Searching."}],
        "refusal": None, "annotations": [], "audio": None, "function_call": None,
        "tool_calls": [{"id": "other-id", "type": "function", "function": {
            "name": "search", "arguments": json.dumps({"k": 2, "query": "x"}, indent=1)}}],
    }  # fmt: skip
    msgs = canon([*HISTORY_RAW[:2], echoed, *HISTORY_RAW[3:], {"role": "user", "content": "?"}])
    assert m.extends(HISTORY, msgs)
    assert msgs[3]["name"] == "search"  # the tool message's name comes from its call id
    none_content = {"role": "assistant", "content": None}
    assert canon([none_content]) == canon([{"role": "assistant", "content": ""}])
    assert canon([{"role": "developer", "content": "x"}])[0]["role"] == "system"


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda h: h[:1] + h[2:], "message 1 (user) dropped"),
        (lambda h: h[:2] + h[3:], "message 2 (assistant) dropped"),
        (lambda h: h[:4], "message 4 (assistant) dropped"),
        (lambda h: [*h[:1], {**h[1], "content": "Who!"}, *h[2:]], "message 1 (user) rewritten"),
        (
            lambda h: [
                *h[:2],
                {
                    **h[2],
                    "tool_calls": [
                        {**CALL, "function": {"name": "search", "arguments": '{"query": "y"}'}}
                    ],
                },
                *h[3:],
            ],
            "message 2 (assistant) rewritten",
        ),
        (
            lambda h: [*h[:2], {"role": "user", "content": "?"}, *h[3:]],
            "message 2 (assistant) replaced",
        ),
    ],
)
def test_every_edit_of_the_history_is_found_and_named(edit: Any, reason: str) -> None:
    msgs = canon(edit([dict(x) for x in HISTORY_RAW]))
    assert not m.extends(HISTORY, msgs)
    assert m.describe_edit(HISTORY, msgs) == reason


@pytest.mark.parametrize(
    ("msg", "status"),
    [
        ({"content": "Doc 1(Title: Error) text"}, "ok"),
        ({"content": "42", "status": "error"}, "error"),
        ({"content": "Error: no such file", "status": "ok"}, "ok"),
        ({"content": "Error: no such file"}, "error"),
        ({"content": "  Traceback (most recent call last):\n  ..."}, "error"),
        ({"content": "ZeroDivisionError: division by zero"}, "error"),
        ({"content": '{"error": "bad query"}'}, "error"),
        ({"content": '{"error": null, "result": 1}'}, "ok"),
        ({"content": '{"is_error": true}'}, "error"),
        ({"content": "Timed out after 30 s"}, "timeout"),
        ({"content": "error: timeout while waiting"}, "timeout"),
        ({"content": "the error was fixed"}, "ok"),
    ],
)
def test_tool_status_is_inferred_by_the_documented_rules(msg: dict[str, Any], status: str) -> None:
    assert m.tool_status(msg, msg["content"]) == status


def test_bad_messages_name_the_problem() -> None:
    with pytest.raises(m.BadMessages, match=r"messages\[0\]: role 'function' is not supported"):
        canon([{"role": "function", "content": "x"}])
    with pytest.raises(m.BadMessages, match="'image_url' is not supported"):
        canon([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(m.BadMessages, match="status 'bad' is not one of ok, error, timeout"):
        m.tool_status({"status": "bad"}, "")
    with pytest.raises(m.BadMessages, match="non-empty list"):
        canon([])
    # arguments the record could not be written with (orjson writes 254 levels)
    deep = "[" * 300 + "]" * 300
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    with pytest.raises(m.BadMessages, match=r"tool_calls\[0\]: arguments nest more than 64"):
        canon([{"role": "user", "content": "q"},
               {"role": "assistant", "content": "", "tool_calls": [call]}])  # fmt: skip


def test_tool_returns_are_the_tool_messages_after_the_last_reply() -> None:
    msgs = canon([*HISTORY_RAW[:4], {"role": "user", "content": "more"}])
    assert m.trailing_tools(msgs) == [3]
    assert m.trailing_tools(HISTORY) == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"n": 3}, "`n` must be 1"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format 'json_object'"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ({"functions": [{"name": "f"}]}, "`functions` (legacy)"),
        ({"max_tokens": 0}, "positive integer"),
    ],
)
def test_requests_libra_cannot_serve_faithfully_are_refused(
    body: dict[str, Any], message: str
) -> None:
    with pytest.raises(ProxyError) as e:
        parse_request({"model": "m", "messages": [], **body})
    assert e.value.status == 400 and message in e.value.message


def test_request_options_that_shape_the_turn_are_kept() -> None:
    req = parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                         "stop": "END", "max_completion_tokens": 9, "tool_choice": "none",
                         "tools": [{"type": "function"}], "temperature": 0.1,
                         "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    assert (req.stop, req.max_tokens, req.parse_tools, req.stream, req.include_usage) == (
        ("END",),
        9,
        False,
        True,
        True,
    )


def test_a_stream_carries_the_whole_reply_then_done() -> None:
    reply = Reply(id="c", content=None, tool_calls=[CALL], finish_reason="tool_calls",
                  prompt_tokens=5, completion_tokens=3)  # fmt: skip
    events = stream_events(ChatRequest(model="m", messages=[], include_usage=True), reply)
    docs = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert events[-1] == b"data: [DONE]\n\n"
    assert docs[0]["choices"][0]["delta"]["tool_calls"] == [{"index": 0, **CALL}]
    assert docs[1]["choices"][0]["finish_reason"] == "tool_calls"
    assert docs[2]["usage"]["total_tokens"] == 8 and docs[2]["choices"] == []


AGENTS = """
import libra

async def run(task, client, k=1):
    return 1.0

class Callable:
    async def __call__(self, task, client):
        return 1.0

agent_object = Callable()

def sync_run(task, client):
    return 1.0

class Adder(libra.Env):
    def prompt(self, task):
        return []
"""


def test_load_env_tells_agent_functions_from_env_classes(tmp_path: Path) -> None:
    path = tmp_path / "agents.py"
    path.write_text(AGENTS)
    agent = load_env(f"{path}:run", {"k": 3})
    assert isinstance(agent, AgentEnv) and agent.options == {"k": 3}
    assert isinstance(load_env(f"{path}:agent_object", {}), AgentEnv)
    env = load_env(f"{path}:Adder", {})
    assert not isinstance(env, AgentEnv) and type(env).__name__ == "Adder"
    with pytest.raises(ConfigError, match="nor an async agent function"):
        load_env(f"{path}:sync_run", {})
    with pytest.raises(ConfigError, match=r"must accept \(task, client, nope\)"):
        load_env(f"{path}:run", {"nope": 1})
    with pytest.raises(ConfigError, match="writes its own prompts"):
        agent.prompt({})


def test_a_tool_messages_info_the_record_could_not_be_written_with_is_refused() -> None:
    """`info` on a tool message goes on the record as the agent sent it; one nested
    past the limit made the record unwritable (orjson writes 254 levels)."""
    from types import SimpleNamespace

    from libra.proxy.protocol import ChatRequest
    from libra.proxy.session import Session

    def returns(info: Any) -> Any:
        raw = [{"role": "user", "content": "q"},
               {"role": "tool", "name": "f", "content": "out", "info": info}]  # fmt: skip
        fake = SimpleNamespace(sh=SimpleNamespace(clock=lambda: 1.0), replied_at=0.0)
        return Session._returns(fake, ChatRequest("m", raw), canon(raw), [1], [3])  # type: ignore[arg-type]

    (ret,) = returns({"why": [[1]]})
    assert ret.info == {"why": [[1]]} and ret.tool == "f"
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    with pytest.raises(m.BadMessages, match=r"messages\[1\]: `info` nests more than 64 levels"):
        returns({"why": deep})
